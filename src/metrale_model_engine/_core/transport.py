"""The transport protocol and a transport's plain errors (public: ``metrale_model_engine.transport``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

from typing_extensions import Buffer

GATHER_WORDS: Final = 13
"""u32 words one rank puts into one ``gather`` at most (a shared-memory line's words, less its header)."""


class HeadTransport(Protocol):
    """A transport's head end (rank 0): it sends messages to every worker and reads their answers.

    Not thread-safe: one thread of each rank uses its transport.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group; 0 is the head."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        ...

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words`` (at most ``GATHER_WORDS`` u32 words, the same count on each), by rank.  Collective.

        ``timeout`` bounds the wait for every rank (``None``: the transport's setup
        limit).
        """
        ...

    def close(self) -> None:
        """Leave the group and release what this rank holds.  Idempotent; a no-op where nothing is held."""
        ...

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: send one message, the concatenation of ``parts`` (native u32 buffers), to every worker.

        ``timeout`` bounds any wait, in seconds (``None``: as long as the peers
        live); 0 or less checks once.  On a one-rank group it sends nothing.
        """
        ...

    def answers_ready(self) -> bool:
        """Head: whether ``poll_answers`` has something.  Cheap: called before every command."""
        ...

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: every answer that has arrived, as ``(rank, answer)``, without waiting."""
        ...

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head, at a sync point: worker ``rank``'s answers, waiting (bounded) for at least one."""
        ...


class WorkerTransport(Protocol):
    """A transport's worker end (a rank above 0): it receives the head's messages and answers them."""

    @property
    def rank(self) -> int:
        """This process's rank in the group; 0 is the head."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        ...

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words`` (at most ``GATHER_WORDS`` u32 words, the same count on each), by rank.  Collective.

        ``timeout`` bounds the wait for every rank (``None``: the transport's setup
        limit).
        """
        ...

    def close(self) -> None:
        """Leave the group and release what this rank holds.  Idempotent; a no-op where nothing is held."""
        ...

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: the next message, whole, as read-only bytes valid until the next receive or close.

        ``timeout`` as for [`HeadTransport.send`][metrale_model_engine.transport.HeadTransport.send].
        """
        ...

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: send one small answer (u32 words, at most ``wire.ANSWER_BYTES`` bytes) back to the head.

        Each worker's answers reach the head in order.  Over shared memory it is on
        its way at once; over a group's collectives it is held until
        [`flush_answers`][metrale_model_engine.transport.WorkerTransport.flush_answers], since a worker may send only
        while the head receives.
        """
        ...

    def flush_answers(self, timeout: float | None) -> None:
        """Worker, at a sync point (the head is receiving): deliver every answer held back."""
        ...


class EpTransport(HeadTransport, WorkerTransport, Protocol):
    """A fixed group of ranks that rank 0 sends messages to: both ends, the rank says which one a process uses.

    What ``EpLink`` speaks over.  A transport that only ever plays one role
    inherits [`HeadEnd`][metrale_model_engine.transport.HeadEnd] or
    [`WorkerEnd`][metrale_model_engine.transport.WorkerEnd], whose calls of the other role refuse or do nothing,
    honestly, and implements its own.
    """


class HeadEnd:
    """A base for a transport that is only ever the head: the worker's calls refuse, its answers are none.

    A subclass gives ``world_size``, [`send`][metrale_model_engine.transport.HeadTransport.send],
    [`gather`][metrale_model_engine.transport.HeadTransport.gather] and
    [`receive_answers`][metrale_model_engine.transport.HeadTransport.receive_answers]; these defaults say what a head
    without answers between sync points does.
    """

    rank = 0

    def receive(self, timeout: float | None) -> memoryview:
        """Refused: the head receives no commands."""
        raise TransportClosed(f"{type(self).__name__} is a head: it receives no commands")

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Refused: the head answers no one."""
        raise TransportClosed(f"{type(self).__name__} is a head: it answers no one")

    def flush_answers(self, timeout: float | None) -> None:
        """Nothing is held: a head holds no answers."""

    def answers_ready(self) -> bool:
        """No answer arrives between sync points."""
        return False

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """No answer arrives between sync points."""
        return []

    def close(self) -> None:
        """Nothing is held."""


@runtime_checkable
class NamesSilentRanks(Protocol):
    """A head transport that can tell which workers went silent: for ranks its host cannot watch.

    Optional.  When a send or a sync point fails and nothing else explains it, the
    link asks, and names those ranks in its error
    ([`TorchTransport`][metrale_model_engine.torch.TorchTransport] reads its workers'
    heartbeats).
    """

    def silent_ranks(self) -> list[int]:
        """The worker ranks that no longer show a sign of life; may wait a moment (bounded) to tell."""
        ...


@runtime_checkable
class NamesLostRanks(Protocol):
    """A head transport that finds workers lost: silent past a bound while the head waited on them.

    Optional ([`TorchTransport`][metrale_model_engine.torch.TorchTransport] gives it, by its
    workers' heartbeats and ``head_lost_after``).  Once workers are lost the
    transport has ended the head's wait; the link stops the run, naming them.
    """

    def lost_ranks(self) -> dict[int, float]:
        """The worker ranks found lost, each with the seconds it had been silent then; empty while none is."""
        ...


@runtime_checkable
class PretendGroup(Protocol):
    """A transport that plays its whole group in one process: the ranks other than this one are pretend.

    Optional: the in-memory doubles of [`metrale_model_engine.testing`][metrale_model_engine.testing]
    (``RecordingTransport``, ``ReplayTransport``) give it.  A model's collectives
    over a link on such a transport have one participant, this process:
    ``metrale_model_engine.torch.Collectives`` needs no process group there, and
    its all-reduce leaves the tensor as it is (the sum over one rank), after the
    same checks and counts as over a real group.
    """

    def pretend_state(self, digest: int | None) -> None:
        """Head, at a sync point: its own state digest (``None``: none compared), which pretend workers answer."""
        ...


class WorkerEnd:
    """A base for a transport that is only ever a worker: the head's calls refuse.

    A subclass gives ``rank``, ``world_size``, [`receive`][metrale_model_engine.transport.WorkerTransport.receive],
    [`gather`][metrale_model_engine.transport.WorkerTransport.gather] and
    [`answer`][metrale_model_engine.transport.WorkerTransport.answer].
    """

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Refused: a worker sends no commands."""
        raise TransportClosed(f"{type(self).__name__} is a worker: it sends no commands")

    def answers_ready(self) -> bool:
        """A worker reads no answers."""
        return False

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Refused: a worker reads no answers."""
        raise TransportClosed(f"{type(self).__name__} is a worker: it reads no answers")

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Refused: a worker reads no answers."""
        raise TransportClosed(f"{type(self).__name__} is a worker: it reads no answers")

    def flush_answers(self, timeout: float | None) -> None:
        """Nothing is held back: this worker's answers are on their way (a subclass that holds them overrides it)."""

    def close(self) -> None:
        """Nothing is held."""


class SoloTransport(HeadEnd):
    """The one-rank group: the head alone, with no one to send to.

    What a single-GPU model's link runs over: its sends go nowhere and cost a
    method call, and ``is_ep()`` is ``False``.  Closing it changes nothing.
    """

    world_size = 1

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Nothing to send to."""

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """This rank's words, alone."""
        return [list(words)]

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Refused: there is no worker ``rank``."""
        raise TransportClosed(f"the one-rank group has no worker rank {rank}")


class TransportClosed(ConnectionError):
    """This rank closed its transport; nothing more is sent or received on it."""


class PeerLost(ConnectionError):
    """A peer is gone: it died, closed its side, or failed; the message says which and how."""


class TransportTimeout(TimeoutError):
    """A send or receive waited its whole timeout."""


class TransportCorrupt(ConnectionError):
    """What arrived cannot be what was sent: the link is out of step."""
