"""The reference model served through the protocol: Metrale's command words, the slot state, :class:`ReferenceLm`.

Every rank builds a :class:`ReferenceLm` over its link.  The head drives it with
:meth:`~ReferenceLm.alloc`, :meth:`~ReferenceLm.prefill`, :meth:`~ReferenceLm.decode`
and :meth:`~ReferenceLm.free`: each checks its arguments, sends its command as one
message, then runs the same forward as the workers.  Each worker runs
:func:`~metrale_model_engine.run_worker`, whose hook reads the command, checks it
against its own slots, and runs that forward.  A forward makes ``2 * n_layers``
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
  (:func:`~metrale_model_engine.batching.send_batch`): a count, then the slot ids
  and one token per slot as two token arrays; each slot feeds its token.

Failures (the README's contract for failures inside a forward):

* A prefill or decode a worker cannot run (a slot it does not hold, a chunk out
  of order, follow-ups it cannot read, an error in its forward) and an unknown
  word: the worker raises :class:`~metrale_model_engine.EpCommandRefused`, so the
  link reports it to the head and the worker leaves (its process exits, which
  closes its sockets).  The ranks still in the forward see their all-reduce fail:
  a worker raises :class:`~metrale_model_engine.EpLinkError` and leaves too; the
  head raises :class:`RunStopped` (an ``EpLinkError``) saying which ranks stopped
  and, where the transport carries reports between sync points (shared memory),
  why.  The run stops on every rank, as Metrale's poisoned communicator stops it;
  no rank goes on out of step.
* A rank that dies inside a collective: the same, from the all-reduce's failure on.
* The head's own forward failing after it sent the command: the model is broken
  for good (every later head call raises :class:`RunStopped`) and the link is
  closed; the workers' all-reduce fails once the head's process exits.
* An alloc or free that fails on a worker (no collective to pair): an ordinary
  failed command; the worker stays up and the head raises it at its next command
  or sync point.

Measured on gloo (CPU).  Under NCCL a collective's failure surfaces through the
communicator's own watchdog and timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), not
as an exception of the all-reduce call, so the bounds above are gloo's.

A prefill chunk carries the whole prompt, as Metrale's word layout has it: a prompt
of ``L`` tokens in chunks of ``c`` costs ``L * ceil(L / c)`` tokens on the wire.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from array import array
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
import torch.distributed as dist
from torch import nn

from .. import (
    EpCommandRefused,
    EpLink,
    EpLinkError,
    EpWorkerFailed,
    LinkedEp,
    SequenceState,
    WorkerFailure,
    check_slot,
)
from ..batching import check_batch, recv_batch, send_batch
from .layers import AllReduce
from .model import LmConfig, ShardedLm
from .weights import load_weights

__all__ = [
    "CMD_ALLOC",
    "CMD_DECODE",
    "CMD_PREFILL",
    "EXIT_GRACE",
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

CMD_PREFILL: Final = 0xFFFFFFF0
"""A prefill chunk: ``chunk_len``, ``chunk_start``, ``full_len``, then the whole prompt."""
CMD_ALLOC: Final = 0xFFFFFFF1
"""Allocate (word 1; a held slot is freed first) or free (word 0) slot ``seq_id``."""
CMD_DECODE: Final = 0xFFFFFFE0
"""A batched decode step: a count, the slot ids, one token per slot."""
EXIT_GRACE: Final = 5.0
"""Seconds the head looks for the rank behind a failed all-reduce (a failing worker takes a moment to exit)."""


class LmState(SequenceState):
    """One sequence in its slot: the tokens fed so far, whose keys and values fill positions ``0 .. length - 1``."""

    __slots__ = ()

    @property
    def length(self) -> int:
        """Positions of the slot's KV cache in use: the next token goes at this position."""
        return len(self.tokens)


LmSlots = MutableSequence[LmState | None]
"""One rank's slot array for the reference model."""


class RunStopped(EpLinkError):
    """The run is over on every rank: a rank refused a command, died or failed inside a forward.

    :attr:`failures` holds what workers reported (a refusal, with its reason), when
    their reports reached the head; empty otherwise (the message names the ranks
    that exited).  Unlike :class:`~metrale_model_engine.EpWorkerFailed` for an
    ordinary command, nothing can be retried: the model refuses every later call.
    """

    failures: tuple[WorkerFailure, ...]

    def __init__(self, message: str, failures: Sequence[WorkerFailure] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


@dataclass
class TimeSpent:
    """Seconds a rank spent, summed since it was built: sending commands, and inside its all-reduces.

    On the CPU an all-reduce returns when it is done; on CUDA it returns once queued,
    so there :attr:`collectives_s` counts only the launch.
    """

    protocol_s: float = 0.0
    collectives_s: float = 0.0

    def copy(self) -> TimeSpent:
        """A snapshot, to subtract from a later one."""
        return dataclasses.replace(self)


def kv_digest(slots: Sequence[LmState | None]) -> int:
    """A u64 digest of the KV bookkeeping of ``slots``: which slots are held, and the tokens each has fed.

    Equal on two ranks when both ran the same commands; set as the link's
    ``state_digest``, so sync points compare it.
    """
    low = high = 0
    for seq_id, state in enumerate(slots):
        if state is not None:
            data = array("I", (seq_id, state.length, *state.tokens)).tobytes()
            low, high = zlib.crc32(data, low), zlib.adler32(data, high)
    return (high << 32) | low


def _held(slots: Sequence[LmState | None], seq_id: int) -> LmState:
    check_slot(seq_id, slots)
    state = slots[seq_id]
    if state is None:
        raise KeyError(f"slot {seq_id} is free")
    return state


def check_prompt(prompt: Sequence[int], config: LmConfig, *, where: str = "") -> None:
    """Check that ``prompt`` fits ``max_seq_len`` and holds ints of the vocabulary; ``where`` prefixes the message.

    Raises:
        TypeError: a token is not an int.
        ValueError: the prompt is too long, or a token is outside the vocabulary.
    """
    if len(prompt) > config.max_seq_len:
        raise ValueError(f"{where}the prompt has {len(prompt)} tokens, more than max_seq_len={config.max_seq_len}")
    _check_tokens(f"{where}prompt", prompt, config.vocab_size)


def _check_tokens(name: str, tokens: Sequence[int], vocab_size: int) -> None:
    for index, token in enumerate(tokens):
        if type(token) is not int:
            raise TypeError(f"{name}[{index}] must be an int, got {type(token).__name__} {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name}[{index}]={token} is outside the vocabulary (0 ..= {vocab_size - 1})")


def check_prefill(
    slots: Sequence[LmState | None], seq_id: int, prompt: Sequence[int], start: int, length: int, config: LmConfig
) -> LmState:
    """Check a prefill chunk against ``slots`` before anything runs; return the slot's state.

    The chunk ``prompt[start : start + length]`` must follow what the slot holds
    (``start == state.length``), be non-empty, end within the prompt, and the prompt
    must fit ``max_seq_len`` and the vocabulary.

    Raises:
        IndexError: ``seq_id`` is out of range.
        KeyError: the slot is free.
        TypeError, ValueError: the chunk or the prompt is wrong (the message says how).
    """
    state = _held(slots, seq_id)
    for name, value in (("start", start), ("length", length)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if length < 1 or start + length > len(prompt):
        raise ValueError(f"chunk {start} ..< {start + length} is not a non-empty part of a {len(prompt)}-token prompt")
    if start != state.length:
        raise ValueError(f"chunk starts at {start}, but slot {seq_id} holds {state.length} tokens: chunks go in order")
    check_prompt(prompt, config)
    return state


def check_decode(
    slots: Sequence[LmState | None], seq_ids: Sequence[int], tokens: Sequence[int], config: LmConfig
) -> list[LmState]:
    """Check a decode step against ``slots`` before anything runs; return the states, in batch order.

    Every id must index a held slot that has fed at least one token and has room
    for one more (``length < max_seq_len``); ids distinct; one token per id, in the
    vocabulary.

    Raises:
        IndexError, KeyError, ValueError: as :func:`~metrale_model_engine.batching.check_batch`.
        TypeError, ValueError: a token or a slot's length is wrong (the message says which).
    """
    if not seq_ids:
        raise ValueError("a decode step needs at least one sequence")
    if len(tokens) != len(seq_ids):
        raise ValueError(f"a decode step needs one token per sequence: {len(seq_ids)} ids, {len(tokens)} tokens")
    check_batch(seq_ids, slots)
    _check_tokens("tokens", tokens, config.vocab_size)
    states = [_held(slots, seq_id) for seq_id in seq_ids]
    for state in states:
        if not 0 < state.length < config.max_seq_len:
            raise ValueError(
                f"slot {state.seq_id} holds {state.length} tokens: a decode needs 1 ..= {config.max_seq_len - 1}"
            )
    return states


class ReferenceLm(nn.Module, LinkedEp[LmState]):
    """The reference model on one rank, as a ``torch.nn.Module`` that speaks the protocol through its link.

    Every rank of the group builds one, at the same point, over its own link; the
    group that carries the model's all-reduces is ``group`` (default the world
    group), whose rank and size must be the link's.  With one rank (a link over a
    :class:`~metrale_model_engine.transport.SoloTransport`) it is the single-GPU
    model: ``is_ep()`` is false, no command is sent and no collective runs, and
    torch.distributed need not be initialised.

    Args:
        link: this rank's link; its slot count is the model's.
        weights: a weights file (:func:`~metrale_model_engine.reference.save_weights`);
            default the shipped one.  Every rank loads it and keeps its shard.
        dtype, device: of the weights, KV cache and activations; the device
            defaults to the current CUDA device under NCCL, else torch's default.
        group: the process group of the all-reduces.
        all_reduce: the in-place sum over the ranks; default ``dist.all_reduce``
            over ``group`` (tests pass their own to run ranks without a group).

    Attributes:
        lm: the sharded transformer (:class:`~metrale_model_engine.reference.ShardedLm`).
        spent: the time this rank spent sending commands and in all-reduces.

    Raises:
        ValueError: the link's group cannot share the model (see
            :func:`~metrale_model_engine.reference.check_world`), or ``group`` is
            not the link's group.
        RuntimeError: several ranks, no ``all_reduce`` and torch.distributed is not initialised.
        OSError: the weights file cannot be read.
    """

    def __init__(
        self,
        link: EpLink,
        *,
        weights: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        self.ep_link = link
        rank, world_size = link.rank, link.world_size
        self._reduce = all_reduce
        if world_size > 1 and all_reduce is None:
            if not dist.is_initialized():
                raise RuntimeError(f"{world_size} ranks share the model, but torch.distributed is not initialised")
            ranks = (dist.get_rank(group), dist.get_world_size(group))
            if ranks != (rank, world_size):
                raise ValueError(
                    f"group: this process is rank {ranks[0]} of {ranks[1]} there, but rank {rank} of "
                    f"{world_size} on the link; the all-reduces must run over the link's ranks"
                )
            if device is None and dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
        self._group = group
        self._stopped: str | None = None
        config, full = load_weights(weights, dtype=dtype)
        reduce = self._all_reduce if world_size > 1 else None
        self.lm: ShardedLm = ShardedLm(
            config,
            num_slots=link.num_slots,
            rank=rank,
            world_size=world_size,
            all_reduce=reduce,
            dtype=dtype,
            device=device,
        )
        self.lm.load_full_state(full)
        self.spent: TimeSpent = TimeSpent()
        self._sends = world_size > 1  # one rank is the single-GPU model: no command to send, nothing to pay
        link.state_digest = kv_digest

    @property
    def config(self) -> LmConfig:
        """The model's shape."""
        return self.lm.config

    # -- head ------------------------------------------------------------------

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Head: give slot ``seq_id`` a new, empty sequence on every rank (what it held is freed)."""
        self._check_running()
        check_slot(seq_id, slots)
        self._send(self.ep_link.send_command, seq_id, CMD_ALLOC, 1)
        slots[seq_id] = LmState(seq_id)

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Head: free slot ``seq_id`` on every rank.  Raises ``KeyError`` if it is free (nothing is sent)."""
        self._check_running()
        _held(slots, seq_id)
        self._send(self.ep_link.send_command, seq_id, CMD_ALLOC, 0)
        slots[seq_id] = None

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Head: feed the chunk ``prompt[start : start + length]`` into slot ``seq_id`` on every rank.

        Returns:
            The logits ``[vocab]`` after the chunk's last token.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as :func:`check_prefill`
                (nothing is sent).
            EpSendError, EpWorkerFailed: as :meth:`EpLink.send_command` (nothing is sent).
            RunStopped: the run is over (see the module).
        """
        self._check_running()
        state = check_prefill(slots, seq_id, prompt, start, length, self.config)
        self._send(self.ep_link.send_command, seq_id, CMD_PREFILL, length, start, len(prompt), prompt)
        return self._head_forward(lambda: self.forward_prefill(state, prompt, start, length))

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Head: one decode step on every rank: slot ``seq_ids[i]`` feeds ``tokens[i]``.

        Returns:
            The logits ``[len(seq_ids), vocab]``.

        Raises:
            IndexError, KeyError, TypeError, ValueError: as :func:`check_decode` (nothing is sent).
            EpSendError, EpWorkerFailed: as :meth:`EpLink.send_command` (nothing is sent).
            RunStopped: the run is over (see the module).
        """
        self._check_running()
        states = check_decode(slots, seq_ids, tokens, self.config)
        self._send(send_batch, self.ep_link, CMD_DECODE, seq_ids, tokens)
        return self._head_forward(lambda: self.forward_decode(states, tokens))

    def _send(self, send: Callable[..., None], *args: object) -> None:
        """Run ``send(*args)``, one command to the workers, counting its time as protocol (one rank: nothing)."""
        if self._sends:
            started = time.perf_counter()
            send(*args)
            self.spent.protocol_s += time.perf_counter() - started

    def _check_running(self) -> None:
        if self._stopped is not None:
            raise RunStopped(f"head: the run stopped earlier ({self._stopped}); nothing more can run")

    def _head_forward(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run the head's forward of a command already sent; any failure ends the run."""
        try:
            return forward()
        except RunStopped as stopped:
            self._stop(str(stopped))
            raise
        except BaseException as error:  # its workers are in this forward's collectives: the run is over
            self._stop(f"the head's own forward failed: {type(error).__name__}: {error}")
            if not isinstance(error, Exception):
                raise
            raise RunStopped(f"head: {self._stopped}") from error

    def _stop(self, why: str) -> None:
        if self._stopped is None:
            self._stopped = why
            self.ep_link.close()

    # -- every rank: the forwards, once a command is known and checked ------------

    def forward_prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Run a checked prefill chunk (:func:`check_prefill`) in ``state``'s slot; the logits after its last token.

        The state records the chunk once the forward has written its keys and values.
        """
        chunk = prompt[start : start + length]
        logits = self.lm.prefill(state.seq_id, torch.tensor(chunk, dtype=torch.int64), start)
        state.extend(chunk)
        return logits

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        """Run a checked decode step (:func:`check_decode`): ``states[i]`` feeds ``tokens[i]``; logits ``[B, vocab]``.

        Every rank runs it once the command is known: the head after sending it, a
        worker after reading it.  The states record their tokens once the forward
        has written their keys and values.
        """
        as_tensor = torch.tensor
        logits = self.lm.decode(
            as_tensor([state.seq_id for state in states], dtype=torch.int64),
            as_tensor(tokens, dtype=torch.int64),
            as_tensor([state.length for state in states], dtype=torch.int64),
        )
        for state, token in zip(states, tokens, strict=True):
            state.append(token)
        return logits

    # -- worker ----------------------------------------------------------------

    def ep_worker_step(self, slots: MutableSequence[LmState | None]) -> bool:
        """Worker: as :meth:`LinkedEp.ep_worker_step`, after checking that ``slots`` has the link's slot count.

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

        A prefill or decode that cannot be read, fails its check or fails in its
        forward other than in a collective, and an unknown word, raise
        :class:`~metrale_model_engine.EpCommandRefused` (the run stops, see the
        module); a bad alloc or free fails as an ordinary command.
        """
        link = self.ep_link
        if cmd == CMD_ALLOC:
            word = link.recv_word()
            if word == 1:
                slots[seq_id] = LmState(seq_id)
            elif word == 0:
                _held(slots, seq_id)
                slots[seq_id] = None
            else:
                raise ValueError(f"an alloc's word must be 1 (alloc) or 0 (free), got {word}")
            return
        try:
            if cmd == CMD_PREFILL:
                length, start, full_length = link.recv_word(), link.recv_word(), link.recv_word()
                prompt = link.recv_tokens(full_length)
                state = check_prefill(slots, seq_id, prompt, start, length, self.config)
                self.forward_prefill(state, prompt, start, length)
            elif cmd == CMD_DECODE:
                seq_ids, tokens = recv_batch(link, slots)
                self.forward_decode(check_decode(slots, seq_ids, tokens, self.config), tokens)
            else:
                raise ValueError(f"unknown command word {cmd:#010x} (seq_id={seq_id})")
        except EpLinkError:
            raise  # a receive or a collective failed: the worker leaves as it is
        except Exception as error:
            what = {CMD_PREFILL: f"a prefill of slot {seq_id}", CMD_DECODE: "a decode step"}.get(cmd, "a command")
            raise EpCommandRefused(f"rank {link.rank} refuses {what}: {type(error).__name__}: {error}") from error

    # -- the collectives -----------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            if self._reduce is None:
                dist.all_reduce(tensor, group=self._group)
            else:
                self._reduce(tensor)
        except Exception as error:  # the backend's own error (RuntimeError from gloo): a rank is gone
            raise self._collective_failed(error) from error
        self.spent.collectives_s += time.perf_counter() - started

    def _collective_failed(self, error: Exception) -> RunStopped:
        """Why an all-reduce failed, as well as this rank can tell (the head asks its link which ranks stopped)."""
        link = self.ep_link
        if link.rank == 0:
            try:
                link.check_workers(EXIT_GRACE)
            except EpWorkerFailed as reported:
                return RunStopped(f"head: the run stopped: {reported}", reported.failures)
            except EpLinkError as exited:
                return RunStopped(str(exited))
        return RunStopped(
            f"rank {link.rank}: an all-reduce of the forward failed, so a rank died or left the run: {error}"
        )
