"""The digest of one rank's slots that sync points compare: ``kv_digest``."""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence

from .slots import LmState


def kv_digest(slots: Sequence[LmState | None]) -> int:
    """A u64 digest of the KV bookkeeping of ``slots``: which slots are held, the tokens each has fed, and the block
    table that holds them (a worker whose table diverged has another digest).

    Equal on two ranks when both ran the same commands; set as the link's
    ``state_digest``, so sync points compare it.
    """
    low = high = 0
    for seq_id, state in enumerate(slots):
        if state is not None:
            data = array("I", (seq_id, state.length, len(state.blocks), *state.blocks, *state.tokens)).tobytes()
            low, high = zlib.crc32(data, low), zlib.adler32(data, high)
    return (high << 32) | low
