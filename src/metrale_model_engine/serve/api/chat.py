"""A checkpoint's chat template: found beside the weights (or given), rendered in a sandbox.

Where it is looked for, first found first: the ``--chat-template FILE`` given; the
checkpoint's ``chat_template.jinja``; ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates, of which ``default``).  It is rendered as
``transformers``' ``apply_chat_template`` does: jinja2's immutable sandbox, ``trim_blocks`` and
``lstrip_blocks``, with ``messages``, ``add_generation_prompt``, the ``bos_token`` and
``eos_token`` of ``tokenizer_config.json``, and ``raise_exception``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that cannot be read, or that refused to render these messages (the message says why)."""


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, origin: str, special_tokens: Mapping[str, str] | None = None) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{origin}: not a jinja2 template ({error})") from None
        self.origin = origin
        """Where it was read."""
        self._special = dict(special_tokens or {})

    @classmethod
    def find(cls, directory: Path, given: Path | None = None) -> ChatTemplate | None:
        """The template for the checkpoint in ``directory`` (``given`` first); ``None`` when it has none.

        Raises:
            ChatTemplateError: a file that cannot be read or parsed.
        """
        config = _tokenizer_config(directory)
        special = {name: token for name in ("bos_token", "eos_token") if (token := _token(config.get(name)))}
        for path in (given, directory / "chat_template.jinja"):
            if path is not None and (path == given or path.is_file()):
                try:
                    return cls(path.read_text(encoding="utf-8"), str(path), special)
                except OSError as error:
                    raise ChatTemplateError(f"{path}: cannot be read ({error.strerror})") from None
        found = config.get("chat_template")
        if isinstance(found, list):
            named = {entry.get("name"): entry.get("template") for entry in found if isinstance(entry, dict)}
            found = named.get("default")
        if isinstance(found, str):
            return cls(found, f"{directory / 'tokenizer_config.json'}: chat_template", special)
        return None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt's text for ``messages``.

        Raises:
            ChatTemplateError: the template refused them, or failed (its words).
        """
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ChatTemplateError(f"{path}: not a JSON object ({error})") from None
    return config if isinstance(config, dict) else {}


def _token(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an object with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
