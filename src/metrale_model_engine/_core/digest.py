"""The stream digest: a CRC-32 of every message a head sends, in order, which sync points compare."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

DIGEST_EDGE: Final[int] = 4096
"""Bytes at each end of a message that the stream digest folds; a message of up to twice this is folded whole."""


def fold_message(crc: int, parts: Sequence[Buffer]) -> int:
    """The stream digest ``crc`` (a CRC-32) with one more message, the concatenation of ``parts``, folded in.

    A message of up to ``2 * DIGEST_EDGE`` bytes (every header, word and decode batch
    of up to 1,000 slots) is folded whole; a longer one by its length (8 bytes,
    little-endian), then its first and its last ``DIGEST_EDGE`` bytes, so that a
    65,536-token array costs what a 2-page one does.  Its middle is left to the
    transport, which delivers a message whole or not at all (the ring's stamps, the
    backend's own stream).
    """
    if len(parts) == 1:  # the common case: one message of a few items
        part = parts[0]
        if (len(part) if type(part) is bytes else memoryview(part).nbytes) <= 2 * DIGEST_EDGE:
            return zlib.crc32(part, crc)
    views = [memoryview(part).cast("B") for part in parts]
    total = sum(view.nbytes for view in views)
    if total <= 2 * DIGEST_EDGE:
        for view in views:
            crc = zlib.crc32(view, crc)
        return crc
    crc = zlib.crc32(total.to_bytes(8, "little"), crc)
    return _fold_range(_fold_range(crc, views, 0, DIGEST_EDGE), views, total - DIGEST_EDGE, total)


def _fold_range(crc: int, views: Sequence[memoryview], start: int, stop: int) -> int:
    """``crc`` with bytes ``start ..< stop`` of the concatenation of ``views`` folded in."""
    at = 0
    for view in views:
        low, high = max(start - at, 0), min(stop - at, view.nbytes)
        if low < high:
            crc = zlib.crc32(view[low:high], crc)
        at += view.nbytes
        if at >= stop:
            break
    return crc
