"""A deeper sync point: ``KvLedger``, each rank's proof that its KV cache still holds what its forwards wrote.

The ranks hold different KV heads, so their caches cannot be compared with each
other; what each rank can prove is that its own cache was not altered after the
write (memory corruption, a kernel that writes outside its rows, a bug that hands one
block to two sequences).  ``KvLedger`` keeps, per block of the cache, an exact digest of
the bits each forward wrote into it (an int64 sum of the values' bit patterns, reduced on
the cache's device: no float rounding, the same in any order), and ``KvLedger.altered``
recomputes it from the cache at a sync point, over the positions the held sequences fill
(a block shared by several, through a cached prefix, counted once).  A block handed out
afresh is forgotten (``forget``) before it is written.  A rank whose cache differs folds
the slots of the altered blocks into its state digest (``KvLedger.state_digest``), so the
head's sync point names it (``EpDivergenceError``).  What it cannot see: a wrong value computed
at the write (the tests compare the sharded logits with one rank's instead).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch

from ..network.model import ShardedLm
from .digest import kv_digest
from .slots import LmState

_LOGGER = logging.getLogger("metrale_model_engine.reference")
_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bit_sum(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The int64 sum over ``dims`` of ``values``' bit patterns, read as integers of their own width."""
    return values.view(_SAME_WIDTH_INT[values.element_size()]).to(torch.int64).sum(dim=dims)


class KvLedger:
    """Per block of ``lm``'s cache, the digest of what was written; built off (no cost) until asked for."""

    def __init__(self, lm: ShardedLm) -> None:
        self._attention = [block.attn for block in lm.blocks()]
        self._rank = lm.rank
        self._block_size = lm.block_size
        self._device = lm.embed.device
        self.written: torch.Tensor = torch.zeros(lm.num_blocks, dtype=torch.int64, device=self._device)
        """By block: the digest of every key and value row written since the block was handed out afresh."""

    def forget(self, blocks: Sequence[int]) -> None:
        """``blocks`` were handed out afresh: nothing of their new sequence is written yet."""
        if blocks:
            self.written[torch.tensor(list(blocks), device=self._device)] = 0

    def wrote(self, rows: Sequence[int]) -> None:
        """A forward wrote the cache rows ``rows`` (``block * block_size + offset``): add each to its block."""
        at = torch.tensor(list(rows), device=self._device)
        sums = self._total(lambda cache: _bit_sum(cache.flatten(0, 1)[at], (1, 2)))
        self.written.index_add_(0, at // self._block_size, sums)

    def altered(self, held: Iterable[tuple[Sequence[int], int]]) -> list[int]:
        """The blocks among the ``(table, length)`` of held sequences whose filled positions differ from what was
        written.  One reduction over those blocks on the cache's device, then one transfer to the host."""
        filled: dict[int, int] = {}  # by block: the positions the sequences fill
        size = self._block_size
        for table, length in held:
            for index, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(size, max(0, length - index * size)))
        if not filled:
            return []
        blocks = torch.tensor(list(filled), device=self._device)
        ends = torch.tensor(list(filled.values()), device=self._device)
        inside = (torch.arange(size, device=self._device)[None, :] < ends[:, None]).to(torch.int64)  # [n, size]
        found = self._total(lambda cache: (_bit_sum(cache[blocks], (2, 3)) * inside).sum(dim=1))
        differ = found != self.written[blocks]
        return [block for block, bad in zip(filled, differ.tolist(), strict=True) if bad]

    def state_digest(self, slots: Sequence[LmState | None]) -> int:
        """``kv_digest`` of ``slots``, with the slots whose blocks were altered after the write folded in (and
        logged): the link's ``state_digest`` when values are checked."""
        states = [state for state in slots if state is not None]
        altered = set(self.altered((state.blocks, state.length) for state in states))
        if not altered:
            return kv_digest(slots)
        named = [state.seq_id for state in states if altered.intersection(state.blocks)]
        _LOGGER.error(
            "rank %d: the KV cache of slot(s) %s differs from what was written (block(s) %s)",
            self._rank, named, sorted(altered),
        )  # fmt: skip
        return kv_digest(slots) ^ zlib.crc32(repr(named).encode()) ^ (1 << 63)

    def _total(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reduce`` of every layer's key cache and value cache, summed."""
        total = torch.zeros((), dtype=torch.int64, device=self._device)
        for attention in self._attention:
            total = total + reduce(attention.k_cache) + reduce(attention.v_cache)
        return total
