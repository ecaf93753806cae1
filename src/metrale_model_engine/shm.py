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
from collections.abc import Callable
from multiprocessing.connection import Connection

from typing_extensions import TypeVarTuple, Unpack, deprecated

from ._launch import check_launch, join_all
from ._segment import MAX_WORLD_SIZE
from ._shm_transport import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_RING_BYTES,
    DEFAULT_SETUP_TIMEOUT,
    ShmTransport,
    shm_supported,
)
from ._waiting import CHECK_INTERVAL, DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME

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

ShmTransport.__module__ = __name__

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
