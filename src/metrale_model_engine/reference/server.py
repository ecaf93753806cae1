"""Continuous batching on the head: :class:`Server` admits requests into free slots and steps them together.

Each :meth:`Server.step`:

1. admits waiting requests, oldest first, into free slots (one ``alloc`` each);
2. feeds every request still prefilling one chunk of at most ``prefill_chunk``
   prompt tokens (one ``prefill`` each); the chunk that ends the prompt yields the
   first generated token;
3. runs one batched ``decode`` of every sequence that has a token to feed;
4. frees the slots of finished requests (``max_new_tokens`` generated, or the
   slot's cache full).

Sampling is greedy (the largest logit; the lowest token on a tie).  Requests may
be submitted between any two steps; tokens are streamed through ``on_token`` as
they are chosen.  The server only calls the model's head methods, so the same code
serves a one-rank model and a multi-rank one: it never asks which it has.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import EpLink, check_u32
from ..batching import prefill_chunks
from .model import LmConfig
from .serving import LmSlots, LmState, TimeSpent, check_prompt

__all__ = ["Completion", "DecodeStep", "Request", "ServedLm", "Server"]


@dataclass(frozen=True)
class Request:
    """A prompt to continue by ``max_new_tokens`` greedy tokens (fewer if its slot's cache fills up).

    Raises:
        TypeError: ``id``, a prompt token or ``max_new_tokens`` is not an int.
        ValueError: ``id`` is not a u32, the prompt is empty, or ``max_new_tokens < 1``.
    """

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        check_u32("id", self.id)
        object.__setattr__(self, "prompt", tuple(self.prompt))
        if not self.prompt:
            raise ValueError(f"request {self.id}: the prompt is empty")
        for index, token in enumerate(self.prompt):
            if type(token) is not int:
                raise TypeError(f"request {self.id}: prompt[{index}] must be an int, got {type(token).__name__}")
        _check_count(f"request {self.id}: max_new_tokens", self.max_new_tokens)


def _check_count(name: str, value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass
class Completion:
    """What a request got: its generated tokens, and the steps at which it was admitted and finished."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    submitted_step: int = 0
    admitted_step: int | None = None
    finished_step: int | None = None


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
    pending: int | None = None
    """The last token chosen, which the next decode feeds."""


class Server:
    """Serves :class:`Request` objects on the head with continuous batching (see the module).

    Args:
        model: the head's model; its link's slot count is the batch limit.
        prefill_chunk: the most prompt tokens one prefill command feeds.
        on_token: called as ``on_token(request, token)`` for each token chosen.
        sync_every: a sync point (:meth:`EpLink.sync` with the slots, which
            compares every rank's KV bookkeeping) after every that many steps;
            ``None``: none but :meth:`shutdown`'s.

    Raises:
        TypeError, ValueError: ``prefill_chunk`` or ``sync_every`` (unless ``None``) is not an int ``>= 1``.

    A step that raises leaves the server as it was when the error struck (a
    request may be half admitted); after a :class:`RunStopped` the run is over.
    """

    def __init__(
        self,
        model: ServedLm,
        *,
        prefill_chunk: int = 16,
        on_token: Callable[[Request, int], None] | None = None,
        sync_every: int | None = None,
    ) -> None:
        _check_count("prefill_chunk", prefill_chunk)
        if sync_every is not None:
            _check_count("sync_every", sync_every)
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

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self._waiting or self._running)

    def submit(self, request: Request) -> Completion:
        """Queue ``request``; it is admitted at the next step with a free slot.  Returns its (growing) completion.

        Raises:
            ValueError: the id was submitted before, or the prompt does not fit the
                model (its length, or a token outside the vocabulary).
        """
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
        """One scheduling step: admit, one prefill chunk each, one batched decode, free the finished."""
        self.steps += 1
        model, slots = self.model, self.slots
        free = [seq_id for seq_id, state in enumerate(slots) if state is None]
        while self._waiting and free:
            model.alloc(slots, free[0])  # first: a request is taken off the queue only once it has its slot
            completion = self._waiting.popleft()
            completion.admitted_step = self.steps
            prompt = completion.request.prompt
            self._running.append(
                _Running(completion, free.pop(0), deque(prefill_chunks(len(prompt), self.prefill_chunk)))
            )
        for running in self._running:
            if running.chunks:
                start, length = running.chunks.popleft()
                logits = model.prefill(slots, running.seq_id, running.completion.request.prompt, start, length)
                if not running.chunks:
                    self._choose(running, int(torch.argmax(logits)))
        decoding = [running for running in self._running if running.pending is not None and not self._done(running)]
        if decoding:
            self._decode(decoding)
        for running in [running for running in self._running if self._done(running)]:
            model.free(slots, running.seq_id)
            running.completion.finished_step = self.steps
            self._running.remove(running)
        if self.sync_every is not None and self.steps % self.sync_every == 0:
            model.ep_link.sync(slots)

    def shutdown(self) -> None:
        """Shut the workers down, after a last sync point that compares every rank's slots."""
        self.model.ep_link.shutdown_workers(self.slots)

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
        for running, token in zip(decoding, torch.argmax(logits, dim=-1).tolist(), strict=True):
            self._choose(running, token)

    def _choose(self, running: _Running, token: int) -> None:
        running.completion.tokens.append(token)
        running.pending = token
        if self.on_token is not None:
            self.on_token(running.completion.request, token)

    def _done(self, running: _Running) -> bool:
        """Whether the request has all its tokens, or its slot has no room for the next one."""
        completion = running.completion
        if len(completion.tokens) >= completion.request.max_new_tokens:
            return True
        state = self.slots[running.seq_id]
        assert isinstance(state, LmState)
        return running.pending is not None and state.length >= self.model.config.max_seq_len
