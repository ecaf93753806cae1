"""The way back over a ring's segment: each worker's answers to the head, in a small ring of its own.

Each worker owns an answer block: ``ANSWER_SLOTS`` slots, a *published* count that
only it writes and a *consumed* count that only the head writes.  A worker writes an
answer into slot ``published % ANSWER_SLOTS`` (its length, then its bytes), then
publishes the count, then the count's low byte in the shared *answered* line; it
waits (bounded) only when every slot is unread.  The head learns that something is
waiting from one load of the answered line against what it saw last (no barrier and
no system call when nothing is), reads every published slot, then publishes how far
it read.  Both sides park on the other's count with the same handshake as the ring
(see ``_shm.waiting``), and every wait checks its peers.  Stores are ordered as in the
ring: payload, then count, then the answered byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from typing_extensions import Buffer

from .._core.codec import ANSWER_BYTES, answer_bytes
from .._core.transport import TransportTimeout
from . import futex
from .segment import ANSWER_SLOT_BYTES, ANSWER_SLOTS, ANSWERED_AT, HEAD_WAITS_AT, LINE, Segment
from .waiting import deadline_after, wait_until

ANSWERED_WORD: Final[int] = ANSWERED_AT // 8
"""The answered bytes of workers 1-8 as one u64: one load tells whether any answered."""
_WIDE_ANSWERED: Final[slice] = slice(ANSWERED_AT + 8, ANSWERED_AT + LINE)
_PARKED: Final[int] = 8
"""Byte offset of the worker's parked flag in the line of its published count."""


class _Block:
    """Where one worker's answer block lies."""

    __slots__ = ("consumed", "parked", "published", "slots")

    def __init__(self, segment: Segment, reader: int) -> None:
        at = segment.layout.answer_at(reader)
        self.published = at // 8
        self.parked = at + _PARKED
        self.consumed = (at + LINE) // 8
        self.slots = at + 2 * LINE


class AnswerWriter:
    """A worker's side: sends answers to the head.  Raises plain errors."""

    __slots__ = ("_block", "_check", "_reader", "_segment", "_spin_time")

    def __init__(self, segment: Segment, reader: int, check_head: Callable[[], None], spin_time: float) -> None:
        self._segment, self._reader, self._check, self._spin_time = segment, reader, check_head, spin_time
        self._block = _Block(segment, reader)

    def send(self, answer: Buffer, timeout: float | None) -> None:
        """Publish one answer (at most ``ANSWER_BYTES``); wait, bounded, while the head has every slot unread."""
        data = answer_bytes(answer)
        segment, block = self._segment, self._block
        u64, u32, view = segment.u64, segment.u32, segment.bytes
        published = u64[block.published]
        if published - u64[block.consumed] >= ANSWER_SLOTS:
            self._wait_for_room(published, timeout)
        slot = block.slots + (published % ANSWER_SLOTS) * ANSWER_SLOT_BYTES
        view[slot + 8 : slot + 8 + len(data)] = data
        u32[slot // 4] = len(data)
        if not futex.TOTAL_STORE_ORDER:
            futex.full_fence()
        u64[block.published] = published + 1
        view[ANSWERED_AT + self._reader] = (published + 1) & 0xFF
        futex.full_fence()  # the count is visible before the head's parked flag is read
        if view[HEAD_WAITS_AT]:
            futex.futex_wake(segment.address + 8 * block.published)

    def _wait_for_room(self, published: int, timeout: float | None) -> None:
        u64, block = self._segment.u64, self._block
        try:
            wait_until(
                lambda: published - u64[block.consumed] < ANSWER_SLOTS,
                segment=self._segment,
                park_word=lambda: 8 * block.consumed,
                parked_flag=block.parked,
                deadline=deadline_after(timeout),
                check=self._check,
                spin=self._spin_time,
            )
        except TimeoutError:
            raise TransportTimeout(
                f"the head read none of this worker's {ANSWER_SLOTS} unread answers within {timeout} s"
            ) from None


class AnswerReader:
    """The head's side: reads every worker's answers.  Raises plain errors."""

    __slots__ = ("_blocks", "_check", "_seen", "_segment", "_spin_time", "_stash", "_wide", "seen_word", "u64")

    def __init__(self, segment: Segment, check_workers: Callable[[], None], spin_time: float) -> None:
        readers = segment.layout.readers
        self._segment, self._check, self._spin_time = segment, check_workers, spin_time
        self._blocks = tuple(_Block(segment, reader) for reader in range(readers))
        self._wide = readers > 8
        self.u64 = segment.u64
        self._seen = self._answered()
        self.seen_word = self._seen[0]
        """The answered word as ``poll`` last saw it: the transport compares it in one load."""
        self._stash: list[tuple[int, bytes]] = []  # answers read while the head waited for room

    def ready(self) -> bool:
        """Whether an answer arrived since the last ``poll`` (one load when none did)."""
        if self._segment.u64[ANSWERED_WORD] != self._seen[0] or self._stash:
            return True
        return self._wide and bytes(self._segment.bytes[_WIDE_ANSWERED]) != self._seen[1]

    def stash(self) -> None:
        """Read what has arrived into the stash: a head waiting for room must not keep workers waiting for it."""
        if self.ready():
            self._stash = self.poll()

    def poll(self) -> list[tuple[int, bytes]]:
        """Every answer published now, as ``(rank, answer)``, each worker's in order.

        The answered line is read first: an answer published during the reading
        shows at the next ``ready`` (a line that wrapped back to the same bytes
        after 256 answers is read at the next sync point, which waits for them).
        """
        self._seen = self._answered()
        self.seen_word = self._seen[0]
        found, self._stash = self._stash, []
        for reader in range(len(self._blocks)):
            found += [(reader + 1, answer) for answer in self._take(reader)]
        return found

    def receive(self, rank: int, timeout: float | None) -> list[bytes]:
        """The answers of worker ``rank`` published now, waiting (bounded) for at least one."""
        reader = rank - 1
        block, u64 = self._blocks[reader], self._segment.u64
        if u64[block.published] == u64[block.consumed]:
            try:
                wait_until(
                    lambda: u64[block.published] != u64[block.consumed],
                    segment=self._segment,
                    park_word=lambda: 8 * block.published,
                    parked_flag=HEAD_WAITS_AT,
                    deadline=deadline_after(timeout),
                    check=self._check,
                    spin=self._spin_time,
                )
            except TimeoutError:
                raise TransportTimeout(f"worker rank {rank} sent no answer within {timeout} s") from None
        stashed = [answer for sender, answer in self._stash if sender == rank]
        self._stash = [(sender, answer) for sender, answer in self._stash if sender != rank]
        return stashed + self._take(reader)

    def _take(self, reader: int) -> list[bytes]:
        segment, block = self._segment, self._blocks[reader]
        u64, u32, view = segment.u64, segment.u32, segment.bytes
        consumed, published = u64[block.consumed], u64[block.published]
        if consumed == published:
            return []
        if not futex.TOTAL_STORE_ORDER:
            futex.full_fence()
        taken = []
        for position in range(consumed, published):
            slot = block.slots + (position % ANSWER_SLOTS) * ANSWER_SLOT_BYTES
            length = u32[slot // 4]
            taken.append(bytes(view[slot + 8 : slot + 8 + min(length, ANSWER_BYTES)]))
        u64[block.consumed] = published
        futex.full_fence()  # the count is visible before the worker's parked flag is read
        if view[block.parked]:
            futex.futex_wake(segment.address + 8 * block.consumed)
        return taken

    def _answered(self) -> tuple[int, bytes]:
        segment = self._segment
        return segment.u64[ANSWERED_WORD], bytes(segment.bytes[_WIDE_ANSWERED]) if self._wide else b""
