"""The ring's data path: the head writes messages into records, each worker reads them out.

The ring
    ``ring_bytes`` of records, one after another, each at a 64-byte boundary: a line
    with the stamp, the message's length and the record's offset in its message,
    then the payload.  Each send is one message; a message longer than
    ``chunk_bytes`` travels as consecutive records, so that a worker copies one out
    while the head writes the next, and any length goes through a ring of any size.
    A record that does not fit before the ring's end is preceded by a marker that
    sends the readers back to its start.  The head writes and returns at once; it
    waits only when the ring is full (back-pressure), for as long as the send's
    timeout allows.

Positions, not flags
    Every rank counts bytes since the ring's start (u64, never wrapping).  The
    record at position ``p`` lies at ``p % ring_bytes`` and is published when its
    stamp reads ``p + 1``; the head clears the stamp of the record after it before
    publishing it, so the stamp a worker waits on is either 0 or the right one,
    never a stale value that might match.  Each worker publishes its *consumed*
    position; the head writes below ``min(consumed) + ring_bytes`` only.  A worker
    copies each message out before it publishes that it consumed it, so nothing it
    holds can be overwritten.  Each counter has one writer and its own cache line.

Memory ordering
    Python promises no memory model; what this relies on is how CPython's
    ``memoryview`` writes native items (one ``memcpy`` of the item size, which
    compilers turn into one aligned store for 4 and 8 bytes, so counters are never
    torn) and the processor's ordering.  x86-64 keeps stores in program order and
    loads in program order (TSO), so "payload, then stamp" on the writer and "stamp,
    then payload" on the reader need no barrier, nor does "copy out, then consumed";
    a store may pass a later load, though, which would break the sleep handshake
    unless a full barrier separates them.  arm64 reorders all of these, so there a
    full barrier also goes between a payload and the stamp that publishes it, and
    between a stamp or counter and what it guards.  The barrier is an uncontended
    lock's acquire and release (``full_fence``).

A failed send
    A send can fail after publishing part of a message (the ring stayed full for
    the whole timeout, a worker died).  Then the ring is over for the head, as a
    gloo group is after a failed broadcast: every later send raises at once, and
    each worker reads the whole messages before the cut, then raises.  Since every
    record carries its offset and its message's length, a record that does not
    continue the message being read is corruption, never data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

from typing_extensions import Buffer

from .._core.transport import PeerLost, TransportClosed, TransportCorrupt, TransportTimeout
from .._host.liveness import ProcessWatch
from . import futex
from .segment import (
    GONE_AT,
    GONE_CLOSED,
    HEAD_BROKEN,
    HEAD_CLOSED,
    HEAD_OPEN,
    HEAD_PID_AT,
    HEAD_STATE_AT,
    LINE,
    PARKED_AT,
    RECORD_HEADER,
    WRITER_PARKED_AT,
    Segment,
)
from .waiting import CHECK_INTERVAL, SpinBudget, deadline_after, wait_until

_PARKED_WORD: Final[int] = PARKED_AT // 8
"""The parked bytes of readers 1-8 as one u64: one load tells whether any sleeps."""
_GONE_WORD: Final[int] = GONE_AT // 8
_WRITER_PARKED_WORD: Final[int] = WRITER_PARKED_AT // 8
_WIDE_PARKED: Final[slice] = slice(PARKED_AT + 8, PARKED_AT + LINE)
"""The parked bytes of readers 9 and up, read only in rings of more than 9 ranks."""
_WIDE_GONE: Final[slice] = slice(GONE_AT + 8, GONE_AT + LINE)
_WRAP: Final[int] = (1 << 64) - 1
"""The message length of a record that only says: the next record is at the ring's start."""


class RingWriter:
    """The head's side: publishes messages, waits for room, watches its workers.  Raises plain errors."""

    __slots__ = (
        "_address",
        "_base",
        "_broken",
        "_bytes",
        "_chunk",
        "_next",
        "_next_check",
        "_peers",
        "_reader_words",
        "_ring",
        "_room_until",
        "_segment",
        "_spin_time",
        "_u64",
        "_wide",
        "while_waiting",
    )

    def __init__(self, segment: Segment, peers: ProcessWatch, spin_time: float) -> None:
        layout = segment.layout
        self._segment, self._peers, self._spin_time = segment, peers, spin_time
        # The hot path reads these plain attributes, not the layout's computed properties.
        self._u64, self._bytes, self._address = segment.u64, segment.bytes, segment.address
        self._ring, self._base, self._chunk = layout.ring_bytes, layout.ring_at, layout.chunk_bytes
        self._wide = layout.readers > 8
        self._reader_words = tuple(layout.reader_at(reader) // 8 for reader in range(layout.readers))
        self._next = 0  # the position of the next record to write
        self._room_until = layout.ring_bytes if layout.readers else 1 << 64  # room without looking
        self._next_check = 0.0  # when the next send checks that the workers live
        self._broken: str | None = None  # why a send failed: the ring is then over for the head
        self.while_waiting: Callable[[], None] = _nothing
        """Runs in every wait for room, with the liveness check (the transport reads answers there)."""

    def publish(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Publish one message, the concatenation of ``parts``; on any failure the ring breaks."""
        if self._broken is not None:
            raise TransportClosed(f"the ring is broken since an earlier send failed ({self._broken}); nothing is sent")
        try:  # the whole body, in this one call: a try costs nothing until something is raised
            u64, view = self._u64, self._bytes
            now = time.monotonic()
            if now >= self._next_check or u64[_GONE_WORD] or (self._wide and any(view[_WIDE_GONE])):
                self.check_workers()
                self._next_check = now + CHECK_INTERVAL
            if len(parts) == 1:  # the common case: one bytes message
                piece = parts[0]
                pieces: Sequence[bytes | memoryview] = (piece if type(piece) is bytes else _bytes_of(piece),)
                total = len(pieces[0])
            else:
                pieces = [part if type(part) is bytes else _bytes_of(part) for part in parts]
                total = sum(map(len, pieces))
            offset, deadline = 0, None
            chunk, ring, base = self._chunk, self._ring, self._base
            while True:
                at = self._next
                spot = at % ring
                end, size = _record(offset, total, chunk)
                wrap = spot + size > ring  # no room before the ring's end: a marker, then the record at its start
                if wrap:
                    size = ring - spot
                if at + size + 8 > self._room_until:  # the record, and the next record's stamp
                    if deadline is None:
                        deadline = deadline_after(timeout)
                    self._wait_for_room(at + size + 8, deadline, timeout)
                record = base + spot
                if not wrap:
                    start = record + RECORD_HEADER
                    if end - offset == total:  # the whole message in this record: the common case
                        for piece in pieces:
                            view[start : start + len(piece)] = piece
                            start += len(piece)
                    else:
                        _copy_range(pieces, offset, end, view, start)
                # The next record's stamp is cleared before this one's is set, so that what a
                # worker finds there is 0 or a new stamp, never a stale one that might match.
                u64[(base + (spot + size) % ring) >> 3] = 0
                if not futex.TOTAL_STORE_ORDER:
                    futex.full_fence()
                line = record >> 3
                u64[line + 1] = _WRAP if wrap else total  # the polled line, touched last
                u64[line + 2] = offset  # where this record's bytes sit in the message
                u64[line] = at + 1  # the stamp: the record is published
                self._next = at + size
                futex.full_fence()  # the stamp is visible before the parked bytes are read
                if u64[_PARKED_WORD] or (self._wide and any(view[_WIDE_PARKED])):
                    futex.futex_wake(self._address + record)
                if not wrap:
                    if end >= total:
                        return
                    offset = end
        except BaseException as error:
            self._break(error)
            raise

    def _break(self, error: BaseException) -> None:
        """After a failed send: no more sends, and the workers learn it when they reach the cut."""
        self._broken = str(error) or type(error).__name__
        self._segment.u32[HEAD_STATE_AT // 4] = HEAD_BROKEN
        self.wake_readers()

    def mark_closed(self) -> None:
        """The head closes: a worker's wait ends once it has read everything published."""
        if self._segment.u32[HEAD_STATE_AT // 4] == HEAD_OPEN:  # a broken ring stays broken
            self._segment.u32[HEAD_STATE_AT // 4] = HEAD_CLOSED
        self.wake_readers()

    def wake_readers(self) -> None:
        futex.full_fence()
        futex.futex_wake(self._address + self._base + self._next % self._ring)  # where workers wait

    def _wait_for_room(self, need: int, deadline: float | None, timeout: float | None) -> None:
        """Return once every worker has consumed the ring up to ``need - ring_bytes``."""
        u64, words, ring = self._u64, self._reader_words, self._ring

        def room() -> bool:
            self._room_until = min(map(u64.__getitem__, words)) + ring
            return need <= self._room_until

        if room():
            return

        def check() -> None:
            self.check_workers()
            self.while_waiting()

        try:
            wait_until(
                room,
                segment=self._segment,
                park_word=lambda: 8 * min(words, key=u64.__getitem__),  # the slowest reader's counter
                parked_flag=WRITER_PARKED_AT,
                deadline=deadline,
                check=check,
                spin=self._spin_time,
            )
        except TimeoutError:
            lagging = [r + 1 for r, word in enumerate(words) if u64[word] < need - ring]
            raise TransportTimeout(
                f"the ring stayed full for {timeout} s: worker rank(s) {lagging} did not read "
                "what the head sent before (a live worker that stopped receiving)"
            ) from None

    def check_workers(self) -> None:
        """Raise [`PeerLost`][metrale_model_engine.transport.PeerLost] if a worker has left or died."""
        left = self._left()
        if left:
            reasons = ", ".join(f"worker rank {rank} {how}" for rank, how in left.items())
            raise PeerLost(f"{reasons}; nothing more can reach every worker")
        dead = self._dead()
        if dead:
            pids = sorted(dead.values())
            raise PeerLost(f"worker rank(s) {sorted(dead)} died (pids {pids}); nothing more can reach every worker")

    def gone_workers(self) -> dict[int, str]:
        """The workers that left or died, by rank, each with how (``"closed its transport"``, ``"died (pid 7)"``)."""
        return {rank: f"died (pid {pid})" for rank, pid in self._dead().items()} | self._left()  # left, then exited

    def _left(self) -> dict[int, str]:
        """The workers that marked themselves gone, by rank, with how."""
        segment = self._segment
        gone = segment.bytes[GONE_AT : GONE_AT + segment.layout.readers].tolist()
        return {
            r + 1: "closed its transport" if why == GONE_CLOSED else "stopped: its receive failed"
            for r, why in enumerate(gone)
            if why
        }

    def _dead(self) -> dict[int, int]:
        """The workers whose process exited, by rank, with their pid."""
        layout, u32 = self._segment.layout, self._segment.u32
        if len(self._peers) < layout.readers:  # watch the workers that attached since the last look
            for reader in range(layout.readers):
                pid = u32[layout.pid_at(reader) // 4]
                if pid:
                    self._peers.add(pid)
        dead = self._peers.dead()
        if not dead:
            return {}
        pids = {r + 1: u32[layout.pid_at(r) // 4] for r in range(layout.readers)}
        return {rank: pid for rank, pid in pids.items() if pid in dead}


class RingReader:
    """A worker's side: copies each message out of the ring, learns how long to spin.  Raises plain errors."""

    __slots__ = (
        "_address",
        "_base",
        "_budget",
        "_bytes",
        "_chunk",
        "_consumed_word",
        "_inbox",
        "_inbox_view",
        "_next",
        "_peers",
        "_reader",
        "_ring",
        "_segment",
        "_u64",
    )

    def __init__(self, segment: Segment, reader: int, peers: ProcessWatch, budget: SpinBudget) -> None:
        layout = segment.layout
        self._segment, self._reader, self._peers, self._budget = segment, reader, peers, budget
        self._u64, self._bytes, self._address = segment.u64, segment.bytes, segment.address
        self._ring, self._base, self._chunk = layout.ring_bytes, layout.ring_at, layout.chunk_bytes
        self._consumed_word = layout.reader_at(reader) // 8
        self._next = 0  # the position of the next record to read
        self._inbox = bytearray(4096)  # each message is copied here: the ring's bytes are the head's again at once
        self._inbox_view = memoryview(self._inbox)

    def take(self, timeout: float | None) -> memoryview:
        """The next message, copied out of the ring; valid until the next call."""
        u64, view = self._u64, self._bytes
        offset, deadline, message = 0, None, 0
        chunk, ring, base = self._chunk, self._ring, self._base
        while True:
            at = self._next
            record = base + at % ring
            line = record >> 3
            if u64[line] != at + 1:
                if deadline is None:
                    deadline = deadline_after(timeout)
                started = time.monotonic()
                self._wait_for_record(at, record, deadline, timeout, offset, message)
                if offset == 0:
                    self._budget.observe(time.monotonic() - started)
            elif offset == 0:
                self._budget.observe(0.0)
            if not futex.TOTAL_STORE_ORDER:
                futex.full_fence()
            total = u64[line + 1]
            if total == _WRAP:
                self._consumed(at + ring - at % ring)
                continue
            placed = u64[line + 2]
            if placed != offset or (offset and total != message):
                raise TransportCorrupt(
                    f"the ring is corrupt: the record at position {at} holds bytes from {placed} of a {total}-byte "
                    f"message, but this rank is reading bytes from {offset} of a {message}-byte message"
                )
            if offset == 0:
                message = total
                if total > len(self._inbox):
                    self._inbox = bytearray(max(total, 2 * len(self._inbox)))
                    self._inbox_view = memoryview(self._inbox)
            end, size = _record(offset, total, chunk)
            start = record + RECORD_HEADER
            self._inbox_view[offset:end] = view[start : start + end - offset]
            self._consumed(at + size)
            if end >= total:
                return self._inbox_view[:total]
            offset = end

    def _consumed(self, position: int) -> None:
        """Publish that this worker has read the ring up to ``position``; wake the head if it waits for room."""
        self._next = position
        if not futex.TOTAL_STORE_ORDER:
            futex.full_fence()
        u64 = self._u64
        u64[self._consumed_word] = position
        futex.full_fence()  # the counter is visible before the head's parked flag is read
        if u64[_WRITER_PARKED_WORD]:
            futex.futex_wake(self._address + 8 * self._consumed_word)

    def _wait_for_record(
        self, at: int, record: int, deadline: float | None, timeout: float | None, offset: int, message: int
    ) -> None:
        """Wait until the record at position ``at`` is published; ``offset`` of ``message`` bytes arrived so far.

        A head that closes the ring or breaks it wakes the wait, which then raises at once (``check_head``).
        """
        u64, u32, stamp, state = self._u64, self._segment.u32, record >> 3, HEAD_STATE_AT // 4

        def published() -> bool:
            found = u64[stamp]
            if found and found != at + 1:
                raise TransportCorrupt(f"the ring is corrupt: the record at position {at} has stamp {found - 1}")
            return found != 0 or u32[state] != HEAD_OPEN

        def check() -> None:
            self.check_head(offset, message)

        try:
            wait_until(
                published,
                segment=self._segment,
                park_word=lambda: record,
                parked_flag=PARKED_AT + self._reader,
                deadline=deadline,
                check=check,
                spin=self._budget.spin_time(),
            )
        except TimeoutError:
            raise TransportTimeout(f"timed out: no message from the head within {timeout} s") from None
        if not u64[stamp]:  # the head closed or broke the ring, with nothing more published
            self.check_head(offset, message)

    def check_head(self, offset: int = 0, message: int = 0) -> None:
        """Raise ``PeerLost`` if the head broke, closed or died (its ``offset`` of ``message`` bytes in)."""
        segment = self._segment
        state = segment.u32[HEAD_STATE_AT // 4]
        if state == HEAD_BROKEN:
            cut = f" after {offset} of the {message} bytes of its message, which is abandoned" if offset else ""
            raise PeerLost(f"a send of the head failed{cut}; the ring is broken, nothing more comes")
        if state == HEAD_CLOSED:
            raise PeerLost("the head closed the ring")
        if self._peers.dead():
            raise PeerLost(f"the head (pid {segment.u32[HEAD_PID_AT // 4]}) died")

    def leave(self, why: int) -> None:
        """Mark this worker gone for the head, keeping the first reason (a failure, then close)."""
        if not self._bytes[GONE_AT + self._reader]:
            self._bytes[GONE_AT + self._reader] = why


def _record(offset: int, total: int, chunk: int) -> tuple[int, int]:
    """The record that carries a ``total``-byte message from byte ``offset``, at most ``chunk`` of them: where its
    bytes end in the message, and the bytes it takes in the ring (its header line and payload, whole lines)."""
    end = offset + chunk if total - offset > chunk else total
    return end, (RECORD_HEADER + end - offset + LINE - 1) & -LINE


def _nothing() -> None:
    """Nothing to do while waiting."""


def _bytes_of(part: Buffer) -> memoryview:
    """``part`` as a byte view (a ``memoryview`` of bytes stays as it is)."""
    view = memoryview(part)
    return view if view.format == "B" else view.cast("B")


def _copy_range(pieces: Sequence[bytes | memoryview], offset: int, end: int, into: memoryview, start: int) -> None:
    """Copy bytes ``offset ..< end`` of the concatenation of ``pieces`` into ``into`` at ``start``."""
    position = 0
    for piece in pieces:
        length = len(piece)
        low, high = max(offset, position), min(end, position + length)
        if low < high:
            into[start + low - offset : start + high - offset] = piece[low - position : high - position]
        position += length
        if position >= end:
            return
