"""The frames a head puts on the wire, spelled from the layout in ``metrale_model_engine._frame``."""

from collections.abc import Sequence

from metrale_model_engine import FRAME_WORDS, INLINE_TOKENS, FrameKind

Frame = tuple[int, ...]


def _frame(*words: int) -> Frame:
    return (*words, *([0] * (FRAME_WORDS - len(words))))


def header(cmd: int, seq_id: int = 0) -> Frame:
    return _frame(FrameKind.HEADER, cmd, seq_id)


def word(value: int) -> Frame:
    return _frame(FrameKind.WORD, value)


def tokens(values: Sequence[int]) -> list[Frame]:
    """The broadcasts of one token array: its frame, then the bulk when it does not fit."""
    if len(values) <= INLINE_TOKENS:
        return [_frame(FrameKind.TOKENS, len(values), *values)]
    return [_frame(FrameKind.TOKENS, len(values)), tuple(values)]
