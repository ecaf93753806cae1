"""The reference model's tokenizer: one token per UTF-8 byte, no special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .._core.namespace import PublicDir, public_dir

__all__ = ["VOCAB_SIZE", "decode_text", "encode"]


__dir__: PublicDir = public_dir(globals(), __all__)


VOCAB_SIZE: Final[int] = 256
"""Token ``t`` is the byte ``t``."""


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text``, as tokens.

    Raises:
        UnicodeEncodeError: ``text`` holds a lone surrogate, which UTF-8 cannot encode.
    """
    return list(text.encode("utf-8"))


def decode_text(tokens: Sequence[int]) -> str:
    """The text of the bytes ``tokens``; a byte sequence that is not UTF-8 becomes U+FFFD.

    Raises:
        TypeError: a token is not an int.
        ValueError: a token is outside ``0 ..= 255``; the message names its index.
    """
    for index, token in enumerate(tokens):
        if type(token) is not int:
            raise TypeError(f"tokens[{index}] must be an int, got {type(token).__name__} {token!r}")
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"tokens[{index}]={token} is not a byte (0 ..= {VOCAB_SIZE - 1})")
    return bytes(tokens).decode("utf-8", errors="replace")
