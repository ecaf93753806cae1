"""A deeper sync point: ``KvLedger``, each rank's proof that its KV cache still holds what its forwards wrote.

The ranks hold different KV heads, so their caches cannot be compared with each
other; what each rank can prove is that its own cache was not altered after the
write (memory corruption, a kernel that writes outside its slot or position, a bug
that reuses a slot's rows).  ``KvLedger`` keeps, per slot, an exact digest of the
bits each forward wrote (an int64 sum of the values' bit patterns, reduced on the
cache's device: no float rounding, the same in any order), and ``KvLedger.altered``
recomputes it from the cache at a sync point.  A rank whose cache differs folds the
altered slots into its state digest (``KvLedger.state_digest``), so the head's sync
point names it (``EpDivergenceError``).  What it cannot see: a wrong value computed
at the write (the tests compare the sharded logits with one rank's instead).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch

from ..model import ShardedLm
from .digest import kv_digest
from .slots import LmState

_LOGGER = logging.getLogger("metrale_model_engine.reference")
_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bit_sum(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The int64 sum over ``dims`` of ``values``' bit patterns, read as integers of their own width."""
    return values.view(_SAME_WIDTH_INT[values.element_size()]).to(torch.int64).sum(dim=dims)


class KvLedger:
    """Per slot of ``lm``'s cache, the digest of what was written; built off (no cost) until asked for."""

    def __init__(self, lm: ShardedLm) -> None:
        self._attention = [block.attn for block in lm.blocks()]
        self._rank = lm.rank
        device = lm.embed.device
        self.written: torch.Tensor = torch.zeros(lm.num_slots, dtype=torch.int64, device=device)
        """By slot: the digest of every key and value row written since the slot was (re)allocated."""

    def forget(self, slot: int) -> None:
        """The slot holds a new sequence: nothing written yet."""
        self.written[slot] = 0

    def wrote_chunk(self, slot: int, start: int, end: int) -> None:
        """A prefill wrote positions ``start .. end - 1`` of ``slot``: add them, as the cache now holds them."""
        self.written[slot] += self._total(lambda cache: _bit_sum(cache[slot, start:end], (0, 1, 2)))

    def wrote_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode wrote position ``positions[i]`` of ``slots[i]`` for every ``i``: add each row."""
        self.written.index_add_(0, slots, self._total(lambda cache: _bit_sum(cache[slots, positions], (1, 2))))

    def altered(self, lengths: Iterable[tuple[int, int]]) -> list[int]:
        """The slots among ``(slot, length)`` whose cache's first ``length`` positions differ from what was written.

        One reduction over the cache on its device, then one transfer to the host.
        """
        held: Sequence[tuple[int, int]] = list(lengths)
        if not held:
            return []
        device = self.written.device
        slots = torch.tensor([slot for slot, _ in held], device=device)
        ends = torch.tensor([length for _, length in held], device=device)
        span = max(length for _, length in held)  # the positions past every slot's end are not read
        inside = (torch.arange(span, device=device)[None, :] < ends[:, None]).to(torch.int64)  # [n, span]
        found = self._total(lambda cache: (_bit_sum(cache[slots, :span], (2, 3)) * inside).sum(dim=1))
        differ = found != self.written[slots]
        return [slot for (slot, _), bad in zip(held, differ.tolist(), strict=True) if bad]

    def state_digest(self, slots: Sequence[LmState | None]) -> int:
        """``kv_digest`` of ``slots``, with the slots whose cache was altered after the write folded in (and logged):
        the link's ``state_digest`` when values are checked."""
        altered = self.altered((s.seq_id, s.length) for s in slots if s is not None)
        if not altered:
            return kv_digest(slots)
        _LOGGER.error("rank %d: the KV cache of slot(s) %s differs from what was written", self._rank, altered)
        return kv_digest(slots) ^ zlib.crc32(repr(altered).encode()) ^ (1 << 63)

    def _total(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reduce`` of every layer's key cache and value cache, summed."""
        total = torch.zeros((), dtype=torch.int64, device=self.written.device)
        for attention in self._attention:
            total = total + reduce(attention.k_cache) + reduce(attention.v_cache)
        return total
