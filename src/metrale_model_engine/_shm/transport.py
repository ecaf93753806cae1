"""``ShmTransport``: the shared-memory transport's class (the public module is ``metrale_model_engine.shm``)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Final, TypedDict

from typing_extensions import Buffer, Self

from .._core.checks import check_int, check_seconds
from .._core.transport import TransportClosed
from .._host.liveness import ProcessWatch, process_exists
from . import futex
from .answers import ANSWERED_WORD, AnswerReader, AnswerWriter
from .gather import SetupGather
from .regroup import RingRegroup
from .ring import RingReader, RingWriter
from .segment import (
    GONE_CLOSED,
    GONE_FAILED,
    HEAD_PID_AT,
    LINE,
    MAX_WORLD_SIZE,
    Layout,
    Segment,
    attach_segment,
    create_segment,
    unlink_segment,
)
from .waiting import DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME, SpinBudget

DEFAULT_RING_BYTES: Final[int] = 1 << 20
"""Bytes of the ring: how far the head may run ahead of the slowest worker (a small message takes 128)."""
DEFAULT_CHUNK_BYTES: Final[int] = 128 * 1024
"""Payload bytes per record at most: a longer message travels as consecutive records.

Measured on a 2-core machine (a 256 KiB message): 16 KiB records cost twice the time of
64-128 KiB ones; each record costs both sides a few microseconds of Python."""
DEFAULT_SETUP_TIMEOUT: Final[float] = 300.0
"""Seconds a gather (the setup exchange) waits for every rank to attach and answer."""
RING_SETUP_ERRORS: Final = (OSError, RuntimeError, ValueError)
"""What ``ShmTransport.create`` and ``attach`` raise when the ring cannot be had
(no space, no platform, a bad segment); launchers gather their ``setup_reason`` into
``_core.errors.ring_setup_failed``."""


def shm_supported() -> bool:
    """Whether this platform can run the shared-memory transport (Linux on x86-64 or arm64)."""
    return futex.SUPPORTED and os.path.isdir("/dev/shm")


class ShmTransport:
    """A group of ranks of one host that rank 0 sends messages to through shared memory.

    Build it with [`create`][metrale_model_engine.shm.ShmTransport.create] on the head and
    [`attach`][metrale_model_engine.shm.ShmTransport.attach] on each worker; the constructor is theirs.  Give it to an
    [`EpLink`][metrale_model_engine.EpLink], whose construction runs the first
    [`gather`][metrale_model_engine.shm.ShmTransport.gather] (every rank must take part, within ``setup_timeout``).  A
    send's or receive's ``timeout`` bounds its wait: on the head, for room in a full ring; on a worker, for the message.
     ``None``
    waits as long as the peers live; ``0`` or less checks once and does not wait.
    """

    __slots__ = (
        "__weakref__",
        "_answers_in",
        "_answers_out",
        "_closed",
        "_finalizer",
        "_gather",
        "_owner",
        "_peers",
        "_reader",
        "_segment",
        "_spins",
        "_unlinked",
        "_writer",
        "rank",
        "world_size",
    )

    def __init__(
        self,
        segment: Segment,
        rank: int,
        *,
        spin_time: float,
        max_spin_time: float,
        setup_timeout: float,
        members: Sequence[int] = (),
    ):
        self._segment = segment
        self._spins = (spin_time, max_spin_time)
        self.rank: Final = rank
        self.world_size: Final = segment.layout.world_size
        self._owner = os.getpid()
        self._peers = ProcessWatch()
        self._closed = False
        self._unlinked = rank != 0
        self._gather = SetupGather(segment, rank, setup_timeout, members)
        self._writer = RingWriter(segment, self._peers, spin_time) if rank == 0 else None
        budget = SpinBudget(spin_time, max_spin_time)
        self._reader = RingReader(segment, rank - 1, self._peers, budget) if rank else None
        self._answers_in = AnswerReader(segment, self._writer.check_workers, spin_time) if self._writer else None
        self._answers_out = (
            AnswerWriter(segment, rank - 1, self._reader.check_head, spin_time) if self._reader else None
        )
        if self._writer is not None and self._answers_in is not None:
            self._writer.while_waiting = self._answers_in.stash
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
        max_spin_time: float = DEFAULT_MAX_SPIN_TIME,
        setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    ) -> Self:
        """Create the ring for ``world_size`` ranks; this process is the head (rank 0).

        Pass [`name`][metrale_model_engine.shm.ShmTransport.name] to the workers.  The segment takes ``ring_bytes`` and
        a few pages of ``/dev/shm``.

        Args:
            world_size: ranks in the group, head included (``1 ..= 64``).
            ring_bytes: bytes of the ring, a multiple of 64 and at least
                ``2 * (chunk_bytes + 64)``: how far the head may run ahead.
            chunk_bytes: payload bytes per record at most, a positive multiple of
                64: longer messages are cut into records of this size, which the
                workers copy out while the head writes the next.
            spin_time: seconds a waiting rank spins at least before it sleeps (``>= 0``).
            max_spin_time: seconds a worker spins at most, when its messages come that
                often (see ``_shm.waiting.SpinBudget``; equal to ``spin_time``, the
                learning is off).
            setup_timeout: seconds a gather waits for every rank (``> 0``).

        Raises:
            TypeError, ValueError: an argument is out of its range (the message
                names it).
            OSError: ``/dev/shm`` lacks the space (the message says how much) or
                cannot be written.
            RuntimeError: this platform cannot run it (see [`shm_supported`][metrale_model_engine.shm.shm_supported]).
        """
        check_int("world_size", world_size, 1, MAX_WORLD_SIZE)
        check_int("chunk_bytes", chunk_bytes, LINE, 1 << 28)
        check_int("ring_bytes", ring_bytes, 2 * (chunk_bytes + LINE), 1 << 30)
        for name, value in (("chunk_bytes", chunk_bytes), ("ring_bytes", ring_bytes)):
            if value % LINE:
                raise ValueError(f"{name} must be a multiple of {LINE}, got {value}")
        spins = _check_options(spin_time, max_spin_time, setup_timeout)
        _require_platform()
        segment = create_segment(Layout(world_size, ring_bytes, chunk_bytes), os.getpid())
        return cls(segment, 0, **spins)

    @classmethod
    def attach(
        cls,
        name: str,
        rank: int,
        *,
        spin_time: float = DEFAULT_SPIN_TIME,
        max_spin_time: float = DEFAULT_MAX_SPIN_TIME,
        setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    ) -> Self:
        """Attach to the ring ``name`` that the head created, as worker ``rank`` (``>= 1``).

        Attach before the head's first gather completes: it removes the name then.

        Raises:
            TypeError, ValueError: a bad argument, ``rank`` outside
                ``1 ..= world_size - 1``, or ``rank`` attached already by a live process.
            FileNotFoundError: no segment of that name (the head has not created it, or removed it).
            TransportCorrupt: the file is not a ring of this library's layout version.
            RuntimeError: this platform cannot run it.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str (the head's ShmTransport.name), got {type(name).__name__} {name!r}")
        check_int("rank", rank, 1, MAX_WORLD_SIZE - 1)
        spins = _check_options(spin_time, max_spin_time, setup_timeout)
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
                raise ValueError(f"rank {rank} of ring {name!r} is attached already, by pid {holder}")
            segment.u32[pid_at] = os.getpid()
        except BaseException:
            segment.close()
            raise
        transport = cls(segment, rank, **spins)
        transport._peers.add(segment.u32[HEAD_PID_AT // 4])
        return transport

    # -- what callers ask -----------------------------------------------------

    @property
    def name(self) -> str:
        """The segment's name, for [`attach`][metrale_model_engine.shm.ShmTransport.attach]."""
        return self._segment.name

    @property
    def closed(self) -> bool:
        """Whether [`close`][metrale_model_engine.shm.ShmTransport.close] ran on this rank."""
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
        a worker marks itself gone (the head's next send raises).  Later sends and
        receives on this rank raise [`TransportClosed`][metrale_model_engine.transport.TransportClosed].  A copy of the
        transport in a forked child changes nothing in the ring when it closes.
        """
        if self._closed:
            return
        self._closed = True
        self._gather.closed = True
        if os.getpid() == self._owner:
            if self._writer is not None:
                self._writer.mark_closed()
            elif self._reader is not None:
                self._reader.leave(GONE_CLOSED)
        self._finalizer()
        self._peers.close()
        self._segment.close()

    # -- EpTransport -----------------------------------------------------------

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: publish one message, the concatenation of ``parts``; see the class for ``timeout``."""
        writer = self._writer
        if writer is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "a worker rank cannot send")
        if self.world_size > 1:
            writer.publish(parts, timeout)

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: the next message, copied out of the ring; valid until the next receive."""
        reader = self._reader
        if reader is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "the head cannot receive")
        try:
            return reader.take(timeout)
        except BaseException:
            if not self._closed:
                reader.leave(GONE_FAILED)  # the head's next send raises for this rank
            raise

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words`` (at most ``GATHER_WORDS`` u32 words, the same count on every rank), by rank.

        Collective: waits for every rank, up to ``timeout`` (default ``setup_timeout``).
        The head's first gather is the moment every worker has attached: it unlinks
        the segment's name then.  A worker whose gather fails removes the name (the
        head may be gone).

        Raises:
            TypeError, ValueError: a word that is not a u32 (the message names ``words[i]``, as
                [`check_u32`][metrale_model_engine.check_u32] words it); ``ValueError`` too for too many
                words, or ranks that sent other counts.
            PeerLost, TransportTimeout, TransportClosed: a rank died, did not answer
                in time, or this transport was closed.
        """
        if self._closed:
            raise TransportClosed("this ShmTransport was closed")
        try:
            everyone = self._gather.gather(words, timeout)
        except (OSError, TimeoutError):
            if self.rank != 0:
                unlink_segment(self.name)  # the head may be gone: nobody else would
            raise
        finally:
            if not self._unlinked and self.rank == 0:  # every worker has attached: nothing can leak from here on
                unlink_segment(self.name)
                self._unlinked = True
        return everyone

    def unanswered(self) -> list[int]:
        """The ranks that have not answered this rank's latest [`gather`][metrale_model_engine.shm.ShmTransport.gather]
        (none once it passed): after a gather that failed, which ranks were missing, those that closed their end
        before answering left out (they left on their own, and are not silent)."""
        return self._gather.unanswered()

    def regroup(self) -> RingRegroup:
        """The channel through which this ring's ranks form a new ring once some are lost (a re-form of the link).

        It shares this ring's segment, which stays mapped until both are closed; see
        [`EpLink`][metrale_model_engine.EpLink]'s re-form and ``_shm.regroup``.
        """
        spin_time, max_spin_time = self._spins

        def make(segment: Segment, timeout: float, members: Sequence[int]) -> ShmTransport:
            spins = {"spin_time": spin_time, "max_spin_time": max_spin_time}
            return ShmTransport(segment, 0, setup_timeout=timeout, members=members, **spins)

        def attach(name: str, rank: int, timeout: float) -> ShmTransport:
            return ShmTransport.attach(
                name, rank, spin_time=spin_time, max_spin_time=max_spin_time, setup_timeout=timeout
            )

        return RingRegroup(self._segment.share(), self.rank, make, attach)

    # -- the way back ----------------------------------------------------------

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: put one answer in this worker's answer ring, at once (see ``_shm.answers``)."""
        if self._answers_out is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "the head does not answer")
        self._answers_out.send(answer, timeout)

    def flush_answers(self, timeout: float | None) -> None:
        """Nothing is held back: every answer is in the ring already."""

    def answers_ready(self) -> bool:
        """Head: one load of the answered line against what was seen last."""
        answers = self._answers_in
        return answers is not None and (answers.u64[ANSWERED_WORD] != answers.seen_word or answers.ready())

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: every answer in every worker's ring, by worker, oldest first."""
        if self._answers_in is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "a worker receives no answers")
        return self._answers_in.poll()

    def gone_workers(self) -> dict[int, str]:
        """Head: the workers that left the ring or died, by rank, each with how; empty while all are there.

        What makes a wait of the head raise [`PeerLost`][metrale_model_engine.transport.PeerLost], told rank by rank, so
        that a head waiting for one worker can tell whether that one is gone.
        """
        if self._writer is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "a worker watches no workers")
        return self._writer.gone_workers()

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head: worker ``rank``'s answers, waiting (bounded; its death detected) for at least one."""
        if self._answers_in is None or self._closed:
            raise TransportClosed("this ShmTransport was closed" if self._closed else "a worker receives no answers")
        return self._answers_in.receive(rank, timeout)


def setup_reason(error: Exception) -> str:
    """What a rank says of its failed setup: the error's text, without ``[Errno N]``."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror if error.filename is None else f"{error.strerror}: {error.filename!r}"
    return str(error)


def _release(name: str, head_pid: int | None) -> None:
    """At close or garbage collection: the head's process unlinks the name if it is still there."""
    if head_pid is not None and os.getpid() == head_pid:
        unlink_segment(name)


class _Options(TypedDict):
    spin_time: float
    max_spin_time: float
    setup_timeout: float


def _check_options(spin_time: object, max_spin_time: object, setup_timeout: object) -> _Options:
    spin = check_seconds("spin_time", spin_time, allow_zero=True)
    max_spin = check_seconds("max_spin_time", max_spin_time, allow_zero=True)
    setup = check_seconds("setup_timeout", setup_timeout)
    assert spin is not None and max_spin is not None and setup is not None  # None is refused
    return {"spin_time": spin, "max_spin_time": max_spin, "setup_timeout": setup}


def _require_platform() -> None:
    if not shm_supported():
        raise RuntimeError(
            f"the shared-memory transport needs Linux on x86-64 or arm64 with /dev/shm; this is "
            f"{os.uname().sysname} on {futex.MACHINE}: use the torch.distributed transport"
        )
