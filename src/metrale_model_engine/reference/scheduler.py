"""Continuous batching on the head: ``Server`` admits requests into free slots and steps them together.

Each [`Server.step`][metrale_model_engine.reference.Server.step]:

1. admits waiting requests, oldest first, into free slots (one ``alloc`` each), while
   the KV blocks of their prompts are free; with ``prefix_caching``, a prompt whose first
   blocks are cached shares them and feeds only the rest, and one whose first blocks a
   running request is still prefilling waits until they are written, then shares them;
2. feeds every request still prefilling one chunk of at most ``prefill_chunk``
   prompt tokens (one ``prefill`` each); the chunk that ends the prompt yields the
   first generated token;
3. runs one batched ``decode`` of every sequence that has a token to feed, once the
   blocks its new tokens start are free: if they are not, the newest running
   requests are preempted (their slots and blocks freed, back to the front of the
   queue with every token they have, to be computed again: ``reference.batch``);
4. frees the slots of finished requests (an end-of-sequence id generated,
   ``max_new_tokens`` generated, the context full, or failed); each
   [`Completion`][metrale_model_engine.reference.Completion] says why it ended.

Each request picks its tokens by its own [`Sampling`][metrale_model_engine.reference.Sampling]: greedy by
default (the largest logit; the lowest token on a tie), or drawn with its own
seeded generator.  The head picks; its workers receive the token in the next
decode command.  Requests may be submitted, and cancelled (``cancel``), between any two steps; tokens are
streamed through ``on_token`` as they are chosen.  The server only calls the model's head methods, so the same code
serves a one-rank model and a multi-rank one: it never asks which it has.  Which request holds which slot and which
blocks (steps 1, 3 and 4) is its ``Batch``'s to decide (``reference.batch``); what a step feeds and which tokens it
picks, its own.

A step that raises leaves every request either as it was before the call that
raised (a chunk is taken off a request, a token given to it, only once its command
succeeded) or failed with the error, so the server can step again or shut down.
Workers' reports of failed commands ([`EpWorkerFailed`][metrale_model_engine.EpWorkerFailed])
fail the requests of those slots, whose slots are reset on every rank, then are
raised.  An ``on_token`` that raises fails its own request only.  After a
[`RunStopped`][metrale_model_engine.RunStopped] the run is over: every later call raises it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from .. import EpWorkerFailed, LinkedEp, RunStopped
from .._core.namespace import PublicDir, public_dir
from ..reform import reform_link
from .batch import Batch, Running, SlotModel
from .rank.checks import check_prompt
from .rank.recovery import Recovering, Recovery
from .rank.runner import Chunk
from .rank.slots import LmSlots
from .rank.timing import TimeSpent
from .requests import Completion, Request, check_count, token_logprobs
from .requests import FinishReason as FinishReason  # this module's name for it before ``batch`` (and ``server``'s)

__all__ = ["DecodeStep", "ServedLm", "Server"]


__dir__: PublicDir = public_dir(globals(), __all__)


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


class ServedLm(SlotModel, Protocol):
    """What [`Server`][metrale_model_engine.reference.Server] drives: the head methods of ``ReferenceLm``, those a
    batch asks for (its link, ``config``, ``kv_blocks``, ``alloc``, ``free``) and the forwards below."""

    @property
    def spent(self) -> TimeSpent: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def is_ep(self) -> bool:
        """Whether several ranks share the model (each command then runs its own forward)."""
        ...

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Feed ``prompt[start : start + length]`` into slot ``seq_id``; the logits after the chunk."""
        ...

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: slot ``seq_ids[i]`` feeds ``tokens[i]``; the logits, one row per slot."""
        ...

    def fused_step(
        self, slots: LmSlots, chunks: Sequence[Chunk], seq_ids: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        """One rank: ``chunks`` prefilled and a decode step, in one forward; the rows' logits, then the chunks'."""
        ...


Forward = Callable[[LmSlots, Sequence[int], Sequence[int]], torch.Tensor]
"""``forward(slots, seq_ids, tokens)``: a step's forward, decoding ``tokens`` in slots ``seq_ids``."""


class Server:
    """Serves ``Request`` objects on the head with continuous batching (see the module).

    Args:
        model: the head's model; its link's slot count is the batch limit.
        prefill_chunk: the most prompt tokens one prefill command feeds.
        on_token: called as ``on_token(request, token)`` for each token chosen.
        sync_every: a sync point ([`EpLink.sync`][metrale_model_engine.EpLink.sync] with the slots, which
            compares every rank's KV bookkeeping) after every that many steps;
            ``None``: none but [`shutdown`][metrale_model_engine.reference.Server.shutdown]'s.
        eos_token_ids: the ids that end a request (the id is kept as its last token);
            default the model's (its checkpoint's ``eos_token_id``).
        fuse: run each step's prefill chunks and decode as one forward; default (``None``):
            when the model is one rank (``is_ep()`` false).  Several ranks cannot: each of
            their commands runs its own forward.
        prefix_caching: whether a prompt whose first blocks are cached shares them (the
            head's ``kv_blocks``), and feeds only the rest; default on.
        on_lost_rank: what a lost worker rank does (a model that re-forms, ``LinkedEp.ep_reforms``):
            ``"recover"`` (the default), the step that met it forms the link again over the ranks left
            ([`reform_link`][metrale_model_engine.reform.reform_link]), fails the requests whose commands a worker
            reported failing before it went, and carries every other request on, its keys and values computed again
            on the new group from its prompt and the tokens it generated (``reference.rank.recovery``; each recovery
            in ``recoveries``, said in one log line); ``"stop"``, the step raises the
            [`RunStopped`][metrale_model_engine.RunStopped], as with a model that does not re-form.

    Raises:
        TypeError, ValueError: ``prefill_chunk`` or ``sync_every`` (unless ``None``) is not an int ``>= 1``,
            or an ``eos_token_ids`` entry is not an int.
        ValueError: ``fuse=True`` for a model of several ranks; ``on_lost_rank`` neither ``"recover"`` nor ``"stop"``.

    A step that raises leaves every request untouched or failed (see the module);
    after a [`RunStopped`][metrale_model_engine.RunStopped] the run is over, and after
    [`shutdown`][metrale_model_engine.reference.Server.shutdown] the server takes no more requests or steps.
    """

    def __init__(
        self,
        model: ServedLm,
        *,
        prefill_chunk: int = 16,
        on_token: Callable[[Request, int], None] | None = None,
        sync_every: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        fuse: bool | None = None,
        prefix_caching: bool = True,
        on_lost_rank: Literal["recover", "stop"] = "recover",
    ) -> None:
        check_count("prefill_chunk", prefill_chunk)
        if on_lost_rank not in ("recover", "stop"):
            raise ValueError(f"on_lost_rank must be 'recover' or 'stop', got {on_lost_rank!r}")
        if sync_every is not None:
            check_count("sync_every", sync_every)
        stops = model.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
        for token in stops:
            if type(token) is not int:
                raise TypeError(f"eos_token_ids must hold ints, got {type(token).__name__} {token!r}")
        self.eos_token_ids: frozenset[int] = frozenset(stops)
        """The ids that end a request."""
        if fuse and model.is_ep():
            raise ValueError("fuse=True: a model of several ranks (is_ep()) sends each prefill and decode alone")
        self.fuse: bool = not model.is_ep() if fuse is None else fuse
        """Whether a step's prefill chunks and decode run as one forward."""
        self.model: ServedLm = model
        self.prefill_chunk: int = prefill_chunk
        self.on_token: Callable[[Request, int], None] | None = on_token
        self.sync_every: int | None = sync_every
        self.prefix_caching: bool = prefix_caching
        """Whether prompts share the cached blocks their first tokens are in."""
        self._batch = Batch(model, prefix_caching=prefix_caching)  # the queue, the running requests, slots, blocks
        self.slots: LmSlots = self._batch.slots
        """The head's slot array."""
        self.steps: int = 0
        """Steps run so far."""
        self.decode_steps: list[DecodeStep] = []
        """The head's time in each batched decode so far."""
        self.completions: dict[int, Completion] = {}
        """Every request submitted, by id, finished or not."""
        self.on_lost_rank: Literal["recover", "stop"] = on_lost_rank
        """What a lost worker rank does: ``"recover"``, the run goes on over the ranks left (``recoveries``);
        ``"stop"``, the run stops (``RunStopped``)."""
        self.recoveries: list[Recovery] = []
        """Every recovery from lost worker ranks so far, in order (the last one's ``recompute_s`` may be pending)."""
        self._recovering: Recovering | None = None
        self._shut_down = False

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return self._batch.busy

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (each back in the queue, its tokens to compute again)."""
        return self._batch.preemptions

    @property
    def queued(self) -> tuple[int, int]:
        """The requests waiting (a preempted one among them) and running, now."""
        return len(self._batch.waiting), len(self._batch.running)

    def submit(self, request: Request) -> Completion:
        """Queue ``request``; it is admitted at the next step with a free slot.  Returns its (growing) completion.

        Raises:
            TypeError: ``request`` is not a [`Request`][metrale_model_engine.reference.Request].
            ValueError: the id was submitted before, the prompt does not fit the
                model (its length, or a token outside the vocabulary), or the prompt and its new
                tokens need more KV blocks than the cache holds.
            RuntimeError: the server was shut down.
        """
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__} {request!r}")
        self._check_open()
        if request.id in self.completions:
            raise ValueError(f"request {request.id} was submitted already")
        check_prompt(request.prompt, self.model.config, where=f"request {request.id}: ")
        self._batch.check_fits(request)
        completion = Completion(request, submitted_step=self.steps)
        self.completions[request.id] = completion
        self._batch.waiting.append(completion)
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

        With one rank (``is_ep()`` false, and ``fuse`` not off) the chunks and the decode
        run as one forward ([`fused_step`][metrale_model_engine.reference.ReferenceLm.fused_step], the
        single-GPU fused path); a request whose prompt ends there decodes from the next step on.

        Raises:
            RuntimeError: the server was shut down.
            EpWorkerFailed: workers reported failed commands: the requests of those
                slots failed, and their slots were reset (the server can step on).
            RunStopped: the run is over (see the module): with ``on_lost_rank="recover"``, only when it stopped for
                another reason than lost workers, or the link could not re-form (the message says why).
            Exception: what the model raised; every request is untouched or failed.
        """
        self._check_open()
        self.steps += 1
        began = time.monotonic()
        try:
            self._step()
        except RunStopped as stopped:
            self._recover(stopped, began)
            return
        if self._recovering is not None:
            prefilled = {r.completion.request.id for r in self._batch.running if not r.chunks}
            if self._recovering.back(prefilled):
                self._recovering = None

    def _step(self) -> None:
        """The body of ``step``: admit, feed, decode, release, and a sync point when one is due."""
        try:
            self._batch.reset()
            self._batch.admit(self.steps, self.prefill_chunk)
            if self.fuse:
                self._fused()
            else:
                self._prefill()
                decoding = self._batch.make_room(self._batch.decoding(), self.steps)
                if decoding:
                    self._pick(decoding, self._timed(decoding, self.model.decode))
            self._batch.release(self.steps)
        except EpWorkerFailed as reported:
            self._batch.fail_reported(reported, self.steps)
            raise
        if self.sync_every is not None and self.steps % self.sync_every == 0:
            try:
                self.model.ep_link.sync(self.slots)
            except EpWorkerFailed as reported:
                self._batch.fail_reported(reported, self.steps)
                raise

    def _recover(self, stopped: RunStopped, began: float) -> None:
        """After ``stopped``: with ``on_lost_rank="recover"`` and a model that re-forms, form the link again over the
        ranks left and carry every request on (``reference.rank.recovery``); else raise ``stopped``."""
        model = self.model
        if self.on_lost_rank == "stop" or not (isinstance(model, LinkedEp) and model.ep_reforms):
            raise stopped
        if self._recovering is not None:
            self._recovering.cut_short()
            self._recovering = None
        reform = reform_link(model, self.slots)  # RunStopped, one line, where it cannot: the run is over
        requeued, failed = self._batch.carry_on(reform.failures, self.steps)
        self._recovering = Recovering(reform, began, requeued, failed)
        self.recoveries.append(self._recovering.recovery)
        if not requeued:  # nothing to compute again
            self._recovering.back(set())
            self._recovering = None

    def check_workers(self) -> None:
        """Between steps, with nothing to run: whether every worker still lives
        ([`EpLink.check_workers`][metrale_model_engine.EpLink.check_workers]); a lost one is recovered from at once,
        as in ``step``.

        Raises:
            RuntimeError: the server was shut down.
            RunStopped: as ``step``.
        """
        self._check_open()
        try:
            self.model.ep_link.check_workers()
        except RunStopped as stopped:
            self._recover(stopped, time.monotonic())

    def cancel(self, request_id: int) -> Completion:
        """End request ``request_id`` now, between steps: its ``finish_reason`` becomes ``"cancelled"``.

        A waiting request leaves the queue (no command); a running one's slot is freed on every
        rank at once (its own free command, sent by this call).  A finished one is left as it is.
        Returns its completion.

        Raises:
            KeyError: no request of that id is in ``completions``.
            RuntimeError: the server was shut down.
            EpSendError, EpWorkerFailed, RunStopped: as the free's send; the request is left as it was.  A lost
                worker is recovered from first, as in ``step``.
        """
        self._check_open()
        completion = self.completions[request_id]
        if completion.finish_reason is None:
            try:
                self._batch.cancel(completion, self.steps)
            except RunStopped as stopped:  # recovered (or raised): the request waits now, and leaves the queue
                self._recover(stopped, time.monotonic())
                self._batch.cancel(completion, self.steps)
        return completion

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

    def _prefill(self) -> None:
        """One chunk for every request still prefilling; a chunk is taken off only once its prefill ran."""
        for running in self._batch.prefilling():
            start, length = running.chunks[0]
            logits = self.model.prefill(self.slots, running.seq_id, running.prompt, start, length)
            running.chunks.popleft()
            if not running.chunks:
                self._choose(running, running.sampler(logits), logits)

    def _fused(self) -> None:
        """One rank: every prefilling request's next chunk and every decoding request's token, in one forward."""
        decoding = self._batch.make_room(self._batch.decoding(), self.steps)
        prefilling = self._batch.prefilling()
        if not prefilling and not decoding:
            return
        chunks = [(r.seq_id, r.prompt, *r.chunks[0]) for r in prefilling]

        def forward(slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
            return self.model.fused_step(slots, chunks, seq_ids, tokens)

        logits = self._timed(decoding, forward)
        for running, row in zip(prefilling, logits[len(decoding) :], strict=True):
            running.chunks.popleft()
            if not running.chunks:
                self._choose(running, running.sampler(row), row)
        self._pick(decoding, logits[: len(decoding)])

    def _timed(self, decoding: list[Running], forward: Forward) -> torch.Tensor:
        """``forward(slots, seq_ids, tokens)`` of the decoding requests' tokens, its time kept as a
        [`DecodeStep`][metrale_model_engine.reference.DecodeStep] when it decodes any."""
        model = self.model
        seq_ids = [running.seq_id for running in decoding]
        tokens = [running.pending for running in decoding if running.pending is not None]
        before = model.spent.copy()
        started = time.perf_counter()
        logits = forward(self.slots, seq_ids, tokens)
        total = time.perf_counter() - started
        spent = model.spent
        if decoding:
            protocol, collectives = spent.protocol_s - before.protocol_s, spent.collectives_s - before.collectives_s
            self.decode_steps.append(DecodeStep(len(seq_ids), total, protocol, collectives))
        return logits

    def _pick(self, decoding: list[Running], logits: torch.Tensor) -> None:
        """Each decoding request's next token, from its row of ``logits``."""
        if all(running.sampler.sampling.greedy for running in decoding):  # one argmax, one read of the batch
            chosen = torch.argmax(logits, dim=-1).tolist()
        else:
            chosen = [running.sampler(row) for running, row in zip(decoding, logits, strict=True)]
        for running, token, row in zip(decoding, chosen, logits, strict=True):
            self._choose(running, token, row)

    def _choose(self, running: Running, token: int, logits: torch.Tensor) -> None:
        """Give ``running`` its next ``token``, chosen from ``logits`` (its row)."""
        request = running.completion.request
        if request.logprobs is not None:
            running.completion.logprobs.append(token_logprobs(logits, token, request.logprobs))
        running.completion.tokens.append(token)
        running.pending = token
        if token in self.eos_token_ids and not request.ignore_eos:
            running.ended = "stop"
        if self.on_token is None:
            return
        try:
            self.on_token(running.completion.request, token)
        except Exception as error:  # noqa: BLE001  (the callback's failure is its request's, no one else's)
            running.fail(error)
