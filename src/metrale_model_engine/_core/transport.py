"""The transport protocol and a transport's plain errors (public: :mod:`metrale_model_engine.transport`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from typing_extensions import Buffer

__all__ = ["EpTransport", "PeerLost", "SoloTransport", "TransportClosed", "TransportCorrupt", "TransportTimeout"]


class EpTransport(Protocol):
    """A fixed group of ranks that rank 0 sends messages to.

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

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: send one message, the concatenation of ``parts`` (native u32 buffers), to every worker.

        ``timeout`` bounds any wait, in seconds (``None``: as long as the peers
        live); 0 or less checks once.  On a one-rank group it sends nothing.
        """
        ...

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: the next message, whole, as read-only bytes valid until the next receive or close.

        ``timeout`` as for :meth:`send`.
        """
        ...

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words`` (at most 13 u32 words, the same count on each), by rank.  Collective.

        ``timeout`` bounds the wait for every rank (``None``: the transport's setup
        limit).
        """
        ...

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: send one small answer (u32 words, at most 248 bytes) back to the head.

        Each worker's answers reach the head in order.  Over shared memory it is on
        its way at once; over a group's collectives it is held until
        :meth:`flush_answers`, since a worker may send only while the head receives.
        """
        ...

    def flush_answers(self, timeout: float | None) -> None:
        """Worker, at a sync point (the head is receiving): deliver every answer held back."""
        ...

    def answers_ready(self) -> bool:
        """Head: whether :meth:`poll_answers` has something.  Cheap: called before every command."""
        ...

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: every answer that has arrived, as ``(rank, answer)``, without waiting."""
        ...

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head, at a sync point: worker ``rank``'s answers, waiting (bounded) for at least one."""
        ...

    def close(self) -> None:
        """Leave the group and release what this rank holds.  Idempotent; a no-op where nothing is held."""
        ...


class SoloTransport:
    """The one-rank group: the head alone, with no one to send to.

    What a single-GPU model's link runs over: its sends go nowhere and cost a
    method call, and ``is_ep()`` is ``False``.  Closing it changes nothing.
    """

    rank = 0
    world_size = 1

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Nothing to send to."""

    def receive(self, timeout: float | None) -> memoryview:
        """Never called: the one rank is the head."""
        raise TransportClosed("the one-rank group has no head to receive from")

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """This rank's words, alone."""
        return [list(words)]

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Never called: the one rank is the head."""
        raise TransportClosed("the one-rank group has no head to answer")

    def flush_answers(self, timeout: float | None) -> None:
        """Nothing is held."""

    def answers_ready(self) -> bool:
        """No worker, no answer."""
        return False

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """No worker, no answer."""
        return []

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Never called: there is no worker ``rank``."""
        raise TransportClosed(f"the one-rank group has no worker rank {rank}")

    def close(self) -> None:
        """Nothing is held."""


class TransportClosed(ConnectionError):
    """This rank closed its transport; nothing more is sent or received on it."""


class PeerLost(ConnectionError):
    """A peer is gone: it died, closed its side, or failed; the message says which and how."""


class TransportTimeout(TimeoutError):
    """A send or receive waited its whole timeout."""


class TransportCorrupt(ConnectionError):
    """What arrived cannot be what was sent: the link is out of step."""
