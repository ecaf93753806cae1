"""A head and its workers in one thread: :class:`LinkPair`, real ``EpLink`` ends over an in-memory wire.

After h11's ``ConnectionPair``: both ends are the real thing (the head's sender,
reports and sync points; each worker's reader and way back), only the wire between
them is a pair of queues.  Nothing runs on its own: the head sends, then the test
steps a worker (:meth:`LinkPair.step`), which reads what the head sent and answers
it.  Where the head must wait for a worker (its sync points), the wire steps that
worker until it has read everything sent (:meth:`LinkPair.catch_up`), as a worker
in its loop would have meanwhile.

Answers reach the head as over shared memory (at once: the head finds a report
before its next send) or, with ``held=True``, as over a group's collectives (held
until the worker flushes them at a sync point).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, MutableSequence, Sequence

from typing_extensions import Buffer

from metrale_model_engine import EpCommandFailed, EpError, EpLink, ProtocolVersion, SequenceState
from metrale_model_engine.transport import HeadEnd, TransportClosed, TransportTimeout, WorkerEnd

Slots = MutableSequence[SequenceState | None]
Run = Callable[[int, int, Slots], None]


class _Waiting(BaseException):
    """A worker found nothing to read: it would wait for the head, so the step hands the thread back.

    A ``BaseException``, so that the reader's handling of a failed receive never sees it:
    the worker is left as a worker blocked in its receive is.
    """


class _Wire:
    """The queues between the head and each worker, and the setup words each rank gave."""

    def __init__(self, world_size: int, held: bool) -> None:
        self.world_size = world_size
        self.held = held
        self.inbox: dict[int, deque[bytes]] = {rank: deque() for rank in range(1, world_size)}
        self.outbox: dict[int, deque[bytes]] = {rank: deque() for rank in range(1, world_size)}
        self.unflushed: dict[int, list[bytes]] = {rank: [] for rank in range(1, world_size)}
        self.setup: dict[int, list[int]] = {}
        self.catch_up: Callable[[int], None] = lambda rank: None

    def gather(self, rank: int, words: Sequence[int]) -> list[list[int]]:
        """Every rank's words: those a rank gave already, else this rank's own (it gives them later, and checks)."""
        self.setup[rank] = list(words)
        return [self.setup.get(other, list(words)) for other in range(self.world_size)]


class HeadSide(HeadEnd):
    """The head's end of the wire: every message goes to each worker's inbox."""

    def __init__(self, wire: _Wire) -> None:
        self._wire = wire
        self.world_size = wire.world_size
        self.sent: list[bytes] = []
        """Every message sent, oldest first."""
        self.closed = False
        self._sends_left: int | None = None  # sends that still go through, once the wire is cut
        self._lost: dict[int, float] = {}

    def cut(self, *, after: int = 0, lost: dict[int, float]) -> None:
        """Fail every send after the next ``after``; from the first failure on, ``lost`` are the lost workers."""
        self._sends_left = after
        self._lost = lost

    def lost_ranks(self) -> dict[int, float]:
        return self._lost if self._sends_left == -1 else {}

    def close(self) -> None:
        self.closed = True

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        if self._sends_left is not None:
            if self._sends_left <= 0:
                self._sends_left = -1
                raise TransportClosed("the wire is cut")
            self._sends_left -= 1
        message = b"".join(bytes(part) for part in parts)
        self.sent.append(message)
        for inbox in self._wire.inbox.values():
            inbox.append(message)

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        return self._wire.gather(0, words)

    def answers_ready(self) -> bool:
        return not self._wire.held and any(self._wire.outbox.values())

    def poll_answers(self) -> list[tuple[int, bytes]]:
        if self._wire.held:
            return []
        found = [(rank, answer) for rank, answers in self._wire.outbox.items() for answer in answers]
        for answers in self._wire.outbox.values():
            answers.clear()
        return found

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Worker ``rank``'s answers; none yet: that worker catches up first (else it sent none)."""
        answers = self._wire.outbox[rank]
        if not answers:
            self._wire.catch_up(rank)
        if not answers:
            raise TransportTimeout(f"worker rank {rank} sent no answer")
        found = list(answers)
        answers.clear()
        return found


class WorkerSide(WorkerEnd):
    """Worker ``rank``'s end of the wire: it reads its inbox and answers into its outbox."""

    def __init__(self, wire: _Wire, rank: int) -> None:
        self._wire = wire
        self.rank = rank
        self.world_size = wire.world_size
        self.closed = False
        self.flushes = 0

    def receive(self, timeout: float | None) -> memoryview:
        if self.closed:
            raise TransportClosed(f"worker rank {self.rank} closed its end")
        inbox = self._wire.inbox[self.rank]
        if not inbox:
            raise _Waiting
        return memoryview(inbox.popleft())

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        return self._wire.gather(self.rank, words)

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        data = bytes(memoryview(answer).cast("B"))
        if self._wire.held:
            self._wire.unflushed[self.rank].append(data)
        else:
            self._wire.outbox[self.rank].append(data)

    def flush_answers(self, timeout: float | None) -> None:
        self.flushes += 1
        held = self._wire.unflushed[self.rank]
        self._wire.outbox[self.rank].extend(held)
        held.clear()

    def close(self) -> None:
        self.closed = True


class LinkPair:
    """A head link and ``world_size - 1`` worker links over one in-memory wire, stepped in this thread.

    Args:
        run: each worker's command hook, ``run(seq_id, cmd, slots)`` (default: runs nothing).
        world_size: the ranks, the head's included.
        collective: the command words whose forward runs collectives (a failure refuses them).
        held: answers wait for the worker's flush at a sync point, as over a group's collectives.
        options: more ``EpLink`` arguments, the same on every rank (``num_slots`` 4 and v2 by default).
    """

    def __init__(
        self,
        run: Run | None = None,
        *,
        world_size: int = 2,
        collective: Container[int] = frozenset(),
        held: bool = False,
        **options: object,
    ) -> None:
        settings: dict[str, object] = {"num_slots": 4, "protocol": ProtocolVersion.V2, **options}
        self.wire = _Wire(world_size, held)
        self.wire.catch_up = self.catch_up
        self.run: Run = run if run is not None else _runs_nothing
        self.collective = collective
        self.head_end = HeadSide(self.wire)
        self.head = EpLink(self.head_end, **settings)  # type: ignore[arg-type]
        self.worker_ends = {rank: WorkerSide(self.wire, rank) for rank in range(1, world_size)}
        self.workers = {rank: EpLink(end, **settings) for rank, end in self.worker_ends.items()}  # type: ignore[arg-type]
        self.slots: dict[int, Slots] = {rank: [None] * self.head.num_slots for rank in self.workers}
        self.raised: dict[int, list[EpError]] = {rank: [] for rank in self.workers}
        """What each worker's steps raised while it caught up (:meth:`catch_up`), in order."""
        self.stepping = self.workers[1]
        """The link of the worker being stepped, for a hook to read its follow-ups from."""

    @property
    def worker(self) -> EpLink:
        """Worker rank 1's link."""
        return self.workers[1]

    def step(self, rank: int = 1) -> bool | None:
        """Step worker ``rank`` once: what ``EpLink.step`` returns, or ``None`` where it would wait for the head."""
        self.stepping = self.workers[rank]
        try:
            return self.stepping.step(self.run, self.slots[rank], self.collective)
        except _Waiting:
            return None

    def catch_up(self, rank: int) -> None:
        """Step worker ``rank`` until it waits for the head, keeping what its steps raise in :attr:`raised`.

        An ordinary failure leaves the worker in its loop; any other error ends it.
        """
        while True:
            try:
                if not self.step(rank):
                    return
            except EpCommandFailed as failed:
                self.raised[rank].append(failed)
            except EpError as error:
                self.raised[rank].append(error)
                return


def _runs_nothing(seq_id: int, cmd: int, slots: Slots) -> None:
    """A worker hook whose every command succeeds and changes nothing."""
