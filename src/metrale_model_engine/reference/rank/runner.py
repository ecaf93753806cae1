"""The network one rank serves: ``LmRunner``, the sharded model read from its checkpoint, its KV cache, and the
forwards of a command once it is checked (a prefill chunk, a decode step, and at one rank the fused step).

Everything that writes the KV cache goes through it: the forwards, the slots' new and
ended sequences, the block-table entries a command gives a sequence (``take_blocks``),
the ledger of what was written (``check_kv_values``), and the decode steps replayed from
CUDA graphs (``cuda_graphs``).  The head and the workers run the same forwards, through the
model's ``forward_prefill`` and ``forward_decode`` (``Forwards``), which a subclass of
``ReferenceLm`` may override.  The tables are the head's decision (``KvBlocks``); here they
are only followed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from ..checkpoint import Checkpoint, load_shard
from ..config import LmConfig
from ..network.experts import ExpertRouting
from ..network.graphs import DecodeGraphs
from ..network.layers import AllReduce
from ..network.model import ShardedLm, decode_span
from .checks import Pool
from .ledger import KvLedger
from .slots import LmSlots, LmState

Chunk = tuple[int, Sequence[int], int, int]
"""A prefill chunk of a fused step: ``(seq_id, prompt, start, length)``, as ``ReferenceLm.prefill`` takes it."""


class Forwards(Protocol):
    """The forwards of checked commands, as the head and a worker call them: ``ReferenceLm``'s own."""

    def forward_prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk in ``state``'s slot; the logits after its last token."""
        ...

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step: ``states[i]`` feeds ``tokens[i]``; the logits, one row each."""
        ...


class LmRunner:
    """Rank ``rank`` of ``world_size``'s shard of ``checkpoint``, with a KV cache of ``num_blocks`` blocks of
    ``block_size`` positions, and the forwards that write it (see the module).

    Args:
        checkpoint: the checkpoint opened; the rank reads its own slices alone.
        num_blocks, block_size, rank, world_size, all_reduce, dtype, device, expert_routing: as
            [`ShardedLm`][metrale_model_engine.reference.ShardedLm] takes them (``dtype`` ``None``: the checkpoint's).
        cuda_graphs: replay decode steps from CUDA graphs (``DecodeGraphs``: one rank, on a CUDA device).
        check_kv_values: keep a ``KvLedger`` of what the forwards write (``ledger``).

    Raises:
        As ``ShardedLm``, ``load_shard`` and ``DecodeGraphs``.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        num_blocks: int,
        block_size: int,
        rank: int,
        world_size: int,
        all_reduce: AllReduce | None,
        dtype: torch.dtype | None,
        device: torch.device | None,
        expert_routing: ExpertRouting,
        cuda_graphs: bool,
        check_kv_values: bool,
    ) -> None:
        self._checkpoint = checkpoint
        self._build = functools.partial(
            ShardedLm,
            checkpoint.config,
            num_blocks=num_blocks,
            block_size=block_size,
            all_reduce=all_reduce,
            dtype=checkpoint.dtype if dtype is None else dtype,
            device=device,
            expert_routing=expert_routing,
        )
        self.lm: ShardedLm = self._build(rank=rank, world_size=world_size)
        load_shard(self.lm, checkpoint)
        self._device = self.lm.embed.device
        self._graphs = DecodeGraphs(self.lm) if cuda_graphs else None
        self.ledger: KvLedger | None = KvLedger(self.lm) if check_kv_values else None
        """The digests of what the forwards wrote, with ``check_kv_values``; else ``None``."""
        self.pool: Pool = Pool(num_blocks, block_size)
        """The shape of the cache, the same on every rank."""

    def reshard(self, rank: int, world_size: int) -> int:
        """Become rank ``rank`` of ``world_size`` (the group changed: ranks were lost): a new ``lm`` of that shard, the
        slices the old one held copied from it and only the others read from the checkpoint
        ([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard] with ``held``), a new KV cache of as
        many blocks (every sequence's keys and values are gone: the slots and the head's block manager must be
        emptied), the ledger and CUDA graphs made again.

        Returns:
            The bytes read from the checkpoint's files.

        Raises:
            ValueError: ``world_size`` ranks cannot split the model, or ``rank`` is not one of them.
            OSError: a file cannot be read.  ``lm`` is then the old one still.
        """
        old = self.lm
        new = self._build(rank=rank, world_size=world_size)
        read = load_shard(new, self._checkpoint, held=old)
        self.lm = new
        del old  # its weights and cache go before the graphs are recorded again
        if self._graphs is not None:
            self._graphs = DecodeGraphs(new)
        if self.ledger is not None:
            self.ledger = KvLedger(new)
        return read

    @property
    def config(self) -> LmConfig:
        """The model's shape."""
        return self.lm.config

    def new_sequence(self, slots: LmSlots, seq_id: int) -> None:
        """Slot ``seq_id`` holds a new, empty sequence, with an empty table (whatever it held is dropped)."""
        slots[seq_id] = LmState(seq_id)

    def end_sequence(self, slots: LmSlots, seq_id: int) -> None:
        """Slot ``seq_id`` is free."""
        slots[seq_id] = None

    def take_blocks(self, state: LmState, blocks: Sequence[int], cached: Sequence[int] = ()) -> None:
        """``state``'s table gains the checked entries ``blocks``, whose first blocks hold the tokens ``cached``
        already (a prefix found cached: the sequence holds them now); the others are handed out afresh."""
        fresh = blocks[len(cached) // self.pool.block_size :]
        if self.ledger is not None:
            self.ledger.forget(fresh)
        state.blocks.extend(blocks)
        state.extend(cached)

    def prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk (``check_prefill``) in ``state``'s blocks; the logits after its last token.

        The state records the chunk once the forward has written its keys and values.
        """
        chunk = prompt[start : start + length]
        table = torch.tensor(state.blocks, dtype=torch.int64)
        logits = self.lm.prefill(table, torch.tensor(chunk, dtype=torch.int64), start)
        if self.ledger is not None:
            self.ledger.wrote([self._row(state, position) for position in range(start, start + length)])
        state.extend(chunk)
        return logits

    def decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step (``check_decode``): ``states[i]`` feeds ``tokens[i]``; logits ``[B, vocab]``.

        The states record their tokens once the forward has written their keys and values.
        """
        span = decode_span(max(state.length for state in states) + 1, self.config.max_seq_len)  # host values: no wait
        columns = -(-span // self.pool.block_size)
        rows = [[token, state.length, *state.blocks[:columns], *[0] * (columns - len(state.blocks))]
                for state, token in zip(states, tokens, strict=True)]  # fmt: skip
        # one copy to the device, from pinned memory so that it does not make the host wait
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=self._device.type == "cuda")
        inputs = host.to(self._device, non_blocking=True)
        if self._graphs is not None:
            logits = self._graphs(inputs, span)
        else:
            logits = self.lm.decode_step(inputs[:, 2:], inputs[:, 0], inputs[:, 1], span=span)
        if self.ledger is not None:
            self.ledger.wrote([self._row(state, state.length) for state in states])
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
        return logits

    def fused_step(
        self, chunks: Sequence[tuple[LmState, Sequence[int], int, int]], states: Sequence[LmState],
        tokens: Sequence[int],
    ) -> torch.Tensor:  # fmt: skip
        """One rank: checked prefill chunks ``(state, prompt, start, length)`` and a checked decode step (``states[i]``
        feeds ``tokens[i]``) in one forward.

        Returns:
            The logits ``[len(states) + len(chunks), vocab]``: the decode rows', then each chunk's.
        """
        parts = [(state.blocks, start, prompt[start : start + length]) for state, prompt, start, length in chunks]
        logits = self.lm.fused_step(parts, [(s.blocks, t, s.length) for s, t in zip(states, tokens, strict=True)])
        if self.ledger is not None:
            rows = [self._row(state, state.length) for state in states]
            rows.extend(self._row(state, p) for state, _, start, length in chunks for p in range(start, start + length))
            self.ledger.wrote(rows)
        for (state, *_), (_, _, chunk) in zip(chunks, parts, strict=True):
            state.extend(chunk)
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
        return logits

    def _row(self, state: LmState, position: int) -> int:
        """The cache row of ``state``'s ``position``."""
        size = self.pool.block_size
        return state.blocks[position // size] * size + position % size
