"""Continuous batching on the head: :class:`Server` admits requests into free slots and steps them together.

Each :meth:`Server.step`:

1. admits waiting requests, oldest first, into free slots (one ``alloc`` each);
2. feeds every request still prefilling one chunk of at most ``prefill_chunk``
   prompt tokens (one ``prefill`` each); the chunk that ends the prompt yields the
   first generated token;
3. runs one batched ``decode`` of every sequence that has a token to feed;
4. frees the slots of finished requests (an end-of-sequence id generated,
   ``max_new_tokens`` generated, the slot's cache full, or failed); each
   :class:`Completion` says why it ended.

Each request picks its tokens by its own :class:`~.sampling.Sampling`: greedy by
default (the largest logit; the lowest token on a tie), or drawn with its own
seeded generator.  The head picks; its workers receive the token in the next
decode command.  Requests may be submitted between any two steps; tokens are
streamed through ``on_token`` as they are chosen.  The server only calls the model's head methods, so the same code
serves a one-rank model and a multi-rank one: it never asks which it has.

A step that raises leaves every request either as it was before the call that
raised (a chunk is taken off a request, a token given to it, only once its command
succeeded) or failed with the error, so the server can step again or shut down.
Workers' reports of failed commands (:class:`~metrale_model_engine.EpWorkerFailed`)
fail the requests of those slots, whose slots are reset on every rank, then are
raised.  An ``on_token`` that raises fails its own request only.  After a
:class:`~metrale_model_engine.RunStopped` the run is over: every later call raises it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from .. import EpLink, EpWorkerFailed, check_u32
from .._core.namespace import PublicDir, public_dir
from ..batching import prefill_chunks
from .config import LmConfig
from .sampling import GREEDY, Sampler, Sampling
from .serving import TimeSpent
from .state import LmSlots, LmState, check_prompt

__all__ = ["Completion", "DecodeStep", "FinishReason", "Request", "ServedLm", "Server"]


__dir__: PublicDir = public_dir(globals(), __all__)


FinishReason = Literal["stop", "length", "context", "error"]
"""Why a request ended: an end-of-sequence id (``"stop"``), its ``max_new_tokens`` (``"length"``), its slot's
cache full (``"context"``), a failure (``"error"``)."""


@dataclass(frozen=True)
class Request:
    """A prompt to continue by at most ``max_new_tokens`` tokens, picked as ``sampling`` says (greedy by default).

    It ends early at an end-of-sequence id (the server's ``eos_token_ids``), or when
    its slot's cache fills up.

    Raises:
        TypeError: ``id``, a prompt token or ``max_new_tokens`` is not an int, or
            ``sampling`` is not a :class:`~.sampling.Sampling`.
        ValueError: ``id`` is not a u32, the prompt is empty, or ``max_new_tokens < 1``.
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = GREEDY

    def __post_init__(self) -> None:
        check_u32("id", self.id)
        object.__setattr__(self, "prompt", tuple(self.prompt))
        if not self.prompt:
            raise ValueError(f"request {self.id}: the prompt is empty")
        for index, token in enumerate(self.prompt):
            if type(token) is not int:
                raise TypeError(f"request {self.id}: prompt[{index}] must be an int, got {type(token).__name__}")
        _check_count(f"request {self.id}: max_new_tokens", self.max_new_tokens)
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"request {self.id}: sampling must be a Sampling, got {type(self.sampling).__name__}")


def _check_count(name: str, value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass
class Completion:
    """What a request got: its generated tokens, the steps at which it was admitted and finished, and why it ended."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    submitted_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None
    finish_reason: FinishReason | None = None
    """``"stop"``: it generated an end-of-sequence id (the last of :attr:`tokens`); ``"length"``:
    ``max_new_tokens`` generated; ``"context"``: cut short, its slot's cache (``max_seq_len`` positions) is
    full; ``"error"``: failed (see :attr:`error`); ``None`` while it waits or runs."""
    error: str | None = None
    """Why it failed, ``"Type: message"``, when :attr:`finish_reason` is ``"error"``."""
    seed: int | None = None
    """The seed its tokens were drawn with (its sampling's, or one drawn for it); ``None`` when greedy."""


@dataclass(frozen=True)
class DecodeStep:
    """The head's time in one batched decode: in total, sending the command, in all-reduces, and the rest."""

    batch: int
    total_s: float
    protocol_s: float
    collectives_s: float

    @property
    def compute_s(self) -> float:
        """The step less its protocol and collectives: the forward's own work."""
        return self.total_s - self.protocol_s - self.collectives_s


class ServedLm(Protocol):
    """What :class:`Server` drives: the head methods of :class:`~metrale_model_engine.reference.ReferenceLm`."""

    @property
    def ep_link(self) -> EpLink: ...

    @property
    def config(self) -> LmConfig: ...

    @property
    def spent(self) -> TimeSpent: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Give slot ``seq_id`` a new, empty sequence on every rank."""
        ...

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Free slot ``seq_id`` on every rank."""
        ...

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Feed ``prompt[start : start + length]`` into slot ``seq_id``; the logits after the chunk."""
        ...

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: slot ``seq_ids[i]`` feeds ``tokens[i]``; the logits, one row per slot."""
        ...


@dataclass
class _Running:
    completion: Completion
    seq_id: int
    chunks: deque[tuple[int, int]]
    """The prompt's chunks still to feed, ``(start, length)``."""
    sampler: Sampler
    pending: int | None = None
    """The last token chosen, which the next decode feeds."""
    ended: FinishReason | None = None
    """Why it ended, once it has: its slot is freed in the step's last phase."""


class Server:
    """Serves :class:`Request` objects on the head with continuous batching (see the module).

    Args:
        model: the head's model; its link's slot count is the batch limit.
        prefill_chunk: the most prompt tokens one prefill command feeds.
        on_token: called as ``on_token(request, token)`` for each token chosen.
        sync_every: a sync point (:meth:`EpLink.sync` with the slots, which
            compares every rank's KV bookkeeping) after every that many steps;
            ``None``: none but :meth:`shutdown`'s.
        eos_token_ids: the ids that end a request (the id is kept as its last token);
            default the model's (its checkpoint's ``eos_token_id``).

    Raises:
        TypeError, ValueError: ``prefill_chunk`` or ``sync_every`` (unless ``None``) is not an int ``>= 1``,
            or an ``eos_token_ids`` entry is not an int.

    A step that raises leaves every request untouched or failed (see the module);
    after a :class:`~metrale_model_engine.RunStopped` the run is over, and after
    :meth:`shutdown` the server takes no more requests or steps.
    """

    def __init__(
        self,
        model: ServedLm,
        *,
        prefill_chunk: int = 16,
        on_token: Callable[[Request, int], None] | None = None,
        sync_every: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        _check_count("prefill_chunk", prefill_chunk)
        if sync_every is not None:
            _check_count("sync_every", sync_every)
        stops = model.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        for token in stops:
            if type(token) is not int:
                raise TypeError(f"eos_token_ids must hold ints, got {type(token).__name__} {token!r}")
        self.eos_token_ids: frozenset[int] = frozenset(stops)
        """The ids that end a request."""
        self.model: ServedLm = model
        self.prefill_chunk: int = prefill_chunk
        self.on_token: Callable[[Request, int], None] | None = on_token
        self.sync_every: int | None = sync_every
        self.slots: LmSlots = [None] * model.ep_link.num_slots
        """The head's slot array."""
        self.steps: int = 0
        """Steps run so far."""
        self.decode_steps: list[DecodeStep] = []
        """The head's time in each batched decode so far."""
        self.completions: dict[int, Completion] = {}
        """Every request submitted, by id, finished or not."""
        self._waiting: deque[Completion] = deque()
        self._running: list[_Running] = []
        self._shut_down = False
        self._allocated_at: dict[int, int] = {}  # by slot: the link's command count when it was last allocated
        self._to_reset: set[int] = set()  # slots whose failed command left the workers' state unknown

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self._waiting or self._running)

    def submit(self, request: Request) -> Completion:
        """Queue ``request``; it is admitted at the next step with a free slot.  Returns its (growing) completion.

        Raises:
            TypeError: ``request`` is not a :class:`Request`.
            ValueError: the id was submitted before, or the prompt does not fit the
                model (its length, or a token outside the vocabulary).
            RuntimeError: the server was shut down.
        """
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__} {request!r}")
        self._check_open()
        if request.id in self.completions:
            raise ValueError(f"request {request.id} was submitted already")
        check_prompt(request.prompt, self.model.config, where=f"request {request.id}: ")
        completion = Completion(request, submitted_step=self.steps)
        self.completions[request.id] = completion
        self._waiting.append(completion)
        return completion

    def run(self, requests: Iterable[Request] = ()) -> dict[int, Completion]:
        """Submit ``requests``, then step until nothing waits or runs; every completion, by id."""
        for request in requests:
            self.submit(request)
        while self.busy:
            self.step()
        return self.completions

    def step(self) -> None:
        """One scheduling step: admit, one prefill chunk each, one batched decode, free the finished.

        Raises:
            RuntimeError: the server was shut down.
            EpWorkerFailed: workers reported failed commands: the requests of those
                slots failed, and their slots were reset (the server can step on).
            RunStopped: the run is over (see the module).
            Exception: what the model raised; every request is untouched or failed.
        """
        self._check_open()
        self.steps += 1
        try:
            self._reset()
            self._admit()
            self._prefill()
            decoding = [running for running in self._running if running.pending is not None and not self._ends(running)]
            if decoding:
                self._decode(decoding)
            self._release()
        except EpWorkerFailed as reported:
            self._fail_reported(reported)
            raise
        if self.sync_every is not None and self.steps % self.sync_every == 0:
            try:
                self.model.ep_link.sync(self.slots)
            except EpWorkerFailed as reported:
                self._fail_reported(reported)
                raise

    def shutdown(self) -> None:
        """Shut the workers down, after a last sync point that compares every rank's slots; then take nothing more.

        Raises:
            EpWorkerFailed, EpDivergenceError, RunStopped: as ``EpLink.shutdown_workers``
                (the workers are shut down all the same).
        """
        self._shut_down = True
        self.model.ep_link.shutdown_workers(self.slots)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("the server was shut down (shutdown()): it takes no more requests or steps")

    def _admit(self) -> None:
        """Admit waiting requests, oldest first, into free slots: each taken off the queue once its slot is had."""
        free = [seq_id for seq_id, state in enumerate(self.slots) if state is None]
        while self._waiting and free:
            self.model.alloc(self.slots, free[0])
            self._allocated_at[free[0]] = self.model.ep_link.commands
            completion = self._waiting.popleft()
            completion.admitted_step = self.steps
            request = completion.request
            sampler = Sampler(request.sampling)
            completion.seed = None if request.sampling.greedy else sampler.seed
            chunks = deque(prefill_chunks(len(request.prompt), self.prefill_chunk))
            self._running.append(_Running(completion, free.pop(0), chunks, sampler))

    def _prefill(self) -> None:
        """One chunk for every request still prefilling; a chunk is taken off only once its prefill ran."""
        for running in self._running:
            if running.chunks and running.ended is None:
                start, length = running.chunks[0]
                logits = self.model.prefill(
                    self.slots, running.seq_id, running.completion.request.prompt, start, length
                )
                running.chunks.popleft()
                if not running.chunks:
                    self._choose(running, running.sampler(logits))

    def _release(self) -> None:
        """Free the slot of every request that ended, and say why it ended."""
        for running in [running for running in self._running if self._ends(running)]:
            reason = running.ended or self._limit(running)
            self.model.free(self.slots, running.seq_id)
            completion = running.completion
            completion.finish_reason = reason
            completion.finished_step = self.steps
            self._running.remove(running)

    def _decode(self, decoding: list[_Running]) -> None:
        model = self.model
        seq_ids = [running.seq_id for running in decoding]
        tokens: list[int] = []
        for running in decoding:
            assert running.pending is not None  # only sequences with a token to feed decode
            tokens.append(running.pending)
        before = model.spent.copy()
        started = time.perf_counter()
        logits = model.decode(self.slots, seq_ids, tokens)
        total = time.perf_counter() - started
        spent = model.spent
        self.decode_steps.append(
            DecodeStep(
                len(seq_ids), total, spent.protocol_s - before.protocol_s, spent.collectives_s - before.collectives_s
            )
        )
        if all(running.sampler.sampling.greedy for running in decoding):  # one argmax, one read of the batch
            chosen = torch.argmax(logits, dim=-1).tolist()
        else:
            chosen = [running.sampler(row) for running, row in zip(decoding, logits, strict=True)]
        for running, token in zip(decoding, chosen, strict=True):
            self._choose(running, token)

    def _choose(self, running: _Running, token: int) -> None:
        running.completion.tokens.append(token)
        running.pending = token
        if token in self.eos_token_ids:
            running.ended = "stop"
        if self.on_token is None:
            return
        try:
            self.on_token(running.completion.request, token)
        except Exception as error:  # noqa: BLE001  (the callback's failure is its request's, no one else's)
            self._fail(running, error)

    def _fail(self, running: _Running, error: BaseException) -> None:
        """End ``running`` as failed; its slot is freed in the step's last phase."""
        running.ended = "error"
        message = str(error)
        running.completion.error = f"{type(error).__name__}: {message}" if message else type(error).__name__

    def _fail_reported(self, reported: EpWorkerFailed) -> None:
        """Fail the requests whose commands failed on a worker; their slots are reset at the next step.

        A report of a command older than its slot's last allocation is about a
        request that is gone, and a state the allocation reset: it is left alone.
        """
        for failure in reported.failures:
            seq_id = failure.seq_id
            if not 0 <= seq_id < len(self.slots) or failure.command < self._allocated_at.get(seq_id, 0):
                continue
            for running in [running for running in self._running if running.seq_id == seq_id]:
                self._fail(running, reported)
                running.completion.finish_reason = "error"
                running.completion.finished_step = self.steps
                self._running.remove(running)
            self._to_reset.add(seq_id)

    def _reset(self) -> None:
        """Reset the slots of failed commands on every rank: a new sequence, then none (two ordinary commands)."""
        for seq_id in sorted(self._to_reset):
            self.model.alloc(self.slots, seq_id)
            self._allocated_at[seq_id] = self.model.ep_link.commands
            self.model.free(self.slots, seq_id)
            self._to_reset.discard(seq_id)

    def _ends(self, running: _Running) -> bool:
        """Whether the request has ended: failed, all its tokens, or no room in its slot for the next one."""
        return running.ended is not None or self._limit(running) is not None

    def _limit(self, running: _Running) -> FinishReason | None:
        """``"length"`` when the request has its tokens, ``"context"`` when its slot is full, else ``None``."""
        completion = running.completion
        if len(completion.tokens) >= completion.request.max_new_tokens:
            return "length"
        state = self.slots[running.seq_id]
        assert isinstance(state, LmState)
        if running.pending is not None and state.length >= self.model.config.max_seq_len:
            return "context"
        return None
