"""The reference model served through the protocol: Metrale's command words, the slot state, ``ReferenceLm``.

Every rank builds a [`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] over its link.  The head drives it with
[`alloc`][metrale_model_engine.reference.ReferenceLm.alloc],
[`prefill`][metrale_model_engine.reference.ReferenceLm.prefill],
[`decode`][metrale_model_engine.reference.ReferenceLm.decode] and
[`free`][metrale_model_engine.reference.ReferenceLm.free]: each checks its arguments, sends its command as one message,
then runs the same forward as the workers.  Each worker runs [`run_worker`][metrale_model_engine.run_worker], whose hook
reads the command, checks it against its own slots, and runs that forward.  A forward makes ``2 * n_layers``
all-reduces; they pair up across ranks because every rank runs the same commands
in the same order.

The command words are Metrale's:

* ``CMD_ALLOC`` (``0xFFFFFFF1``) and one word: 1 allocates slot ``seq_id`` (a
  slot that was held is freed first), 0 frees it.  No collective.
* ``CMD_PREFILL`` (``0xFFFFFFF0``): words ``chunk_len``, ``chunk_start``,
  ``full_len``, then the whole prompt (``full_len`` tokens) as one token array;
  the chunk ``prompt[chunk_start : chunk_start + chunk_len]`` goes into the slot's
  KV cache, after the ``chunk_start`` tokens it holds already.
* ``CMD_DECODE`` (``0xFFFFFFE0``): a batched command
  ([`send_batch`][metrale_model_engine.batching.send_batch]): a count, then the slot ids
  and one token per slot as two token arrays; each slot feeds its token.

Failures (docs/errors.md, 'Failures inside a forward') are the library's:
prefill and decode are declared collective
([`ReferenceLm.ep_collective_commands`][metrale_model_engine.reference.ReferenceLm.ep_collective_commands]), the
all-reduces run through [`Collectives`][metrale_model_engine.torch.Collectives], and the head's forward runs inside
``with link.collective():``.  So any failure of a prefill or decode on any rank (a slot a worker does not hold, a chunk
out of order, follow-ups it cannot read, an error in its forward, a rank that dies, stalls or
leaves inside one) stops the run on every rank with a
[`RunStopped`][metrale_model_engine.RunStopped] that names the failing rank, the command and,
where its report arrived, its error; no rank goes on out of step.  An alloc or free
that fails on a worker (no collective to pair) and an unknown word are ordinary failed
commands: the worker stays up and the head raises them at its next command or sync
point.

A prefill chunk carries the whole prompt, as Metrale's word layout has it: a prompt
of ``L`` tokens in chunks of ``c`` costs ``L * ceil(L / c)`` tokens on the wire.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

import torch
import torch.distributed as dist
from torch import nn

from .. import EpLink, LinkedEp, RunStopped, check_slot
from .._core.namespace import PublicDir, public_dir
from ..batching import recv_batch, send_batch
from ..torch import DEFAULT_COLLECTIVE_TIMEOUT, EXIT_GRACE, Collectives
from .checkpoint import Checkpoint, load_shard
from .config import LmConfig
from .experts import ExpertRouting
from .graphs import DecodeGraphs
from .layers import AllReduce
from .model import ShardedLm, decode_span
from .state import KvLedger, LmSlots, LmState, check_decode, check_prefill, check_prompt, held_state, kv_digest

__all__ = [
    "CMD_ALLOC",
    "CMD_DECODE",
    "CMD_PREFILL",
    "EXIT_GRACE",
    "Chunk",
    "LmSlots",
    "LmState",
    "ReferenceLm",
    "RunStopped",
    "TimeSpent",
    "check_decode",
    "check_prefill",
    "check_prompt",
    "kv_digest",
]


__dir__: PublicDir = public_dir(globals(), __all__)


CMD_PREFILL: Final = 0xFFFFFFF0
"""A prefill chunk: ``chunk_len``, ``chunk_start``, ``full_len``, then the whole prompt."""
CMD_ALLOC: Final = 0xFFFFFFF1
"""Allocate (word 1; a held slot is freed first) or free (word 0) slot ``seq_id``."""
CMD_DECODE: Final = 0xFFFFFFE0
"""A batched decode step: a count, the slot ids, one token per slot."""
_LOGGER = logging.getLogger("metrale_model_engine.reference")

Chunk = tuple[int, Sequence[int], int, int]
"""A prefill chunk of a fused step: ``(seq_id, prompt, start, length)``, as ``ReferenceLm.prefill`` takes it."""


@dataclass
class TimeSpent:
    """Seconds a rank spent, summed since it was built: sending commands, and inside its all-reduces.

    On the CPU an all-reduce returns when it is done; on CUDA it returns once queued,
    so there ``collectives_s`` counts only the launch.
    """

    protocol_s: float = 0.0
    collectives_s: float = 0.0

    def copy(self) -> TimeSpent:
        """A snapshot, to subtract from a later one."""
        return dataclasses.replace(self)


class ReferenceLm(nn.Module, LinkedEp[LmState]):
    """The reference model on one rank, as a ``torch.nn.Module`` that speaks the protocol through its link.

    Every rank of the group builds one, at the same point, over its own link; the
    group that carries the model's all-reduces is ``group`` (default the world
    group), whose rank and size must be the link's.  With one rank (a link over a
    [`SoloTransport`][metrale_model_engine.transport.SoloTransport]) it is the single-GPU
    model: ``is_ep()`` is false, no command is sent and no collective runs, and
    torch.distributed need not be initialised.

    Args:
        link: this rank's link; its slot count is the model's.
        checkpoint: a checkpoint directory in the Hugging Face layout, or one opened
            already ([`Checkpoint`][metrale_model_engine.reference.checkpoint.Checkpoint]);
            default the shipped model.  Every rank opens it and reads its own shard alone.
        dtype: of the weights, KV cache and activations; default the checkpoint's own.
        max_seq_len: the context served (the KV cache's positions per slot); default
            the model's ``max_position_embeddings``.  Ignored when ``checkpoint`` is opened already.
        device: where they live; by default the current CUDA device under NCCL, else
            torch's default.
        group: the process group of the all-reduces.
        all_reduce: the in-place sum over the ranks; default
            [`Collectives.all_reduce`][metrale_model_engine.torch.Collectives.all_reduce]
            over ``group`` (tests pass their own to run ranks without a group; it is
            checked and counted as ``Collectives``' are, and a failure of theirs
            stops the run as a failed collective does).
        collective_timeout: seconds one all-reduce may wait for the other ranks
            before the run stops (see [`Collectives`][metrale_model_engine.torch.Collectives]).
        check_kv_values: make sync points deeper: each rank also checks that its
            KV cache still holds what its forwards wrote (``KvLedger``;
            a digest per write, a reduction of the cache at each sync point), and a
            rank whose cache was altered reports another state digest.  Default off.
        cuda_graphs: replay decode steps from CUDA graphs
            ([`DecodeGraphs`][metrale_model_engine.reference.DecodeGraphs]): one launch per step instead of one per
            kernel.  One rank, on a CUDA device.
        expert_routing: how the picked experts run (``experts``).

    Attributes:
        lm: the sharded transformer ([`ShardedLm`][metrale_model_engine.reference.ShardedLm]).
        checkpoint: what it was loaded from.
        spent: the time this rank spent sending commands and in all-reduces.

    Raises:
        ValueError: the link's group cannot share the model (see
            [`check_world`][metrale_model_engine.reference.check_world]), or ``group`` is
            not the link's group.
        RuntimeError: several ranks, no ``all_reduce`` and torch.distributed is not initialised.
        CheckpointError: the checkpoint cannot be served (the message says which file and what).
        OSError: a weights file cannot be read.
        ValueError: ``cuda_graphs`` with the model not on a CUDA device, or with several ranks.
    """

    ep_collective_commands: ClassVar[frozenset[int]] = frozenset({CMD_PREFILL, CMD_DECODE})
    """Prefill and decode run the forward's all-reduces: a failure of either stops the run on every rank."""

    def __init__(
        self,
        link: EpLink,
        *,
        checkpoint: str | Path | Checkpoint | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        all_reduce: AllReduce | None = None,
        collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
        check_kv_values: bool = False,
        cuda_graphs: bool = False,
        expert_routing: ExpertRouting = "auto",
    ) -> None:
        super().__init__()
        self.ep_link = link
        rank, world_size = link.rank, link.world_size
        self._reduce = all_reduce
        self._reduce_passed = all_reduce is not None
        if all_reduce is None:  # built at one rank too: it checks its arguments, and does nothing
            self._reduce = Collectives(link, group, timeout=collective_timeout).all_reduce
            if world_size > 1 and device is None and dist.is_initialized() and dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
        opened = (
            checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint, max_seq_len=max_seq_len)
        )
        self.checkpoint: Checkpoint = opened
        reduce = self._all_reduce if world_size > 1 else None
        self.lm: ShardedLm = ShardedLm(
            opened.config,
            num_slots=link.num_slots,
            rank=rank,
            world_size=world_size,
            all_reduce=reduce,
            dtype=opened.dtype if dtype is None else dtype,
            device=device,
            expert_routing=expert_routing,
        )
        load_shard(self.lm, opened)
        self._device = self.lm.embed.device
        self._graphs = DecodeGraphs(self.lm) if cuda_graphs else None
        self.spent: TimeSpent = TimeSpent()
        self._sends = world_size > 1  # one rank is the single-GPU model: no command to send, nothing to pay
        self.kv_ledger: KvLedger | None = KvLedger(self.lm) if check_kv_values else None
        link.state_digest = kv_digest if self.kv_ledger is None else self._checked_digest

    def _checked_digest(self, slots: Sequence[LmState | None]) -> int:
        """``kv_digest``, with the slots whose KV cache was altered after the write folded in (and logged)."""
        assert self.kv_ledger is not None
        altered = self.kv_ledger.altered((s.seq_id, s.length) for s in slots if s is not None)
        if not altered:
            return kv_digest(slots)
        _LOGGER.error("rank %d: the KV cache of slot(s) %s differs from what was written", self.ep_link.rank, altered)
        return kv_digest(slots) ^ zlib.crc32(repr(altered).encode()) ^ (1 << 63)

    @property
    def config(self) -> LmConfig:
        """The model's shape."""
        return self.lm.config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a sequence (the checkpoint's ``eos_token_id``); empty when it has none."""
        return frozenset(self.checkpoint.eos_token_ids)

    # -- head ------------------------------------------------------------------

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Head: give slot ``seq_id`` a new, empty sequence on every rank (what it held is freed)."""
        self.ep_link.raise_if_stopped()
        check_slot(seq_id, slots)
        self._send(self.ep_link.send_command, seq_id, CMD_ALLOC, 1)
        self._new_sequence(slots, seq_id)

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Head: free slot ``seq_id`` on every rank.  Raises ``KeyError`` if it is free (nothing is sent)."""
        self.ep_link.raise_if_stopped()
        held_state(slots, seq_id)
        self._send(self.ep_link.send_command, seq_id, CMD_ALLOC, 0)
        slots[seq_id] = None

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Head: feed the chunk ``prompt[start : start + length]`` into slot ``seq_id`` on every rank.

        Returns:
            The logits ``[vocab]`` after the chunk's last token.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as
                [`check_prefill`][metrale_model_engine.reference.check_prefill] (nothing is sent).
            EpSendError, EpWorkerFailed: as [`EpLink.send_command`][metrale_model_engine.EpLink.send_command] (nothing
                is sent).
            RunStopped: the run is over (see the module).
        """
        self.ep_link.raise_if_stopped()
        state = check_prefill(slots, seq_id, prompt, start, length, self.config)
        self._send(self.ep_link.send_command, seq_id, CMD_PREFILL, length, start, len(prompt), prompt)
        with self.ep_link.collective():
            return self.forward_prefill(state, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Head: one decode step on every rank: slot ``seq_ids[i]`` feeds ``tokens[i]``.

        Returns:
            The logits ``[len(seq_ids), vocab]``.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as
                [`check_decode`][metrale_model_engine.reference.check_decode] (nothing is sent).
            EpSendError, EpWorkerFailed: as [`EpLink.send_command`][metrale_model_engine.EpLink.send_command] (nothing
                is sent).
            RunStopped: the run is over (see the module).
        """
        self.ep_link.raise_if_stopped()
        states = check_decode(slots, seq_ids, tokens, self.config)
        self._send(send_batch, self.ep_link, CMD_DECODE, seq_ids, tokens)
        with self.ep_link.collective():
            return self.forward_decode(states, tokens)

    def fused_step(
        self, slots: LmSlots, chunks: Sequence[Chunk], seq_ids: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        """One rank: prefill chunks and a decode step in one forward, the single-GPU fused path.

        Each chunk ``(seq_id, prompt, start, length)`` is a
        [`prefill`][metrale_model_engine.reference.ReferenceLm.prefill]; slot ``seq_ids[i]`` feeds ``tokens[i]`` as in
        [`decode`][metrale_model_engine.reference.ReferenceLm.decode]; every slot at most once. Everything is checked
        before anything runs; the states record their tokens once the forward has written them.

        Returns:
            The logits ``[len(seq_ids) + len(chunks), vocab]``: the decode rows', then each chunk's.

        Raises:
            RuntimeError: several ranks share the model (``is_ep()``): the scheduler sends
                each command alone there, as Metrale's does.
            IndexError, KeyError, TypeError, ValueError: as
                [`check_prefill`][metrale_model_engine.reference.check_prefill] and
                [`check_decode`][metrale_model_engine.reference.check_decode], or a slot named twice (nothing runs).
        """
        if self.is_ep():
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
            if self.kv_ledger is not None:
                self.kv_ledger.wrote_chunk(seq_id, start, start + len(chunk))
            state.extend(chunk)
        if self.kv_ledger is not None and rows:
            at = torch.tensor([[s.seq_id for s in rows], [s.length for s in rows]], device=self._device)
            self.kv_ledger.wrote_rows(at[0], at[1])
        for state, token in zip(rows, tokens, strict=True):
            state.append(token)
        return logits

    def _send(self, send: Callable[..., None], *args: object) -> None:
        """Run ``send(*args)``, one command to the workers, counting its time as protocol (one rank: nothing)."""
        if self._sends:
            started = time.perf_counter()
            send(*args)
            self.spent.protocol_s += time.perf_counter() - started

    # -- every rank: the forwards, once a command is known and checked ------------

    def _new_sequence(self, slots: LmSlots, seq_id: int) -> None:
        slots[seq_id] = LmState(seq_id)
        if self.kv_ledger is not None:
            self.kv_ledger.forget(seq_id)

    def forward_prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk (``check_prefill``) in ``state``'s slot; the logits after its last token.

        The state records the chunk once the forward has written its keys and values.
        """
        chunk = prompt[start : start + length]
        logits = self.lm.prefill(state.seq_id, torch.tensor(chunk, dtype=torch.int64), start)
        if self.kv_ledger is not None:
            self.kv_ledger.wrote_chunk(state.seq_id, start, start + length)
        state.extend(chunk)
        return logits

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step (``check_decode``): ``states[i]`` feeds ``tokens[i]``; logits ``[B, vocab]``.

        Every rank runs it once the command is known: the head after sending it, a
        worker after reading it.  The states record their tokens once the forward
        has written their keys and values.
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
        if self.kv_ledger is not None:
            self.kv_ledger.wrote_rows(inputs[0], inputs[2])
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
        return logits

    # -- worker ----------------------------------------------------------------

    def ep_worker_step(self, slots: MutableSequence[LmState | None]) -> bool:
        """Worker: as ``LinkedEp.ep_worker_step``, after checking that ``slots`` has the link's slot count.

        Raises:
            ValueError: ``len(slots)`` is not the link's ``num_slots`` (a command for
                a slot this rank lacks could not even reach the hook, and the head
                would wait in its forward): ``run_worker`` lets it through, and the
                worker exits.
        """
        if len(slots) != self.ep_link.num_slots:
            raise ValueError(f"slots has {len(slots)} entries, but the link has num_slots={self.ep_link.num_slots}")
        return super().ep_worker_step(slots)

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[LmState | None]) -> None:
        """Worker hook: read the command whole, check it against this rank's slots, run it.

        A prefill or decode that fails here in any way stops the run (they are
        [`ep_collective_commands`][metrale_model_engine.reference.ReferenceLm.ep_collective_commands]); a bad alloc or
        free, and an unknown word, fail as ordinary commands.
        """
        link = self.ep_link
        if cmd == CMD_DECODE:
            seq_ids, tokens = recv_batch(link, slots)
            self.forward_decode(check_decode(slots, seq_ids, tokens, self.config), tokens)
        elif cmd == CMD_PREFILL:
            length, start, full_length = link.recv_word(), link.recv_word(), link.recv_word()
            prompt = link.recv_tokens(full_length)
            state = check_prefill(slots, seq_id, prompt, start, length, self.config)
            self.forward_prefill(state, prompt, start, length)
        elif cmd == CMD_ALLOC:
            word = link.recv_word()
            if word == 1:
                self._new_sequence(slots, seq_id)
            elif word == 0:
                held_state(slots, seq_id)
                slots[seq_id] = None
            else:
                raise ValueError(f"an alloc's word must be 1 (alloc) or 0 (free), got {word}")
        else:
            super().ep_run_command(seq_id, cmd, slots)

    # -- the collectives -----------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        assert self._reduce is not None  # the forward runs it only with several ranks
        if self._reduce_passed:  # Collectives checks and counts its own
            self.ep_link.check_collective("an all-reduce")
        try:
            self._reduce(tensor)
        except RunStopped:
            raise
        except Exception as error:  # an all_reduce passed in that failed: a collective's failure all the same
            raise self.ep_link.collective_failed(error, what="an all-reduce", grace=EXIT_GRACE) from error
        self.spent.collectives_s += time.perf_counter() - started
