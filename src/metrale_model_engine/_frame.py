"""The frame: the one fixed-size message every small broadcast of the wire travels in.

A collective receive must ask for exactly the size the head sends (gloo aborts the
process otherwise), so headers, follow-up words and token counts all travel as one
frame of :data:`FRAME_WORDS` u32 words whose first word says what it is.  A worker
can then always receive the next message, read its kind, and tell a follow-up it
expected from the next command's header: a mismatch is an error it survives, never
a misread.  Token arrays longer than :data:`INLINE_TOKENS` follow their frame as one
bulk broadcast of exactly the count the frame announced.

Layouts (unused words are 0):

* header: ``[HEADER, cmd, seq_id]`` (``seq_id`` is 0 when the protocol leaves it off);
* word: ``[WORD, value]``;
* tokens: ``[TOKENS, count, token_0, ..., token_13]``, the tokens inline when
  ``count <= INLINE_TOKENS``, else in the bulk broadcast that follows.
"""

from __future__ import annotations

import enum
from typing import Final

FRAME_WORDS: Final[int] = 16
"""u32 words per frame (64 bytes: one cache line, and no slower than one word on gloo)."""

INLINE_TOKENS: Final[int] = FRAME_WORDS - 2
"""Token arrays up to this length travel inside their frame, in one broadcast."""


class FrameKind(enum.IntEnum):
    """The first word of a frame.  Distinct, unlikely values, so a corrupt frame shows."""

    HEADER = 0x4D45_0001
    WORD = 0x4D45_0002
    TOKENS = 0x4D45_0003

    def describe(self) -> str:
        """How error messages name a frame of this kind."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS: Final[dict[FrameKind, str]] = {
    FrameKind.HEADER: "a command header",
    FrameKind.WORD: "a follow-up word",
    FrameKind.TOKENS: "a token array",
}
