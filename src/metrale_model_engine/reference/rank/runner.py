"""The network one rank serves: ``LmRunner``, the sharded model read from its checkpoint, its KV cache, and the
forwards of a command once it is checked (a prefill chunk, a decode step, and at one rank the fused step).

Everything that writes the KV cache goes through it: the forwards, the slots' new and
ended sequences, the ledger of what was written (``check_kv_values``), and the decode
steps replayed from CUDA graphs (``cuda_graphs``).  The head and the workers run the
same forwards, through the model's ``forward_prefill`` and ``forward_decode``
(``Forwards``), which a subclass of ``ReferenceLm`` may override.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from ..checkpoint import Checkpoint, load_shard
from ..config import LmConfig
from ..experts import ExpertRouting
from ..graphs import DecodeGraphs
from ..layers import AllReduce
from ..model import ShardedLm, decode_span
from .checks import check_decode, check_prefill
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
    """Rank ``rank`` of ``world_size``'s shard of ``checkpoint``, with a KV cache of ``num_slots`` slots, and the
    forwards that write it (see the module).

    Args:
        checkpoint: the checkpoint opened; the rank reads its own slices alone.
        num_slots, rank, world_size, all_reduce, dtype, device, expert_routing: as
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
        num_slots: int,
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
            num_slots=num_slots,
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

    def reshard(self, rank: int, world_size: int) -> int:
        """Become rank ``rank`` of ``world_size`` (the group changed: ranks were lost): a new ``lm`` of that shard, the
        slices the old one held copied from it and only the others read from the checkpoint
        ([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard] with ``held``), a new KV cache (every
        sequence's keys and values are gone: the slots must be emptied), the ledger and CUDA graphs made again.

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
        """Slot ``seq_id`` holds a new, empty sequence (whatever it held is dropped)."""
        slots[seq_id] = LmState(seq_id)
        if self.ledger is not None:
            self.ledger.forget(seq_id)

    def end_sequence(self, slots: LmSlots, seq_id: int) -> None:
        """Slot ``seq_id`` is free."""
        slots[seq_id] = None

    def prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk (``check_prefill``) in ``state``'s slot; the logits after its last token.

        The state records the chunk once the forward has written its keys and values.
        """
        chunk = prompt[start : start + length]
        logits = self.lm.prefill(state.seq_id, torch.tensor(chunk, dtype=torch.int64), start)
        if self.ledger is not None:
            self.ledger.wrote_chunk(state.seq_id, start, start + length)
        state.extend(chunk)
        return logits

    def decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step (``check_decode``): ``states[i]`` feeds ``tokens[i]``; logits ``[B, vocab]``.

        The states record their tokens once the forward has written their keys and values.
        """
        rows = ([state.seq_id for state in states], list(tokens), [state.length for state in states])
        # one copy to the device, from pinned memory so that it does not make the host wait
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=self._device.type == "cuda")
        inputs = host.to(self._device, non_blocking=True)
        span = decode_span(max(rows[2]) + 1, self.config.max_seq_len)  # from host values: no wait
        if self._graphs is not None:
            logits = self._graphs(inputs, span)
        else:
            logits = self.lm.decode_step(inputs[0], inputs[1], inputs[2], span=span)
        if self.ledger is not None:
            self.ledger.wrote_rows(inputs[0], inputs[2])
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
        return logits

    def fused_step(
        self, slots: LmSlots, chunks: Sequence[Chunk], seq_ids: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        """One rank: prefill ``chunks`` and a decode step in one forward, everything checked before anything runs.

        Returns:
            The logits ``[len(seq_ids) + len(chunks), vocab]``: the decode rows', then each chunk's.

        Raises:
            RuntimeError: the model is one of several ranks.
            IndexError, KeyError, TypeError, ValueError: as ``check_prefill`` and ``check_decode``, or a slot
                named twice (nothing runs).
        """
        if self.lm.world_size > 1:
            raise RuntimeError(
                "fused_step is the one-rank path: with several ranks (is_ep()) each prefill and decode is a command "
                "of its own"
            )
        named = [seq_id for seq_id, *_ in chunks] + list(seq_ids)
        if len(set(named)) != len(named):
            raise ValueError(f"a fused step names each slot once, got {named}")
        states = [check_prefill(slots, seq_id, prompt, start, length, self.config) for seq_id, prompt, start, length
                  in chunks]  # fmt: skip
        rows = check_decode(slots, seq_ids, tokens, self.config) if seq_ids else []
        parts = [(seq_id, start, prompt[start : start + length]) for seq_id, prompt, start, length in chunks]
        logits = self.lm.fused_step(parts, [(s.seq_id, t, s.length) for s, t in zip(rows, tokens, strict=True)])
        for state, (seq_id, start, chunk) in zip(states, parts, strict=True):
            if self.ledger is not None:
                self.ledger.wrote_chunk(seq_id, start, start + len(chunk))
            state.extend(chunk)
        if self.ledger is not None and rows:
            at = torch.tensor([[s.seq_id for s in rows], [s.length for s in rows]], device=self._device)
            self.ledger.wrote_rows(at[0], at[1])
        for state, token in zip(rows, tokens, strict=True):
            state.append(token)
        return logits
