"""The protocol over shared memory: one host's ranks exchange messages in microseconds.

:class:`ShmTransport` is an :class:`~metrale_model_engine.EpTransport` over a ring
in a shared-memory segment, one writer (the head) and ``world_size - 1`` readers
(the workers).  The head creates the segment (:meth:`ShmTransport.create`), passes
its :attr:`~ShmTransport.name` to the workers by any means (process arguments, an
environment variable), and each worker attaches by name
(:meth:`ShmTransport.attach`).  Over a torch.distributed group,
``metrale_model_engine.torch.open_transport("shm")`` does that rendezvous, and
``open_transport("auto")`` uses it whenever every rank is on one host.  This module
needs only the standard library and never imports torch.  Linux only (x86-64 and
arm64): it sleeps on futexes and watches peers through pidfds.

How the ring works, memory ordering included, is in ``_ring``'s docstring; how
ranks wait, in ``_waiting``'s.  In short: the head writes each message into
consecutive 64-byte-aligned records and never waits unless the ring is full; each
worker copies messages out and publishes how far it read; a waiting rank spins,
for as long as the gaps between its messages call for, then sleeps on a futex.

Faults
    Every wait checks, at least every :data:`CHECK_INTERVAL`, that its peers are
    alive (pidfds, so a reused pid is never taken for the peer) and that they have
    not left.  A worker whose receive fails marks itself gone before it raises, and
    the head's next send raises for it at once; a worker killed outright is found by
    the head's liveness check, which every send runs at most once per
    :data:`CHECK_INTERVAL`, and which every wait for room runs.  A dead or closed
    head ends a worker's wait once the worker has read everything the head
    published.  A failed send ends the ring for the head: every later send raises at
    once, and each worker raises when it reaches the cut message.

Lifecycle
    The head unlinks the segment's name as soon as every worker has attached (at
    the first :meth:`~ShmTransport.gather`, which ``EpLink`` runs at setup), so no
    crash of any rank after setup can leave a file in ``/dev/shm``; the mappings
    live on until each rank closes.  A segment left by a run that crashed during
    setup is removed by the next :meth:`~ShmTransport.create` on the machine (its
    creator's pid is dead), and never breaks a new run: every name is new.

Errors are plain (see :mod:`metrale_model_engine.transport`): ``PeerLost``,
``TransportTimeout``, ``TransportClosed``, ``TransportCorrupt``; ``EpLink`` maps
them.  Not thread-safe: one thread of each rank uses its transport.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Final

from typing_extensions import Buffer, Self, TypeVarTuple, Unpack, deprecated

from . import _futex
from ._checks import check_int, check_seconds
from ._gather import SetupGather
from ._launch import check_launch, join_all
from ._liveness import ProcessWatch, process_exists
from ._ring import RingReader, RingWriter
from ._segment import (
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
from ._waiting import CHECK_INTERVAL, DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME, SpinBudget
from .transport import TransportClosed

__all__ = [
    "CHECK_INTERVAL",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_SPIN_TIME",
    "DEFAULT_RING_BYTES",
    "DEFAULT_SETUP_TIMEOUT",
    "DEFAULT_SPIN_TIME",
    "MAX_WORLD_SIZE",
    "ShmTransport",
    "run_ring",
    "shm_supported",
]

DEFAULT_RING_BYTES: Final[int] = 1 << 20
"""Bytes of the ring: how far the head may run ahead of the slowest worker (a small message takes 128)."""
DEFAULT_CHUNK_BYTES: Final[int] = 128 * 1024
"""Payload bytes per record at most: a longer message travels as consecutive records.

Measured on a 2-core machine (a 256 KiB message): 16 KiB records cost twice the time of
64-128 KiB ones; each record costs both sides a few microseconds of Python."""
DEFAULT_SETUP_TIMEOUT: Final[float] = 300.0
"""Seconds a gather (the setup exchange) waits for every rank to attach and answer."""


def shm_supported() -> bool:
    """Whether this platform can run the shared-memory transport (Linux on x86-64 or arm64)."""
    return _futex.SUPPORTED and os.path.isdir("/dev/shm")


class ShmTransport:
    """A group of ranks of one host that rank 0 sends messages to through shared memory.

    Build it with :meth:`create` on the head and :meth:`attach` on each worker;
    the constructor is theirs.  Give it to an :class:`~metrale_model_engine.EpLink`,
    whose construction runs the first :meth:`gather` (every rank must take part,
    within ``setup_timeout``).  A send's or receive's ``timeout`` bounds its wait:
    on the head, for room in a full ring; on a worker, for the message.  ``None``
    waits as long as the peers live; ``0`` or less checks once and does not wait.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_finalizer",
        "_gather",
        "_owner",
        "_peers",
        "_reader",
        "_segment",
        "_unlinked",
        "_writer",
        "rank",
        "world_size",
    )

    def __init__(self, segment: Segment, rank: int, *, spin_time: float, max_spin_time: float, setup_timeout: float):
        self._segment = segment
        self.rank: Final = rank
        self.world_size: Final = segment.layout.world_size
        self._owner = os.getpid()
        self._peers = ProcessWatch()
        self._closed = False
        self._unlinked = rank != 0
        self._gather = SetupGather(segment, rank, setup_timeout)
        self._writer = RingWriter(segment, self._peers, spin_time) if rank == 0 else None
        budget = SpinBudget(spin_time, max_spin_time)
        self._reader = RingReader(segment, rank - 1, self._peers, budget) if rank else None
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

        Pass :attr:`name` to the workers.  The segment takes ``ring_bytes`` and a few
        pages of ``/dev/shm``.

        Args:
            world_size: ranks in the group, head included (``1 ..= 64``).
            ring_bytes: bytes of the ring, a multiple of 64 and at least
                ``2 * (chunk_bytes + 64)``: how far the head may run ahead.
            chunk_bytes: payload bytes per record at most, a positive multiple of
                64: longer messages are cut into records of this size, which the
                workers copy out while the head writes the next.
            spin_time, max_spin_time: seconds a waiting rank spins before sleeping:
                at least ``spin_time`` (``>= 0``), and a worker up to
                ``max_spin_time`` when its messages come that often (see
                ``_waiting.SpinBudget``; equal values turn the learning off).
            setup_timeout: seconds a gather waits for every rank (``> 0``).

        Raises:
            TypeError, ValueError: an argument is out of its range (the message
                names it).
            OSError: ``/dev/shm`` lacks the space (the message says how much) or
                cannot be written.
            RuntimeError: this platform cannot run it (see :func:`shm_supported`).
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
        a worker marks itself gone (the head's next send raises).  Later sends and
        receives on this rank raise :class:`TransportClosed`.  A copy of the
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

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        """Every rank's ``words`` (at most 13 u32 words, the same count on every rank), by rank.

        Collective: waits for every rank, up to ``setup_timeout``.  The head's first
        gather is the moment every worker has attached: it unlinks the segment's
        name then.  A worker whose gather fails removes the name (the head may be
        gone).

        Raises:
            ValueError: too many words, not u32 words, or ranks that sent other counts.
            PeerLost, TransportTimeout, TransportClosed: a rank died, did not answer
                in time, or this transport was closed.
        """
        if self._closed:
            raise TransportClosed("this ShmTransport was closed")
        try:
            everyone = self._gather.gather(words)
        except (OSError, TimeoutError):
            if self.rank != 0:
                unlink_segment(self.name)  # the head may be gone: nobody else would
            raise
        finally:
            if not self._unlinked and self.rank == 0:  # every worker has attached: nothing can leak from here on
                unlink_segment(self.name)
                self._unlinked = True
        return everyone


def _release(name: str, head_pid: int | None) -> None:
    """At close or garbage collection: the head's process unlinks the name if it is still there."""
    if head_pid is not None and os.getpid() == head_pid:
        unlink_segment(name)


def _check_options(spin_time: object, max_spin_time: object, setup_timeout: object) -> dict[str, float]:
    spins = {
        "spin_time": check_seconds("spin_time", spin_time, allow_zero=True),
        "max_spin_time": check_seconds("max_spin_time", max_spin_time, allow_zero=True),
        "setup_timeout": check_seconds("setup_timeout", setup_timeout),
    }
    return {name: value for name, value in spins.items() if value is not None}


def _require_platform() -> None:
    if not shm_supported():
        raise RuntimeError(
            f"the shared-memory transport needs Linux on x86-64 or arm64 with /dev/shm; this is "
            f"{os.uname().sysname} on {_futex.MACHINE}: use the torch.distributed transport"
        )


Ts = TypeVarTuple("Ts")


def run_ring(
    target: Callable[[ShmTransport, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    timeout: float | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
    max_spin_time: float = DEFAULT_MAX_SPIN_TIME,
) -> list[int]:
    """Run ``target(transport, *args)`` in ``world_size`` fresh processes that share one ring.

    Rank 0 creates the ring and hands its name to the others through pipes; each
    rank's ``transport.rank`` says which it is, and its transport is closed when
    ``target`` returns.  No torch needed.  ``target`` and ``args`` must be
    picklable (the ``spawn`` start method).  ``spin_time`` and ``max_spin_time`` go
    to every rank's transport.  (``metrale_model_engine.torch.run_group``
    is its counterpart over a process group: its target gets ``(rank, world_size, *args)``.)

    Returns:
        Every rank's exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TypeError, ValueError: ``world_size`` is not an int in ``1 ..= 64``, or
            ``timeout`` is neither ``None`` (the default: no limit) nor a positive
            number of seconds.
        TimeoutError: ranks still ran after ``timeout`` seconds; they were killed,
            and the message names them.
    """
    limit = check_launch(world_size, timeout, max_world_size=MAX_WORLD_SIZE)
    spins = (spin_time, max_spin_time)
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(world_size - 1)]
    names: list[list[Connection]] = [[send for _, send in pipes]] + [[receive] for receive, _ in pipes]
    processes = [
        context.Process(target=_local_rank, args=(target, rank, world_size, names[rank], spins, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for receive, send in pipes:  # the ranks hold their own ends: a dead head closes the workers' pipes
        receive.close()
        send.close()
    return join_all(processes, limit)


@deprecated("metrale_model_engine.shm.run_local is now run_ring (same arguments); run_local goes in 0.3")
def run_local(
    target: Callable[[ShmTransport, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    timeout: float | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
) -> list[int]:
    """The former name of :func:`run_ring`."""
    return run_ring(target, world_size, *args, timeout=timeout, spin_time=spin_time)


def _local_rank(
    target: Callable[..., None],
    rank: int,
    world_size: int,
    names: list[Connection],
    spins: tuple[float, float],
    args: tuple[object, ...],
) -> None:
    spin_time, max_spin_time = spins
    if rank == 0:
        transport = ShmTransport.create(world_size, spin_time=spin_time, max_spin_time=max_spin_time)
        for pipe in names:
            pipe.send(transport.name)
            pipe.close()
    else:
        (pipe,) = names
        try:
            name = pipe.recv()
        except EOFError:
            raise SystemExit(f"rank {rank}: the head exited before it sent the ring's name (see its error)") from None
        transport = ShmTransport.attach(name, rank, spin_time=spin_time, max_spin_time=max_spin_time)
    with transport:
        target(transport, *args)
