"""The one pretend transport of the in-process tests: :class:`FakeTransport`, and small helpers for links over it."""

from __future__ import annotations

from array import array
from collections.abc import MutableSequence, Sequence

from typing_extensions import Buffer

from metrale_model_engine import EpLink, SequenceState
from metrale_model_engine._core.protocol import ProtocolVersion
from metrale_model_engine.testing import RecordingTransport
from metrale_model_engine.transport import HeadEnd

from helpers.messages import Message


class FakeTransport(RecordingTransport):
    """Rank ``rank`` of a pretend group: the shipped :class:`RecordingTransport` (the head's record of what
    went on the wire, and workers in step at sync points), plus a worker's end and injected faults.

    ``peers`` are the other ranks' setup words (default: every rank agrees); a worker
    rank receives :attr:`incoming`, one message each, in order.
    """

    def __init__(self, rank: int, world_size: int, peers: Sequence[list[int]] | None = None) -> None:
        super().__init__(world_size)
        self.rank = rank
        self._peers = peers
        self.fail_with: Exception | None = None
        """Raised by every send, receive and gather (set by a test)."""
        self.timeouts: list[float | None] = []
        """The timeout of every send, in order."""
        self.incoming: list[Message] = []
        """What a worker rank receives, one message each, in order."""
        self.answered: list[bytes] = []
        """What a worker rank answered, in order."""
        self.waiting: list[tuple[int, bytes]] = []
        """Answers a head finds when it polls (set by a test)."""

    @property
    def sent(self) -> list[Message]:
        """Every message sent, oldest first, as its words (the record's :attr:`messages`)."""
        return self.messages

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        super().send(parts, timeout)
        self.timeouts.append(timeout)

    def receive(self, timeout: float | None) -> memoryview:
        if self.fail_with is not None:
            raise self.fail_with
        return memoryview(array("I", self.incoming.pop(0)).tobytes())

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        if self.fail_with is not None:
            raise self.fail_with
        if self._peers is None:
            return super().gather(words, timeout)
        return [list(words), *self._peers] if self.rank == 0 else [*self._peers, list(words)]

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        self.answered.append(bytes(memoryview(answer).cast("B")))

    def flush_answers(self, timeout: float | None) -> None:
        pass

    def answers_ready(self) -> bool:
        return bool(self.waiting)

    def poll_answers(self) -> list[tuple[int, bytes]]:
        waiting, self.waiting = self.waiting, []
        return waiting


class RealHead(HeadEnd):
    """The head of a real two-rank group, not a pretend one (no ``PretendGroup``): for a model that needs its
    process group.  Every rank agrees at setup; nothing is sent."""

    world_size = 2

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        return [list(words)] * 2

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        pass

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        return []


def no_slots(count: int = 2) -> list[SequenceState | None]:
    """``count`` free slots."""
    return [None] * count


def ignore(seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
    """A worker hook that runs nothing."""


def link(transport: FakeTransport, **options: object) -> EpLink:
    return EpLink(transport, **{"num_slots": 4, "protocol": ProtocolVersion.V2, **options})  # type: ignore[arg-type]
