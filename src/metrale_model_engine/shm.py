"""The protocol over shared memory: one host's ranks exchange words in microseconds.

:class:`ShmTransport` is an :class:`~metrale_model_engine.EpTransport` over a ring
in a shared-memory segment, one writer (the head) and ``world_size - 1`` readers
(the workers).  The head creates the segment (:meth:`ShmTransport.create`), passes
its :attr:`~ShmTransport.name` to the workers by any means (process arguments, an
environment variable), and each worker attaches by name
(:meth:`ShmTransport.attach`).  Over a torch.distributed group,
``metrale_model_engine.torch.open_transport("shm")`` does that rendezvous, and
``TorchEp(transport="auto")`` uses it whenever every rank is on one host.  This
module needs only the standard library and never imports torch.  Linux only (x86-64
and arm64): it sleeps on futexes and watches peers through pidfds.

The ring
    ``ring_bytes`` of records, one after another, each at a 64-byte boundary: a
    stamp, the length of its message, then its payload.  Each broadcast is one
    message; a message longer than ``chunk_bytes`` travels as consecutive records,
    so that a worker copies one out while the head writes the next, and any length
    goes through a ring of any size (a 1,048,576-token array is 32 records of the
    default 128 KiB).  A small message takes 128 bytes, so the default 1 MiB ring
    holds 8,192 of them.  A record that does not fit before the ring's end is
    preceded by a marker that sends the readers back to its start.  The head writes
    and returns at once; it waits only when the ring is full (back-pressure), for
    as long as the broadcast's timeout allows.

Positions, not flags
    Every rank counts bytes since the ring's start (u64, never wrapping).  The
    record at position ``p`` lies at ``p % ring_bytes`` and is published when its
    stamp reads ``p + 1``; the head clears the stamp of the record after it before
    publishing it, so the stamp a worker waits on is either 0 or the right one,
    never a stale value that might match.  Each worker publishes its *consumed*
    position; the head writes below ``min(consumed) + ring_bytes`` only.  So no
    worker sees a record twice, skips one, or reads bytes being rewritten.  Each
    counter has one writer and its own cache line.

Memory ordering
    The rule: shared memory is the only source of truth; a wake-up is only a hint,
    and every wait has a deadline.  Python promises no memory model; what this
    relies on is how CPython's ``memoryview`` writes native items (one ``memcpy``
    of the item size, which compilers turn into one aligned store for 4 and 8
    bytes, so counters are never torn) and the processor's ordering:

    * x86-64 keeps stores in program order and loads in program order (TSO), so
      "payload, then stamp" on the writer and "stamp, then payload" on the
      reader need no barrier, nor does "copy out, then consumed".  A store may
      pass a later load, though, which breaks the sleep handshake (below) unless a
      full barrier separates them.
    * arm64 reorders all of these, so there a full barrier also goes between a
      payload and the stamp that publishes it, and between a stamp or counter
      and what it guards.

    The barrier is an uncontended lock's acquire and release
    (:func:`~metrale_model_engine._futex.full_fence`): on x86-64 both are
    ``lock``-prefixed instructions, full barriers.  On arm64 they are
    acquire/release atomics, which order message passing but not, in every
    case, a store before a later load: there a lost wake-up is possible in
    principle, and the wait cap below bounds what it costs.

Waiting
    A reader that finds nothing spins, yielding the core (``sched_yield``), for
    ``spin_time`` seconds, then sleeps in the kernel: it sets its parked byte,
    re-reads the stamp, and calls ``FUTEX_WAIT`` on the stamp's low half with the
    value it saw, capped at :data:`CHECK_INTERVAL`.  After publishing, the head
    passes a full barrier and wakes the record's sleepers only if a parked byte is
    set.  Either the head sees the byte and wakes, or the reader's kernel call sees
    the new stamp and does not sleep: no wake-up is lost.  The
    head waits for room the same way, on the slowest reader's consumed counter,
    and readers wake it.  An idle worker therefore costs a few wake-ups a second.

Faults
    Every wait checks, at least every :data:`CHECK_INTERVAL`, that its peers are
    alive (pidfds, so a reused pid is never taken for the peer) and that they have
    not left.  A worker whose receive fails marks itself gone before it raises, and
    the head's next broadcast raises for it at once; a worker killed outright is
    found by the head's liveness check, which every broadcast runs at most once per
    :data:`CHECK_INTERVAL`, and which every wait for room runs.  A dead or closed
    head ends a worker's wait, once the worker has read everything the head
    published.

    A failed send ends the ring for the head, as a failed broadcast ends a gloo
    group: it may have published part of a message, so every later send raises at
    once, and each worker reads the whole messages before the cut, then raises.
    Every record carries its offset in its message and the message's length, so a
    record that does not continue the message being read is corruption, never data.

Lifecycle
    The head unlinks the segment's name as soon as every worker has attached (at
    the first :meth:`~ShmTransport.gather`, which ``WireEp`` runs at setup), so no
    crash of any rank after setup can leave a file in ``/dev/shm``; the mappings
    live on until each rank closes.  A segment left by a run that crashed during
    setup is removed by the next :meth:`~ShmTransport.create` on the machine (its
    creator's pid is dead), and never breaks a new run: every name is new.

Not thread-safe: one thread of each rank uses its transport.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import Final

from typing_extensions import Buffer, Self, TypeVarTuple, Unpack

from . import _futex
from ._errors import EpReceiveError, EpSendError, EpSetupError
from ._launch import check_launch, join_all
from ._liveness import ProcessWatch, process_exists
from ._segment import (
    BELL_AT,
    GATHER_WORDS,
    GONE_AT,
    GONE_CLOSED,
    GONE_FAILED,
    HEAD_BROKEN,
    HEAD_CLOSED,
    HEAD_OPEN,
    HEAD_PID_AT,
    HEAD_STATE_AT,
    LINE,
    MAX_WORLD_SIZE,
    PARKED_AT,
    RECORD_HEADER,
    WRITER_PARKED_AT,
    Layout,
    Segment,
    attach_segment,
    create_segment,
    unlink_segment,
)
from ._transport import Broadcast

__all__ = [
    "CHECK_INTERVAL",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RING_BYTES",
    "DEFAULT_SETUP_TIMEOUT",
    "DEFAULT_SPIN_TIME",
    "MAX_WORLD_SIZE",
    "ShmTransport",
    "run_local",
    "shm_supported",
]

DEFAULT_RING_BYTES: Final[int] = 1 << 20
"""Bytes of the ring: how far the head may run ahead of the slowest worker (a frame takes 128)."""
DEFAULT_CHUNK_BYTES: Final[int] = 128 * 1024
"""Payload bytes per record at most: a longer message travels as consecutive records.

Measured on a 2-core machine (a 256 KiB message): 16 KiB records cost twice the time of
64-128 KiB ones; each record costs both sides a few microseconds of Python."""
DEFAULT_SPIN_TIME: Final[float] = 0.001
"""Seconds a waiting rank spins (yielding the core) before it sleeps in the kernel."""
DEFAULT_SETUP_TIMEOUT: Final[float] = 300.0
"""Seconds a gather (the setup exchange) waits for every rank to attach and answer."""
CHECK_INTERVAL: Final[float] = 0.05
"""Seconds between a waiting rank's checks of its peers, and the cap on every sleep."""

_PARKED_WORD: Final[int] = PARKED_AT // 8
"""The parked bytes of readers 1-8 as one u64: one load tells whether any sleeps."""
_GONE_WORD: Final[int] = GONE_AT // 8
_SPIN_BURST: Final[range] = range(16)
"""Looks between two yields of the core while spinning."""
_WRAP: Final[int] = (1 << 64) - 1
"""The message length of a record that only says: the next record is at the ring's start."""
_WRITER_PARKED_WORD: Final[int] = WRITER_PARKED_AT // 8
_WIDE_PARKED: Final[slice] = slice(PARKED_AT + 8, PARKED_AT + LINE)
"""The parked bytes of readers 9 and up, read only in rings of more than 9 ranks."""
_WIDE_GONE: Final[slice] = slice(GONE_AT + 8, GONE_AT + LINE)


def shm_supported() -> bool:
    """Whether this platform can run the shared-memory transport (Linux on x86-64 or arm64)."""
    return _futex.SUPPORTED and os.path.isdir("/dev/shm")


class _Closed(Exception):
    """The transport was closed on this rank."""


class ShmTransport:
    """A group of ranks of one host that rank 0 broadcasts u32 words to through shared memory.

    Build it with :meth:`create` on the head and :meth:`attach` on each worker;
    the constructor is theirs.  Use it like any transport: give it to a
    :class:`~metrale_model_engine.WireEp` model, whose construction runs the first
    :meth:`gather` (every rank must take part, within ``setup_timeout``).

    A broadcast's ``timeout`` bounds its wait: on the head, for room in a full
    ring; on a worker, for the message.  ``None`` waits as long as the peers live;
    ``0`` or less checks once and does not wait.

    Errors: a failed broadcast raises :class:`~metrale_model_engine.EpSendError` on
    the head (and every later one too: the ring is broken, see the module's
    "Faults") and :class:`~metrale_model_engine.EpReceiveError` on a worker (a
    message of another length than the receive expects included: the message
    names both), a failed gather :class:`~metrale_model_engine.EpSetupError`.
    """

    __slots__ = (
        "__weakref__",
        "_address",
        "_broken",
        "_bytes",
        "_chunk",
        "_closed",
        "_consumed_word",
        "_finalizer",
        "_gathers",
        "_next",
        "_next_check",
        "_owner",
        "_peers",
        "_reader",
        "_reader_words",
        "_ring",
        "_ring_at",
        "_room_until",
        "_segment",
        "_setup_timeout",
        "_spin_time",
        "_u64",
        "_unlinked",
        "_wide",
        "rank",
        "world_size",
    )

    def __init__(self, segment: Segment, rank: int, *, spin_time: float, setup_timeout: float) -> None:
        self._segment = segment
        layout = segment.layout
        # The hot paths read these plain attributes, not the layout's computed properties.
        self._u64, self._bytes, self._address = segment.u64, segment.bytes, segment.address
        self._ring, self._ring_at, self._chunk = layout.ring_bytes, layout.ring_at, layout.chunk_bytes
        self._wide = layout.readers > 8
        self.rank: Final = rank
        self.world_size: Final = segment.layout.world_size
        self._reader = rank - 1
        self._spin_time = spin_time
        self._setup_timeout = setup_timeout
        self._owner = os.getpid()
        self._peers = ProcessWatch()
        self._next = 0  # the ring position (bytes since the start) of the next record to write or read
        self._reader_words = tuple(layout.reader_at(reader) // 8 for reader in range(layout.readers))
        self._consumed_word = self._reader_words[self._reader] if rank else -1
        # The head may write below this position without looking at the workers' counters.
        self._room_until = layout.ring_bytes if layout.readers else 1 << 64
        self._next_check = 0.0  # when the head next checks that its workers live
        self._gathers = 0
        self._unlinked = rank != 0
        self._closed = False
        self._broken: str | None = None  # why a send failed: the ring is then over for the head
        self._finalizer = weakref.finalize(self, _release, segment.name, self._owner if rank == 0 else None)

    # -- building ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        world_size: int,
        *,
        ring_bytes: int = DEFAULT_RING_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        spin_time: float = DEFAULT_SPIN_TIME,
        setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    ) -> Self:
        """Create the ring for ``world_size`` ranks; this process is the head (rank 0).

        Pass :attr:`name` to the workers.  The segment takes ``ring_bytes`` and a few
        pages of ``/dev/shm``.

        Args:
            world_size: ranks in the group, head included (``1 ..= 64``).
            ring_bytes: bytes of the ring, a multiple of 64 and at least
                ``2 * (chunk_bytes + 64)``: how far the head may run ahead.
            chunk_bytes: payload bytes per record at most, a positive multiple of
                64: longer messages are cut into records of this size, which the
                workers copy out while the head writes the next.
            spin_time: seconds a waiting rank spins before sleeping (``>= 0``).
            setup_timeout: seconds a gather waits for every rank (``> 0``).

        Raises:
            TypeError, ValueError: an argument is out of its range (the message
                names it).
            OSError: ``/dev/shm`` lacks the space (the message says how much) or
                cannot be written.
            RuntimeError: this platform cannot run it (see :func:`shm_supported`).
        """
        _require_int("world_size", world_size, 1, MAX_WORLD_SIZE)
        _require_int("chunk_bytes", chunk_bytes, LINE, 1 << 28)
        _require_int("ring_bytes", ring_bytes, 2 * (chunk_bytes + LINE), 1 << 30)
        for name, value in (("chunk_bytes", chunk_bytes), ("ring_bytes", ring_bytes)):
            if value % LINE:
                raise ValueError(f"{name} must be a multiple of {LINE}, got {value}")
        _check_options(spin_time, setup_timeout)
        _require_platform()
        segment = create_segment(Layout(world_size, ring_bytes, chunk_bytes), os.getpid())
        return cls(segment, 0, spin_time=float(spin_time), setup_timeout=float(setup_timeout))

    @classmethod
    def attach(
        cls,
        name: str,
        rank: int,
        *,
        spin_time: float = DEFAULT_SPIN_TIME,
        setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    ) -> Self:
        """Attach to the ring ``name`` that the head created, as worker ``rank`` (``>= 1``).

        Attach before the head's first gather completes: it removes the name then.

        Raises:
            TypeError, ValueError: a bad argument, or ``rank`` outside
                ``1 ..= world_size - 1``.
            EpSetupError: no segment of that name, not this library's layout, or
                ``rank`` already attached by a live process.
            RuntimeError: this platform cannot run it.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str (the head's ShmTransport.name), got {type(name).__name__} {name!r}")
        _require_int("rank", rank, 1, MAX_WORLD_SIZE - 1)
        _check_options(spin_time, setup_timeout)
        _require_platform()
        segment = attach_segment(name)
        world_size = segment.layout.world_size
        pid_at = segment.layout.pid_at(rank - 1) // 4
        try:
            if rank >= world_size:
                raise ValueError(
                    f"rank={rank} is out of range for the ring's world_size={world_size} (1 ..= {world_size - 1})"
                )
            holder = segment.u32[pid_at]
            if holder and process_exists(holder):
                raise EpSetupError(f"rank {rank} of ring {name!r} is attached already, by pid {holder}")
            segment.u32[pid_at] = os.getpid()
        except BaseException:
            segment.close()
            raise
        transport = cls(segment, rank, spin_time=float(spin_time), setup_timeout=float(setup_timeout))
        transport._peers.add(segment.u32[HEAD_PID_AT // 4])
        return transport

    # -- what callers ask -----------------------------------------------------

    @property
    def name(self) -> str:
        """The segment's name, for :meth:`attach`."""
        return self._segment.name

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran on this rank."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ShmTransport {self.name!r} rank {self.rank} of {self.world_size}, {state}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the ring.  Idempotent.

        The head marks the ring closed (a worker's wait ends once it has read
        everything published) and removes the segment's name if it is still there;
        a worker marks itself gone (the head's next broadcast raises).  Later
        broadcasts on this rank raise.
        """
        if self._closed:
            return
        self._closed = True
        segment = self._segment
        if os.getpid() == self._owner:
            if self.rank == 0:
                if segment.u32[HEAD_STATE_AT // 4] == HEAD_OPEN:  # a broken ring stays broken
                    segment.u32[HEAD_STATE_AT // 4] = HEAD_CLOSED
                _futex.full_fence()
                _futex.futex_wake(self._address + self._ring_at + self._next % self._ring)  # where workers wait
            else:
                self._leave(GONE_CLOSED)
        self._finalizer()
        self._peers.close()
        segment.close()

    # -- EpTransport -----------------------------------------------------------

    def bind(self, words: Buffer) -> Broadcast:
        """A broadcaster of ``words`` (a C-contiguous u32 buffer): each call is one message."""
        data = memoryview(words).cast("B")
        return partial(self._send if self.rank == 0 else self._receive, data)

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        """Every rank's ``words`` (at most 13 u32 words, the same count on every rank), by rank.

        Collective: waits for every rank, up to ``setup_timeout``.  The head's first
        gather is the moment every worker has attached: it unlinks the segment's
        name then.

        Raises:
            ValueError: too many words, or not u32 words.
            EpSetupError: a rank did not answer in time, died, or sent another count.
        """
        if self._closed:
            raise EpSetupError("this ShmTransport was closed")
        values = list(words)
        if len(values) > GATHER_WORDS or not all(type(v) is int and 0 <= v <= 0xFFFF_FFFF for v in values):
            raise ValueError(f"gather takes at most {GATHER_WORDS} u32 words, got {values!r}")
        layout, u32 = self._segment.layout, self._segment.u32
        generation = self._gathers + 1
        mine = layout.gather_at(self.rank) // 4
        u32[mine + 2] = len(values)
        for index, value in enumerate(values):
            u32[mine + 3 + index] = value
        _futex.full_fence()
        u32[mine] = generation
        self._ring_bell()
        lines = [layout.gather_at(rank) // 4 for rank in range(self.world_size)]
        self._wait_for_ranks(lambda: all(u32[line] >= generation for line in lines), "answer the gather")
        everyone = [list(u32[line + 3 : line + 3 + u32[line + 2]]) for line in lines]
        u32[mine + 1] = generation  # read: the others may overwrite their words after this
        self._ring_bell()
        self._wait_for_ranks(lambda: all(u32[line + 1] >= generation for line in lines), "finish the gather")
        self._gathers = generation
        if not self._unlinked:  # every worker has attached: nothing can leak from here on
            unlink_segment(self.name)
            self._unlinked = True
        counts = {len(words) for words in everyone}
        if len(counts) > 1:
            per_rank = ", ".join(f"rank {r}: {len(w)}" for r, w in enumerate(everyone))
            raise EpSetupError(f"rank {self.rank}: the ranks gathered different word counts ({per_rank})")
        return everyone

    # -- head ------------------------------------------------------------------

    def _send(self, data: memoryview, timeout: float | None) -> None:
        if self._closed:
            raise EpSendError("this ShmTransport was closed")
        if self._broken is not None:
            raise EpSendError(f"the ring is broken since an earlier send failed ({self._broken}); nothing more is sent")
        try:
            self._publish(data, timeout)
        except BaseException as error:
            self._break(error)
            raise

    def _publish(self, data: memoryview, timeout: float | None) -> None:
        u64, view = self._u64, self._bytes
        now = time.monotonic()
        if now >= self._next_check or u64[_GONE_WORD] or (self._wide and any(view[_WIDE_GONE])):
            self._check_workers()
            self._next_check = now + CHECK_INTERVAL
        total, offset, deadline = len(data), 0, None
        chunk, ring, base = self._chunk, self._ring, self._ring_at
        while True:
            at = self._next
            spot = at % ring
            end = offset + chunk if total - offset > chunk else total
            size = (RECORD_HEADER + end - offset + LINE - 1) & -LINE
            wrap = spot + size > ring  # no room before the ring's end: a marker, then the record at its start
            if wrap:
                size = ring - spot
            if at + size + 8 > self._room_until:  # the record, and the next record's stamp
                if deadline is None:
                    deadline = _deadline(timeout)
                self._wait_for_room(at + size + 8, deadline, timeout)
            record = base + spot
            if not wrap:
                start = record + RECORD_HEADER
                view[start : start + end - offset] = data[offset:end] if offset or end < total else data
            # The next record's stamp is cleared before this one's is set, so that what a
            # worker finds there is 0 or a new stamp, never a stale one that might match.
            u64[(base + (spot + size) % ring) >> 3] = 0
            if not _futex.TOTAL_STORE_ORDER:
                _futex.full_fence()
            line = record >> 3
            u64[line + 1] = _WRAP if wrap else total  # the polled line, touched last
            u64[line + 2] = offset  # where this record's bytes sit in the message
            u64[line] = at + 1  # the stamp: the record is published
            self._next = at + size
            _futex.full_fence()  # the stamp is visible before the parked bytes are read
            if u64[_PARKED_WORD] or (self._wide and any(view[_WIDE_PARKED])):
                _futex.futex_wake(self._address + record)
            if not wrap:
                if end >= total:
                    return
                offset = end

    def _break(self, error: BaseException) -> None:
        """After a failed send: no more sends, and the workers learn it when they reach the cut.

        A send can fail after publishing part of a message (the ring stayed full for
        the whole timeout, a worker died); those records stay in the ring.  Rather
        than let a worker take the next message for the rest of this one, the ring
        ends here for the head: the workers read every whole message before the cut,
        then raise.
        """
        self._broken = str(error) or type(error).__name__
        if os.getpid() == self._owner and not self._closed:
            self._segment.u32[HEAD_STATE_AT // 4] = HEAD_BROKEN
            _futex.full_fence()
            _futex.futex_wake(self._address + self._ring_at + self._next % self._ring)  # where workers wait

    def _wait_for_room(self, need: int, deadline: float | None, timeout: float | None) -> None:
        """Return once every worker has consumed the ring up to ``need - ring_bytes``."""
        u64, words, ring = self._u64, self._reader_words, self._ring

        def room() -> bool:
            self._room_until = min(map(u64.__getitem__, words)) + ring
            return need <= self._room_until

        if room():
            return

        def slowest() -> int:
            return 8 * min(words, key=u64.__getitem__)

        try:
            self._wait(room, slowest, WRITER_PARKED_AT, deadline, self._check_workers)
        except TimeoutError:
            lagging = [r + 1 for r, word in enumerate(words) if u64[word] < need - ring]
            raise EpSendError(
                f"the ring stayed full for {timeout} s: worker rank(s) {lagging} did not read "
                "what the head sent before (a live worker that stopped receiving)"
            ) from None

    def _check_workers(self) -> None:
        """Raise :class:`EpSendError` if a worker has left or died."""
        if self._closed:
            raise EpSendError("this ShmTransport was closed")
        segment = self._segment
        gone = segment.bytes[GONE_AT : GONE_AT + segment.layout.readers].tolist()
        left = {r + 1: why for r, why in enumerate(gone) if why}
        if left:
            reasons = ", ".join(
                f"worker rank {rank} {'closed its transport' if why == GONE_CLOSED else 'stopped: its receive failed'}"
                for rank, why in left.items()
            )
            raise EpSendError(f"{reasons}; nothing more can reach every worker")
        self._watch_new_workers()
        dead = self._peers.dead()
        if dead:
            raise EpSendError(f"worker process(es) {sorted(dead)} died; nothing more can reach every worker")

    def _watch_new_workers(self) -> None:
        """Start watching the workers that have attached since the last look."""
        layout, u32 = self._segment.layout, self._segment.u32
        if len(self._peers) < layout.readers:
            for reader in range(layout.readers):
                pid = u32[layout.pid_at(reader) // 4]
                if pid:
                    self._peers.add(pid)

    # -- worker ----------------------------------------------------------------

    def _receive(self, data: memoryview, timeout: float | None) -> None:
        try:
            self._receive_message(data, timeout)
        except _Closed:
            raise EpReceiveError("this ShmTransport was closed") from None
        except BaseException:
            if not self._closed:
                self._leave(GONE_FAILED)  # the head's next broadcast raises for this rank
            raise

    def _receive_message(self, data: memoryview, timeout: float | None) -> None:
        if self._closed:
            raise _Closed
        u64, view = self._u64, self._bytes
        expected, offset, deadline, mismatch, message = len(data), 0, None, -1, 0
        chunk, ring, base = self._chunk, self._ring, self._ring_at
        while True:
            at = self._next
            record = base + at % ring
            line = record >> 3
            if u64[line] != at + 1:
                if deadline is None:
                    deadline = _deadline(timeout)
                self._wait_for_record(at, record, deadline, timeout, offset, message)
            if not _futex.TOTAL_STORE_ORDER:
                _futex.full_fence()
            total = u64[line + 1]
            if total == _WRAP:
                self._consumed(at + ring - at % ring)
                continue
            placed = u64[line + 2]
            if placed != offset or (offset and total != message):
                raise EpReceiveError(
                    f"the ring is corrupt: the record at position {at} holds bytes from {placed} of a {total}-byte "
                    f"message, but this rank is reading bytes from {offset} of a {message}-byte message"
                )
            if offset == 0:
                message = total
                if total != expected:
                    mismatch = total  # consumed to its end, unread, then reported
            end = offset + chunk if total - offset > chunk else total
            if mismatch < 0:
                start = record + RECORD_HEADER
                data[offset:end] = view[start : start + end - offset]
            self._consumed(at + ((RECORD_HEADER + end - offset + LINE - 1) & -LINE))
            if end >= total:
                break
            offset = end
        if mismatch >= 0:
            raise EpReceiveError(
                f"the head sent a message of {mismatch // 4} words, but this rank expected {expected // 4} words "
                "(the message was consumed)"
            )

    def _consumed(self, position: int) -> None:
        """Publish that this worker has read the ring up to ``position``; wake the head if it waits for room."""
        self._next = position
        if not _futex.TOTAL_STORE_ORDER:
            _futex.full_fence()
        u64 = self._u64
        u64[self._consumed_word] = position
        _futex.full_fence()  # the counter is visible before the head's parked flag is read
        if u64[_WRITER_PARKED_WORD]:
            _futex.futex_wake(self._address + 8 * self._consumed_word)

    def _wait_for_record(
        self, at: int, record: int, deadline: float | None, timeout: float | None, offset: int, message: int
    ) -> None:
        """Wait until the record at position ``at`` (offset ``record``) is published.

        ``offset`` bytes of a ``message``-byte message have arrived so far (0: the
        record starts a message).
        """
        u64, stamp = self._u64, record >> 3
        check = partial(self._check_head, offset, message)

        def published() -> bool:
            found = u64[stamp]
            if found and found != at + 1:
                raise EpReceiveError(f"the ring is corrupt: the record at position {at} has stamp {found - 1}")
            return found != 0

        try:
            self._wait(published, lambda: record, PARKED_AT + self._reader, deadline, check)
        except TimeoutError:
            raise EpReceiveError(f"timed out: no message from the head within {timeout} s") from None

    def _check_head(self, offset: int = 0, message: int = 0) -> None:
        if self._closed:
            raise _Closed
        segment = self._segment
        state = segment.u32[HEAD_STATE_AT // 4]
        if state == HEAD_BROKEN:
            cut = f" after {offset} of the {message} bytes of its message, which is abandoned" if offset else ""
            raise EpReceiveError(f"a send of the head failed{cut}; the ring is broken, nothing more comes")
        if state == HEAD_CLOSED:
            raise EpReceiveError("the head closed the ring")
        if self._peers.dead():
            raise EpReceiveError(f"the head (pid {segment.u32[HEAD_PID_AT // 4]}) died")

    def _leave(self, why: int) -> None:
        """Mark this worker gone for the head, keeping the first reason (a failure, then close)."""
        if not self._bytes[GONE_AT + self._reader]:
            self._bytes[GONE_AT + self._reader] = why

    # -- waiting -----------------------------------------------------------------

    def _wait(
        self,
        ready: Callable[[], bool],
        park_word: Callable[[], int],
        parked_flag: int | None,
        deadline: float | None,
        check: Callable[[], None],
    ) -> None:
        """Return once ``ready()``; spin for ``spin_time``, then sleep on ``park_word()``'s u32.

        ``parked_flag`` is the byte that tells the other side to wake this rank
        (``None``: the other side always wakes).
        ``check()`` runs at least every :data:`CHECK_INTERVAL` and raises for a dead
        or gone peer.  Raises ``TimeoutError`` past ``deadline`` (``None``: none).
        """
        segment = self._segment
        started = time.monotonic()
        spin_until, next_check = started + self._spin_time, started + CHECK_INTERVAL
        while not ready():
            now = time.monotonic()
            if now >= next_check:
                check()
                next_check = now + CHECK_INTERVAL
            if deadline is not None and now >= deadline:
                if ready():
                    return
                raise TimeoutError
            if now < spin_until:
                for _ in _SPIN_BURST:  # a few microseconds of looking, then the core for others
                    if ready():
                        return
                os.sched_yield()
                continue
            word = park_word()
            if parked_flag is not None:
                segment.bytes[parked_flag] = 1
            seen = segment.u32[word // 4]
            try:
                if not ready():
                    nap = CHECK_INTERVAL if deadline is None else min(CHECK_INTERVAL, deadline - now)
                    _futex.futex_wait(segment.address + word, seen, max(nap, 1e-6))
            finally:
                if parked_flag is not None:
                    segment.bytes[parked_flag] = 0

    def _wait_for_ranks(self, ready: Callable[[], bool], doing: str) -> None:
        """A gather's wait: for every rank, bounded by ``setup_timeout``, woken by the bell."""
        segment, layout = self._segment, self._segment.layout
        pid_words = [HEAD_PID_AT // 4] + [layout.pid_at(r) // 4 for r in range(layout.readers)]
        watch = ProcessWatch()

        def check() -> None:
            if self._closed:
                raise EpSetupError("this ShmTransport was closed")
            for word in pid_words:
                if segment.u32[word]:
                    watch.add(segment.u32[word])
            dead = watch.dead()
            if dead:
                raise EpSetupError(
                    f"rank {self.rank}: process(es) {sorted(dead)} of the ring died before every rank could {doing}"
                )

        try:
            self._wait(ready, lambda: BELL_AT, None, time.monotonic() + self._setup_timeout, check)
        except TimeoutError:
            missing = [r for r, word in enumerate(pid_words) if not segment.u32[word]]
            hint = f"; rank(s) {missing} never attached" if missing else ""
            raise EpSetupError(
                f"rank {self.rank}: not every rank of the ring managed to {doing} within "
                f"setup_timeout={self._setup_timeout} s{hint}"
            ) from None
        except EpSetupError:
            if self.rank != 0:
                unlink_segment(self.name)  # the head may be gone: nobody else would
            raise
        finally:
            watch.close()

    def _ring_bell(self) -> None:
        segment = self._segment
        bell = BELL_AT // 4
        segment.u32[bell] = (segment.u32[bell] + 1) & 0xFFFF_FFFF
        _futex.futex_wake(segment.address + BELL_AT)


def _deadline(timeout: float | None) -> float | None:
    """The monotonic deadline of a wait of ``timeout`` seconds; 0, negative and NaN mean "now"."""
    if timeout is None:
        return None
    return time.monotonic() + (timeout if timeout > 0 else 0.0)


def _release(name: str, head_pid: int | None) -> None:
    """At close or garbage collection: the head's process unlinks the name if it is still there."""
    if head_pid is not None and os.getpid() == head_pid:
        unlink_segment(name)


def _require_int(name: str, value: object, low: int, high: int) -> None:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int in {low} ..= {high}, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range ({low} ..= {high})")


def _check_options(spin_time: object, setup_timeout: object) -> None:
    for name, value, bound in (("spin_time", spin_time, ">= 0"), ("setup_timeout", setup_timeout, "> 0")):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be a finite number of seconds {bound}, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0 or (name == "setup_timeout" and value == 0):
            raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value}")


def _require_platform() -> None:
    if not shm_supported():
        raise RuntimeError(
            f"the shared-memory transport needs Linux on x86-64 or arm64 with /dev/shm; this is "
            f"{os.uname().sysname} on {_futex.MACHINE}: use the torch.distributed transport"
        )


Ts = TypeVarTuple("Ts")


def run_local(
    target: Callable[[ShmTransport, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    timeout: float = 300.0,
    spin_time: float = DEFAULT_SPIN_TIME,
) -> list[int]:
    """Run ``target(transport, *args)`` in ``world_size`` fresh processes that share one ring.

    Rank 0 creates the ring and hands its name to the others through pipes; each
    rank's ``transport.rank`` says which it is, and its transport is closed when
    ``target`` returns.  No torch needed.  ``target`` and ``args`` must be
    picklable (the ``spawn`` start method).  Processes still running after
    ``timeout`` seconds are killed.

    Returns:
        Every rank's exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TypeError: ``world_size`` is not an int, or ``timeout`` not a number.
        ValueError: ``world_size < 1`` or ``timeout <= 0``.
    """
    check_launch(world_size, timeout)
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(world_size - 1)]
    names: list[list[Connection]] = [[send for _, send in pipes]] + [[receive] for receive, _ in pipes]
    processes = [
        context.Process(target=_local_rank, args=(target, rank, world_size, names[rank], spin_time, timeout, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for receive, send in pipes:  # the ranks hold their own ends: a dead head closes the workers' pipes
        receive.close()
        send.close()
    return join_all(processes, timeout)


def _local_rank(
    target: Callable[..., None],
    rank: int,
    world_size: int,
    names: list[Connection],
    spin_time: float,
    timeout: float,
    args: tuple[object, ...],
) -> None:
    if rank == 0:
        transport = ShmTransport.create(world_size, spin_time=spin_time)
        for pipe in names:
            pipe.send(transport.name)
            pipe.close()
    else:
        (pipe,) = names
        if not pipe.poll(timeout):
            raise EpSetupError(f"rank {rank}: the head sent no ring name within {timeout} s")
        transport = ShmTransport.attach(pipe.recv(), rank, spin_time=spin_time)
    with transport:
        target(transport, *args)
