"""The scheduler on a thread of its own, and the event loop's way to it: submissions and cancels through an
inbox, each step's tokens back through ``call_soon_threadsafe``.

Every call into [`Server`][metrale_model_engine.reference.Server] is made on the scheduler's thread: it takes
what the inbox holds (submit, cancel, shut down), runs one step while a request waits or runs, and
after each step hands the event loop, in one callback, every request's new tokens, log-probabilities
and end.  So the event loop never waits on a model step, and tokens reach their streams at the end
of the step that chose them.  Idle, the thread asks the link every ``IDLE_POLL_S`` whether a
worker stopped, so a lost worker is seen with no request running.

A step that raises [`EpWorkerFailed`][metrale_model_engine.EpWorkerFailed] failed the requests of those slots
(their streams end with the error) and the scheduler goes on; anything else raised (a
[`RunStopped`][metrale_model_engine.RunStopped]: a lost worker, a failed collective) stops it: every open
request ends with that cause, the state turns ``stopped``, and ``on_stopped(cause)`` runs on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from .. import EpWorkerFailed
from ..reference import Completion, FinishReason, Request, Server, TokenLogprobs
from .limits import Limits
from .metrics import Metrics, RunState
from .protocol import ApiError

IDLE_POLL_S: Final = 0.05
"""How long the idle scheduler waits for the inbox before it asks the link about its workers."""
_LOGGER = logging.getLogger("metrale_model_engine.serve")


@dataclass
class Update:
    """What one request got in one step: new tokens (and their log-probabilities), and how it ended, if it did."""

    request_id: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: FinishReason | None = None
    error: str | None = None


Sink = Callable[[Update], None]
"""Where a request's updates go; called on the event loop."""


@dataclass
class _Open:
    sink: Sink
    arrived: float
    sent: int = 0
    last: float | None = None


class Engine:
    """``server`` stepped on its own thread, for the coroutines of the event loop it is made on (see the module).

    Made in a coroutine: it keeps the running loop.  The methods are called on the event loop's thread, but none of
    them waits for a step.

    Raises:
        RuntimeError: made outside a running event loop.
    """

    def __init__(self, server: Server, limits: Limits, metrics: Metrics, on_stopped: Callable[[str], None]) -> None:
        self.limits: Limits = limits
        self.metrics: Metrics = metrics
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._on_stopped = on_stopped
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._open: dict[int, _Open] = {}  # by request id; the scheduler's thread alone
        self._next_id = 0
        self._counted = (0, 0, 0)  # the server's preemptions, prefix queries and hits, as far as the metrics have them
        self._recoveries = 0  # the server's recoveries counted in the metrics
        self.held: int = 0
        """Requests taken and not yet ended, running or waiting (the event loop's count)."""
        self.state: RunState = "serving"
        self.cause: str | None = None
        """Why the run stopped, once it has."""
        self.closed: asyncio.Future[None] = self._loop.create_future()
        """Done once the scheduler has shut the workers down (or the run stopped)."""
        self._thread = threading.Thread(target=self._run, name="metrale-scheduler", daemon=True)
        metrics.set_state("serving")

    def start(self) -> None:
        self._thread.start()

    # -- the event loop's side -------------------------------------------------

    def new_id(self) -> int:
        """A request id (a u32) for the next request."""
        self._next_id = (self._next_id + 1) % 2**32
        return self._next_id

    def submit(self, requests: Sequence[Request], sink: Sink) -> None:
        """Queue ``requests`` (all or none), whose updates go to ``sink``.

        Raises:
            ApiError: 503 while the server drains, once the run stopped, or when it is full
                (see [`Limits.admit`][metrale_model_engine.serve.limits.Limits.admit]).
        """
        if self.state == "stopped":
            raise ApiError(503, f"the run stopped: {self.cause}")
        if self.state == "draining":
            raise ApiError(503, "the server is shutting down: it takes no new requests")
        self.limits.admit(self.held, len(requests))
        self.held += len(requests)
        self._inbox.put(("submit", (list(requests), sink, time.monotonic())))

    def ended(self, count: int) -> None:
        """``count`` requests taken by ``submit`` have ended (finished, failed or cancelled)."""
        self.held -= count

    def cancel(self, request_ids: Sequence[int]) -> None:
        """End these requests at the next step (their slots freed on every rank); no update follows."""
        self._inbox.put(("cancel", list(request_ids)))

    def drain(self) -> None:
        """Take no new request (503) from now on."""
        if self.state == "serving":
            self.state = "draining"
            self.metrics.set_state("draining")

    def close(self) -> None:
        """End what is still open (with an error), shut the workers down, and let the thread go."""
        self._inbox.put(("close", None))

    # -- the scheduler's thread ------------------------------------------------

    def _run(self) -> None:
        server = self._server
        try:
            while self._take(wait=not server.busy):
                if server.busy:
                    try:
                        server.step()
                    except EpWorkerFailed as failed:  # its requests failed; the others go on
                        _LOGGER.error("%s", failed)
                    server.decode_steps.clear()  # the step's timing is kept by the metrics
                    self._publish()
                else:
                    server.check_workers()
                    self._publish()
        except BaseException as error:  # noqa: BLE001  (anything else stops the run: say why to every stream)
            self._stop(error)
        else:
            self._call(self._closed, None)

    def _take(self, wait: bool) -> bool:
        """Apply what the inbox holds (waiting up to ``IDLE_POLL_S`` for a first item when ``wait``); ``False``
        once it said to close (the workers then shut down)."""
        try:
            item = self._inbox.get(timeout=IDLE_POLL_S) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, value = item
            if kind == "submit":
                assert isinstance(value, tuple)
                self._submit(*value)
            elif kind == "cancel":
                assert isinstance(value, list)
                self._cancel(value)
            else:
                self._close()
                return False
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _submit(self, requests: list[Request], sink: Sink, arrived: float) -> None:
        for request in requests:
            try:
                self._server.submit(request)
            except (TypeError, ValueError) as error:  # checked before, by Limits: a defect, said to its client
                self._call(self._deliver, [(sink, Update(request.id, error=f"{type(error).__name__}: {error}"))])
                continue
            self._open[request.id] = _Open(sink, arrived)
            self.metrics.prompt_tokens.inc(len(request.prompt))
        self._gauges()

    def _cancel(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            if self._open.pop(request_id, None) is not None:
                self._server.cancel(request_id)
                self.metrics.cancelled.inc()
                self._forget(request_id)
        self._gauges()

    def _close(self) -> None:
        self._end_all("the server shut down before the request finished")
        self._server.shutdown()  # a last sync point, then the workers leave

    def _publish(self) -> None:
        """Every open request's news since the last step, to the event loop in one callback."""
        now = time.monotonic()
        updates: list[tuple[Sink, Update]] = []
        metrics = self.metrics
        for request_id, held in list(self._open.items()):
            completion = self._server.completions[request_id]
            new = completion.tokens[held.sent :]
            if new:
                if held.last is None:
                    metrics.time_to_first_token.observe(now - held.arrived)
                else:
                    metrics.inter_token_latency.observe((now - held.last) / len(new))
                held.last = now
                metrics.generation_tokens.inc(len(new))
            if new or completion.finish_reason is not None:
                update = Update(request_id, new, completion.logprobs[held.sent :], completion.finish_reason)
                update.error = completion.error
                updates.append((held.sink, update))
                held.sent = len(completion.tokens)
            if completion.finish_reason is not None:
                del self._open[request_id]
                self._forget(request_id)
        recoveries = len(self._server.recoveries)
        metrics.recoveries.inc(recoveries - self._recoveries)
        self._recoveries = recoveries
        self._gauges()
        if updates:
            self._call(self._deliver, updates)

    def _gauges(self) -> None:
        server = self._server
        waiting, running = server.queued  # a preempted request waits again
        self.metrics.waiting.set(waiting)
        self.metrics.running.set(running)
        blocks = server.model.kv_blocks
        self.metrics.kv_blocks_used.set(blocks.used)
        now = (server.preemptions, blocks.query_tokens, blocks.hit_tokens)
        for counter, was, count in zip(
            (self.metrics.preemptions, self.metrics.prefix_queries, self.metrics.prefix_hits),
            self._counted,
            now,
            strict=True,
        ):
            counter.inc(count - was)
        self._counted = now
        self.metrics.slots_used.set(sum(1 for state in self._server.slots if state is not None))

    def _forget(self, request_id: int) -> Completion | None:
        """Drop a finished request's completion: a server that runs for weeks keeps only the open ones."""
        return self._server.completions.pop(request_id, None)

    def _end_all(self, cause: str) -> None:
        updates = [(held.sink, Update(request_id, error=cause)) for request_id, held in self._open.items()]
        self._open.clear()
        if updates:
            self._call(self._deliver, updates)

    def _stop(self, error: BaseException) -> None:
        message = str(error)
        cause = f"{type(error).__name__}: {message}" if message else type(error).__name__
        _LOGGER.error("the run stopped: %s", cause)
        self.metrics.set_state("stopped")
        self._call(self._stopped, cause)  # first: /health says 503 before any stream has its error event
        self._end_all(f"the run stopped: {cause}")

    # -- back on the event loop --------------------------------------------------

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)

    @staticmethod
    def _deliver(updates: list[tuple[Sink, Update]]) -> None:
        for sink, update in updates:
            sink(update)

    def _stopped(self, cause: str) -> None:
        self.state, self.cause = "stopped", cause
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_stopped(cause)

    def _closed(self, _: None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
