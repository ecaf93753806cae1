"""The reference model served through the protocol: ``ReferenceLm``, composed of its parts in ``rank``.

Every rank builds a [`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] over its link.  The head drives it with
[`alloc`][metrale_model_engine.reference.ReferenceLm.alloc],
[`prefill`][metrale_model_engine.reference.ReferenceLm.prefill],
[`decode`][metrale_model_engine.reference.ReferenceLm.decode] and
[`free`][metrale_model_engine.reference.ReferenceLm.free]: each checks its arguments, sends its command as one message,
then runs the same forward as the workers (``rank.commands.head``); the head decides which blocks of every rank's KV
cache each sequence's positions go to ([`kv_blocks`][metrale_model_engine.reference.ReferenceLm.kv_blocks]), and the
commands carry them.  Each worker runs
[`run_worker`][metrale_model_engine.run_worker], whose hook reads the command, checks it against its own slots, and
runs that forward (``rank.commands.worker``).  A forward makes ``2 * n_layers`` all-reduces; they pair up across ranks
because every rank runs the same commands in the same order.  The command words are Metrale's, each with its wire
layout in ``rank.commands.words``: ``CMD_ALLOC`` (alloc or free, no collective), ``CMD_PREFILL`` (a chunk, sent with
the whole prompt) and ``CMD_DECODE`` (a batched decode step).

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

The names this module exported before its parts moved to ``rank`` still work here, with a ``DeprecationWarning``,
until 0.3: their home is [`metrale_model_engine.reference`][metrale_model_engine.reference] (``RunStopped`` is
``metrale_model_engine.RunStopped``, ``EXIT_GRACE`` ``metrale_model_engine.torch.EXIT_GRACE``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, MutableSequence, Sequence
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from .. import EpLink, LinkedEp
from .. import RunStopped as _RunStopped
from .._core.namespace import moved_names
from ..reform import Reform
from ..torch import DEFAULT_COLLECTIVE_TIMEOUT
from ..torch import EXIT_GRACE as _EXIT_GRACE
from .blocks import KvBlocks
from .checkpoint import Checkpoint
from .config import LmConfig
from .network.experts import ExpertRouting
from .network.layers import AllReduce
from .network.model import ShardedLm
from .rank import checks as _checks
from .rank.checks import Pool
from .rank.commands import words as _commands
from .rank.commands.head import HeadCommands
from .rank.commands.words import COLLECTIVE_COMMANDS
from .rank.commands.worker import WorkerHook
from .rank.digest import kv_digest
from .rank.ledger import KvLedger
from .rank.pool import KvMemory, pool_blocks
from .rank.reduce import ServedAllReduce, group_device
from .rank.runner import Chunk, LmRunner
from .rank.slots import LmSlots, LmState
from .rank.timing import TimeSpent


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
        max_seq_len: the context served (the most positions a sequence holds); default
            the model's ``max_position_embeddings``.  Ignored when ``checkpoint`` is opened already.
        kv_memory: the size of this rank's KV cache, a pool of blocks that every sequence
            draws on: bytes (an ``int``), a fraction of the memory free once the weights are
            loaded (a ``float`` in ``(0, 1]``: on CUDA, its device's; on the CPU, the host's
            ``MemAvailable``, shared by the host's ranks), or ``None`` (the default): as
            many blocks as every slot's whole context takes.  Every rank ends with the same
            block count (the smallest, when they differ: a collective at this point).
        block_size: the positions of a block of the KV cache; default 16.
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
        expert_routing: how the picked experts run (``network.experts``).

    Attributes:
        lm: the sharded transformer ([`ShardedLm`][metrale_model_engine.reference.ShardedLm]).
        checkpoint: what it was loaded from.
        spent: the time this rank spent sending commands and in all-reduces.
        kv_ledger: with ``check_kv_values``, the digests of what the forwards wrote; else ``None``.

    Raises:
        ValueError: the link's group cannot share the model (see
            [`check_world`][metrale_model_engine.reference.check_world]), or ``group`` is
            not the link's group.
        RuntimeError: several ranks, no ``all_reduce`` and torch.distributed is not initialised.
        CheckpointError: the checkpoint cannot be served (the message says which file and what).
        OSError: a weights file cannot be read.
        ValueError: ``cuda_graphs`` with the model not on a CUDA device, or with several ranks; ``kv_memory``
            that holds no block, or a bad ``block_size``.
        TypeError: ``kv_memory`` is not an int, a float or ``None``.
    """

    ep_collective_commands: ClassVar[frozenset[int]] = COLLECTIVE_COMMANDS
    """Prefill and decode run the forward's all-reduces: a failure of either stops the run on every rank."""

    ep_reforms: ClassVar[bool] = True
    """A lost worker rank stops the run wherever the head finds it; the head's
    [`reform_link`][metrale_model_engine.reform.reform_link] (which [`Server`][metrale_model_engine.reference.Server]
    calls) forms the link again over the ranks left, and every rank reshards in
    [`ep_reformed`][metrale_model_engine.reference.ReferenceLm.ep_reformed].  A head that does not re-form ends the
    run as before: its workers end once it closes its link."""

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
        kv_memory: KvMemory = None,
        block_size: int = 16,
    ) -> None:
        super().__init__()
        self._own_group = group is not None  # a group the link's re-form does not carry over
        self.reloaded_bytes: int = 0
        """The bytes the last reshard ([`ep_reformed`][metrale_model_engine.reference.ReferenceLm.ep_reformed]) read
        from the checkpoint: the slices this rank did not hold before; 0 before any."""
        self.ep_link = link
        self.spent: TimeSpent = TimeSpent()
        reduce = ServedAllReduce(link, self.spent, group=group, all_reduce=all_reduce, timeout=collective_timeout)
        if all_reduce is None and device is None:
            device = group_device(link.world_size, group)
        opened = (
            checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint, max_seq_len=max_seq_len)
        )
        self.checkpoint: Checkpoint = opened
        config, real_dtype = opened.config, opened.dtype if dtype is None else dtype
        num_blocks = pool_blocks(
            link, config, config.shard(link.rank, link.world_size), kv_memory=kv_memory, block_size=block_size,
            itemsize=real_dtype.itemsize, weights=opened.shard_bytes(link.rank, link.world_size, real_dtype),
            device=torch.empty(0).device if device is None else torch.device(device),
        )  # fmt: skip
        self._runner = LmRunner(
            opened,
            num_blocks=num_blocks,
            block_size=block_size,
            rank=link.rank,
            world_size=link.world_size,
            all_reduce=reduce if link.world_size > 1 else None,
            dtype=dtype,
            device=device,
            expert_routing=expert_routing,
            cuda_graphs=cuda_graphs,
            check_kv_values=check_kv_values,
        )
        self.lm: ShardedLm = self._runner.lm
        self.kv_ledger: KvLedger | None = self._runner.ledger
        identity = zlib.crc32(repr((str(opened.directory), str(real_dtype), config)).encode())
        self.kv_blocks: KvBlocks = KvBlocks(num_blocks, block_size, identity)
        """The head's block manager: which blocks of every rank's KV cache each slot's sequence holds (a worker
        keeps one too, and never uses it: its tables come in the commands)."""
        self._head = HeadCommands(link, self._runner, self, self.spent, self.kv_blocks)
        self._worker = WorkerHook(link, self._runner, self)
        link.state_digest = kv_digest if self.kv_ledger is None else self.kv_ledger.state_digest

    @property
    def pool(self) -> Pool:
        """The shape of every rank's KV cache: ``num_blocks`` blocks of ``block_size`` positions."""
        return self._runner.pool

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
        """Head: give slot ``seq_id`` a new, empty sequence on every rank (what it held is freed, its blocks too)."""
        self._head.alloc(slots, seq_id)

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Head: free slot ``seq_id`` on every rank, and its blocks.  Raises ``KeyError`` if it is free (nothing is
        sent)."""
        self._head.free(slots, seq_id)

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Head: feed the chunk ``prompt[start : start + length]`` into slot ``seq_id`` on every rank.

        The chunk's positions go to the blocks the slot holds (``kv_blocks``: reserved by a
        scheduler, else allocated now), which the command carries.  A new sequence whose
        reservation found a cached prefix starts after it.

        Returns:
            The logits ``[vocab]`` after the chunk's last token.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as
                [`check_prefill`][metrale_model_engine.reference.check_prefill] (nothing is sent).
            RuntimeError: the blocks the chunk needs are not free (nothing is sent).
            EpSendError, EpWorkerFailed: as [`EpLink.send_command`][metrale_model_engine.EpLink.send_command] (nothing
                is sent).
            RunStopped: the run is over (see the module).
        """
        return self._head.prefill(slots, seq_id, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Head: one decode step on every rank: slot ``seq_ids[i]`` feeds ``tokens[i]``.

        A slot whose next position starts a block gets one (``kv_blocks``), which the command carries.

        Returns:
            The logits ``[len(seq_ids), vocab]``.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as
                [`check_decode`][metrale_model_engine.reference.check_decode] (nothing is sent).
            RuntimeError: the blocks the step needs are not free (nothing is sent).
            EpSendError, EpWorkerFailed: as [`EpLink.send_command`][metrale_model_engine.EpLink.send_command] (nothing
                is sent).
            RunStopped: the run is over (see the module).
        """
        return self._head.decode(slots, seq_ids, tokens)

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
            RuntimeError: the blocks the step needs are not free (nothing runs).
        """
        return self._head.fused(slots, chunks, seq_ids, tokens)

    # -- every rank: the forwards, once a command is known and checked ------------

    def forward_prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk (``check_prefill``) in ``state``'s slot; the logits after its last token.

        The state records the chunk once the forward has written its keys and values.
        """
        return self._runner.prefill(state, prompt, start, length)

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step (``check_decode``): ``states[i]`` feeds ``tokens[i]``; logits ``[B, vocab]``.

        Every rank runs it once the command is known: the head after sending it, a
        worker after reading it.  The states record their tokens once the forward
        has written their keys and values.
        """
        return self._runner.decode(states, tokens)

    # -- every rank: a re-form ------------------------------------------------------

    def ep_reformed(self, reform: Reform, slots: MutableSequence[LmState | None]) -> None:
        """Every rank, once the link re-formed over the ranks left: become rank ``reform.rank`` of
        ``reform.world_size``.

        The new shard keeps the slices this rank held already and reads only the others from the checkpoint
        ([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard] with ``held``: the bytes read are
        ``reloaded_bytes``); the KV cache is made again for the new shard with as many blocks (a block holds more
        heads now, so more bytes), empty: every slot is emptied and every block freed, the prefix cache with them
        (the head's [`Server`][metrale_model_engine.reference.Server] computes its requests' keys and values again);
        the ledger (``check_kv_values``) starts again.  The all-reduces follow the link into its new epoch by
        themselves.

        Raises:
            ValueError: the model was built over a ``group`` of its own, which the re-form does not carry over.
            OSError: a weights file cannot be read.
        """
        if self._own_group:
            raise ValueError(
                "this ReferenceLm reduces over a group of its own (group=...), which a re-form of the link does not "
                "carry over: build it over the default group to go on past a lost worker"
            )
        self.reloaded_bytes = self._runner.reshard(reform.rank, reform.world_size)
        self.lm = self._runner.lm
        self.kv_ledger = self._runner.ledger
        self.ep_link.state_digest = kv_digest if self.kv_ledger is None else self.kv_ledger.state_digest
        self.kv_blocks.clear()
        for seq_id in range(len(slots)):
            slots[seq_id] = None

    # -- worker ----------------------------------------------------------------

    def ep_worker_step(self, slots: MutableSequence[LmState | None]) -> bool:
        """Worker: as ``LinkedEp.ep_worker_step``, after checking that ``slots`` has the link's slot count.

        Raises:
            ValueError: ``len(slots)`` is not the link's ``num_slots`` (a command for
                a slot this rank lacks could not even reach the hook, and the head
                would wait in its forward): ``run_worker`` lets it through, and the
                worker exits.
        """
        self._worker.check_slots(slots)
        return super().ep_worker_step(slots)

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[LmState | None]) -> None:
        """Worker hook: read the command whole, check it against this rank's slots, run it.

        A prefill or decode that fails here in any way stops the run (they are
        [`ep_collective_commands`][metrale_model_engine.reference.ReferenceLm.ep_collective_commands]); a bad alloc or
        free, and an unknown word, fail as ordinary commands.
        """
        if not self._worker.run(seq_id, cmd, slots):
            super().ep_run_command(seq_id, cmd, slots)


_FRONT = "metrale_model_engine.reference"
__getattr__: Callable[[str], object] = moved_names(
    __name__,
    {
        "CMD_ALLOC": (_FRONT, _commands.CMD_ALLOC),
        "CMD_DECODE": (_FRONT, _commands.CMD_DECODE),
        "CMD_PREFILL": (_FRONT, _commands.CMD_PREFILL),
        "check_decode": (_FRONT, _checks.check_decode),
        "check_prefill": (_FRONT, _checks.check_prefill),
        "check_prompt": (_FRONT, _checks.check_prompt),
        "RunStopped": ("metrale_model_engine", _RunStopped),
        "EXIT_GRACE": ("metrale_model_engine.torch", _EXIT_GRACE),
    },
)
"""The names this module exported before its parts moved to ``rank``, given on with a warning until 0.3."""
