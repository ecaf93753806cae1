"""Token ids to text as they come, and stop strings that may span tokens.

[`TextStream`][metrale_model_engine.serve.api.text.TextStream] decodes a request's tokens one by one: the
text of the tokens since an offset, less the text already given, once it no longer ends in an
unfinished character (U+FFFD: a byte-level tokenizer's partial UTF-8); the last prompt tokens
are its first context, so that a decoder that strips a leading space at the start of a text
sees none.  Stop strings: the text that could still begin one is held back until the next
token says, so a stop string split over several tokens is found and never shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

CONTEXT_TOKENS: Final = 5
"""Prompt tokens decoded before the first generated one (as context, never shown)."""
UNFINISHED: Final = "\ufffd"


class TextStream:
    """One request's generated text, as its tokens arrive (see the module).

    Args:
        decode: token ids to text (special tokens left out).
        prompt: the request's prompt ids; its last ``CONTEXT_TOKENS`` start the context.
        stops: the stop strings (none empty).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt: Sequence[int], stops: Sequence[str]) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stops = tuple(stops)
        self._hold = max((len(stop) for stop in stops), default=1) - 1
        self.text: str = ""
        """The text decoded so far (cut at a stop string once one was found)."""
        self._shown = 0
        self.stopped: bool = False
        """Whether a stop string was found: ``text`` ends before it."""

    def add(self, token: int) -> str:
        """Take the next token; the text that may be shown now (``""`` while it is held back)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(UNFINISHED):
            searched = max(0, len(self.text) - self._hold)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            self._find_stop(searched)
        end = len(self.text) if self.stopped else max(self._shown, len(self.text) - self._hold)
        return self._show(end)

    def finish(self) -> str:
        """The request ended: the text still held back (what no stop string began)."""
        return self._show(len(self.text))

    def _find_stop(self, start: int) -> None:
        found = [at for stop in self._stops if (at := self.text.find(stop, start)) >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _show(self, end: int) -> str:
        shown = self.text[self._shown : end]
        self._shown = max(self._shown, end)
        return shown
