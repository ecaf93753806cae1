"""A tokenizer of one character per id, written beside a checkpoint with ``transformers``' own
``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``, and ``chat_template.jinja`` when a
template is given): text and token ids map one to one, so a server's text says which tokens it chose."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A small template: each message as ``<role>content``, a line each, then ``<assistant>``."""


def char(token: int) -> str:
    """The character of ``token``: ASCII for the first 128 ids, then from U+0180 on."""
    return chr(token) if token < 128 else chr(0x100 + token)


def text_of(tokens: Sequence[int]) -> str:
    return "".join(char(token) for token in tokens)


def write_char_tokenizer(directory: Path, vocab_size: int, chat_template: str | None = None) -> Path:
    """Write the tokenizer of ``vocab_size`` ids into ``directory`` (with ``chat_template``, if given)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models

    raw = Tokenizer(models.BPE(vocab={char(token): token for token in range(vocab_size)}, merges=[]))
    raw.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)  # type: ignore[no-untyped-call]
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return directory
