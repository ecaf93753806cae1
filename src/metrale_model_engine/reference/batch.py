"""The requests in flight on the head: the queue, the running requests, the slots and the KV blocks they hold.

A [`Server`][metrale_model_engine.reference.Server] keeps its requests in a ``Batch``: the waiting ones in a queue,
oldest first, and the running ones each in a slot of the head's slot array, with the prompt's chunks still to feed
and the token the next decode feeds.  The batch admits waiting requests into free slots when the blocks of their
prompts are free (the model's ``kv_blocks``: a prefix found cached is shared, not computed again, and one still being
written by a running request is waited for), frees the slots
and blocks of the requests that ended or were cancelled, preempts the newest running requests when a decode step
needs blocks that are not free, and resets on every rank the slots whose failed command left a worker's state
unknown.  Each of these is an ordinary command of the model (``alloc``, ``free``), and a request moves only once
its command succeeded.  Which request holds which slot and which blocks, and when a request may have them, is
decided here alone; the server decides what each step feeds the running requests and which tokens they get.

Preemption is by recompute, as vLLM and nano-vllm do it: the preempted request's slot and blocks are freed, and it
goes back to the front of the queue with every token it has (its prompt and what it generated), its sampler with
it; admitted again, it prefills them all (its blocks, kept until reused, may still be cached) and goes on with the
token that follows, so its stream pauses and resumes, its tokens unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .. import EpLink, EpWorkerFailed, WorkerFailure
from ..batching import prefill_chunks
from .blocks import KvBlocks
from .config import LmConfig
from .rank.slots import LmSlots, LmState
from .requests import Completion, FinishReason, Request, Sampler


class SlotModel(Protocol):
    """What a ``Batch`` asks of its model: the link (its slot and command counts), the context (``config``), the
    head's block manager (``kv_blocks``), and a slot's new or ended sequence on every rank (``alloc``, ``free``)."""

    @property
    def ep_link(self) -> EpLink: ...

    @property
    def config(self) -> LmConfig: ...

    @property
    def kv_blocks(self) -> KvBlocks: ...

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Give slot ``seq_id`` a new, empty sequence on every rank."""
        ...

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Free slot ``seq_id`` on every rank."""
        ...


@dataclass
class Running:
    """A request in its slot."""

    completion: Completion
    seq_id: int
    chunks: deque[tuple[int, int]]
    """The prompt's chunks still to feed, ``(start, length)``."""
    sampler: Sampler
    prompt: tuple[int, ...] = ()
    """What its prefill feeds: the request's prompt, and after a preemption or a recovery every token it generated
    too."""
    pending: int | None = None
    """The last token chosen, which the next decode feeds."""
    ended: FinishReason | None = None
    """Why it ended, once it has: its slot is freed at the step's release."""

    @property
    def prefilling(self) -> bool:
        """Whether a chunk of its prompt is still to feed (and it has not ended)."""
        return bool(self.chunks) and self.ended is None

    def fail(self, error: BaseException) -> None:
        """End it as failed by ``error`` (``"error"``, ``"Type: message"``); its slot is freed at the step's release."""
        self.ended = "error"
        message = str(error)
        self.completion.error = f"{type(error).__name__}: {message}" if message else type(error).__name__


class Batch:
    """The requests in flight on the head of ``model``, and the head's slot array (see the module).

    ``prefix_caching``: whether an admitted prompt shares the cached blocks its first tokens are in.
    """

    def __init__(self, model: SlotModel, *, prefix_caching: bool = True) -> None:
        self.model: SlotModel = model
        self.prefix_caching: bool = prefix_caching
        self.slots: LmSlots = [None] * model.ep_link.num_slots
        """The head's slot array."""
        self.waiting: deque[Completion] = deque()
        """The requests waiting for a slot, oldest first (a preempted one back at the front)."""
        self.running: list[Running] = []
        """The requests holding a slot, by admission."""
        self.preemptions: int = 0
        """Requests preempted so far."""
        self._allocated_at: dict[int, int] = {}  # by slot: the link's command count when it was last allocated
        self._to_reset: set[int] = set()  # slots whose failed command left the workers' state unknown
        self._paused: dict[int, Sampler] = {}  # by request id: a re-queued request's sampler, for its return

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting or self.running)

    def check_fits(self, request: Request) -> None:
        """Raise ``ValueError`` for a request that could never run: its prompt and new tokens need more blocks than
        the whole cache holds (its context's end counts, not what lies past ``max_seq_len``)."""
        blocks = self.model.kv_blocks
        most = min(len(request.prompt) + request.max_new_tokens - 1, self.model.config.max_seq_len)
        if blocks.blocks_for(most) > blocks.num_blocks:
            raise ValueError(
                f"request {request.id}: a prompt of {len(request.prompt)} tokens and {request.max_new_tokens} new "
                f"tokens need {blocks.blocks_for(most)} KV blocks of {blocks.block_size} positions, more than the "
                f"cache's {blocks.num_blocks} ({blocks.num_blocks * blocks.block_size} positions): it could never run"
            )

    def admit(self, step: int, prefill_chunk: int) -> None:
        """Admit waiting requests, oldest first, into free slots (one ``alloc`` each) while the blocks of their
        prompts are free, besides one for each running request whose next token starts a block; a cached prefix
        shared, the rest cut into chunks of at most ``prefill_chunk`` tokens.  Each is taken off the queue once
        its slot is had.  With ``prefix_caching``, a request whose first blocks a running request is still
        prefilling waits, and every request after it, until they are written (``_awaits_prefix``)."""
        blocks = self.model.kv_blocks
        free = [seq_id for seq_id, state in enumerate(self.slots) if state is None]
        spare = sum(1 for running in self.running if running.pending is not None and self._starts_block(running))
        while self.waiting and free:
            completion = self.waiting[0]
            request = completion.request
            prompt = (*request.prompt, *completion.tokens)
            if self.prefix_caching and self._awaits_prefix(prompt):
                return
            cached = blocks.reserve(free[0], prompt, share=self.prefix_caching, spare=spare)
            if cached is None:
                return
            try:
                self.model.alloc(self.slots, free[0])
            except BaseException:
                blocks.release(free[0])
                raise
            self._allocated_at[free[0]] = self.model.ep_link.commands
            self.waiting.popleft()
            if completion.admitted_step is None:
                completion.admitted_step = step
            sampler = self._paused.pop(request.id, None) or Sampler(request.sampling)
            completion.seed = None if request.sampling.greedy else sampler.seed
            chunks = deque((cached + start, length) for start, length in prefill_chunks(len(prompt) - cached,
                                                                                         prefill_chunk))  # fmt: skip
            self.running.append(Running(completion, free.pop(0), chunks, sampler, prompt))

    def prefilling(self) -> list[Running]:
        """The requests with a chunk of their prompt still to feed, by admission."""
        return [running for running in self.running if running.prefilling]

    def decoding(self) -> list[Running]:
        """The requests with a token to feed, by slot (a fused step reads consecutive slots' caches in place)."""
        decoding = [running for running in self.running if running.pending is not None and not self._ends(running)]
        return sorted(decoding, key=lambda running: running.seq_id)

    def requeue(self, running: Running) -> None:
        """Put ``running`` back at the front of the queue with every token it has and its sampler (its generator's
        state), its slot left as it is: recomputed when admitted again.  ``preempt`` frees the slot first; after a
        re-form the slots are gone already (``carry_on``)."""
        self.running.remove(running)
        self._paused[running.completion.request.id] = running.sampler
        self.waiting.appendleft(running.completion)

    def carry_on(self, failures: Sequence[WorkerFailure], step: int) -> tuple[list[Completion], list[Completion]]:
        """After the link re-formed (every rank's slots are empty): fail the requests whose commands ``failures``
        names (reported failing by a worker before the loss), end those that had ended, and put every other
        running request back at the front of the queue, in admission order, to be computed again
        (``requeue``).  Returns the requests re-queued and those failed."""
        failed: list[Completion] = []
        for running in self.running[:]:
            since = self._allocated_at.get(running.seq_id, 0)
            named = [failure for failure in failures if failure.seq_id == running.seq_id and failure.command >= since]
            if named:
                running.ended, running.completion.error = "error", "; ".join(map(str, named))
                failed.append(running.completion)
            if self._ends(running):
                self._finish(running, running.ended or self._limit(running), step)
        requeued = [running.completion for running in self.running]
        for running in reversed(self.running[:]):
            self.requeue(running)
        self._allocated_at.clear()
        self._to_reset.clear()
        return requeued, failed

    def make_room(self, decoding: list[Running], step: int) -> list[Running]:
        """Free the blocks a decode of ``decoding`` needs: the ended requests released, then the newest running
        ones preempted (see the module) until the blocks their next tokens start are free; the decoding ones left."""
        self.release(step)
        while True:
            needed = sum(1 for running in decoding if self._starts_block(running))
            if needed <= self.model.kv_blocks.free:
                return decoding
            newest = self.running[-1]
            self.preempt(newest)
            decoding = [running for running in decoding if running is not newest]

    def preempt(self, running: Running) -> None:
        """Free ``running``'s slot and blocks on every rank (one ``free``) and put it back at the front of the queue,
        with every token it has and its sampler."""
        self.model.free(self.slots, running.seq_id)
        self.requeue(running)
        running.completion.preemptions += 1
        self.preemptions += 1

    def release(self, step: int) -> None:
        """Free the slot of every request that ended, and say why it ended."""
        for running in [running for running in self.running if self._ends(running)]:
            reason = running.ended or self._limit(running)
            self.model.free(self.slots, running.seq_id)
            self._finish(running, reason, step)

    def cancel(self, completion: Completion, step: int) -> None:
        """End ``completion``'s request at ``step`` as ``"cancelled"``: taken off the queue if it waits (no command),
        its slot freed on every rank if it runs (one ``free``; if that raises, the request is left as it was)."""
        for running in [running for running in self.running if running.completion is completion]:
            self.model.free(self.slots, running.seq_id)
            self._finish(running, "cancelled", step)
        if completion in self.waiting:
            self.waiting.remove(completion)
            self._paused.pop(completion.request.id, None)
            completion.finish_reason = "cancelled"
            completion.finished_step = step

    def fail_reported(self, reported: EpWorkerFailed, step: int) -> None:
        """Fail the requests whose commands failed on a worker; their slots are reset at the next ``reset``.

        A report of a command older than its slot's last allocation is about a
        request that is gone, and a state the allocation reset: it is left alone.
        """
        for failure in reported.failures:
            seq_id = failure.seq_id
            if not 0 <= seq_id < len(self.slots) or failure.command < self._allocated_at.get(seq_id, 0):
                continue
            for running in [running for running in self.running if running.seq_id == seq_id]:
                running.fail(reported)
                self._finish(running, "error", step)
            self._to_reset.add(seq_id)

    def reset(self) -> None:
        """Reset the slots of failed commands on every rank: a new sequence, then none (two ordinary commands)."""
        for seq_id in sorted(self._to_reset):
            self.model.alloc(self.slots, seq_id)
            self._allocated_at[seq_id] = self.model.ep_link.commands
            self.model.free(self.slots, seq_id)
            self._to_reset.discard(seq_id)

    def _finish(self, running: Running, reason: FinishReason | None, step: int) -> None:
        """Take ``running`` out of the batch (its slot already freed), ended for ``reason`` at ``step``."""
        completion = running.completion
        completion.finish_reason = reason
        completion.finished_step = step
        self.running.remove(running)

    def _awaits_prefix(self, prompt: Sequence[int]) -> bool:
        """Whether a running request still prefilling will write more of ``prompt``'s leading blocks than are cached
        now: ``prompt`` then waits to share them rather than compute them again.

        A block is keyed once written, so requests admitted together share nothing: on a cold cache, 16 requests
        sharing a system prompt would each compute it.  Waiting costs a request about nothing: the writer feeds one
        chunk a step, as the request's own prefill of the same tokens would, and the request then feeds only the rest.
        """
        blocks = self.model.kv_blocks
        size = blocks.block_size
        most = (len(prompt) - 1) // size  # the blocks a prefix may cover: one token is left to compute
        shared = 0
        for running in self.running:
            if not running.prefilling:
                continue
            other, count = running.prompt, 0
            limit = min(most, len(other) // size)
            while count < limit and _same_block(prompt, other, count * size, size):
                count += 1
            shared = max(shared, count)
        return shared > 0 and shared > len(blocks.prefix(prompt))

    def _starts_block(self, running: Running) -> bool:
        """Whether ``running``'s next token goes to a block its slot does not hold yet."""
        blocks = self.model.kv_blocks
        state = self.slots[running.seq_id]
        assert isinstance(state, LmState)
        return len(blocks.held(running.seq_id)) * blocks.block_size <= state.length

    def _ends(self, running: Running) -> bool:
        """Whether the request has ended: failed, all its tokens, or no room in its slot for the next one."""
        return running.ended is not None or self._limit(running) is not None

    def _limit(self, running: Running) -> FinishReason | None:
        """``"length"`` when the request has its tokens, ``"context"`` when its slot is full, else ``None``."""
        completion = running.completion
        if len(completion.tokens) >= completion.request.max_new_tokens:
            return "length"
        state = self.slots[running.seq_id]  # None once a re-form emptied the slots: the tokens it had fed then
        fed = len(completion.request.prompt) + len(completion.tokens) - 1 if state is None else state.length
        if running.pending is not None and fed >= self.model.config.max_seq_len:
            return "context"
        return None


def _same_block(a: Sequence[int], b: Sequence[int], start: int, size: int) -> bool:
    """Whether ``a`` and ``b`` hold the same tokens at ``start .. start + size - 1``."""
    return a[start : start + size] == b[start : start + size]
