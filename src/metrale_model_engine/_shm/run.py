"""Running ``world_size`` ranks over one ring in fresh processes (``metrale_model_engine.shm.run_ring``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Final

from typing_extensions import TypeVarTuple, Unpack, deprecated

from .._core.errors import ring_setup_failed
from .._host.launch import SETUP_FAILED, check_launch, launch, rank_context
from .segment import MAX_WORLD_SIZE, remove_stale_segments
from .transport import (
    DEFAULT_SETUP_TIMEOUT,
    RING_SETUP_ERRORS,
    ShmTransport,
    setup_reason,
)
from .waiting import DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME

__all__ = ["run_local", "run_ring"]


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

    A failed setup is raised here, once, rather than printed by the ranks: the
    ring's (``/dev/shm`` too small, say), or one that ``target`` raises as an
    [`EpSetupError`][metrale_model_engine.EpSetupError] (an ``EpLink`` whose ranks
    disagree).  Its ranks exit with code 2 and no traceback.

    Returns:
        Every rank's exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TypeError, ValueError: ``world_size`` is not an int in ``1 ..= 64``, or
            ``timeout`` is neither ``None`` (the default: no limit) nor a positive
            number of seconds.
        EpSetupError: the ring could not be set up (the message gives each failed
            rank's reason), or ``target`` raised one (the lowest rank's).
        TimeoutError: ranks still ran after ``timeout`` seconds; they were killed,
            and the message names them.
    """
    limit = check_launch(world_size, timeout, max_world_size=MAX_WORLD_SIZE)
    spins = (spin_time, max_spin_time)
    context = rank_context()
    pipes = [context.Pipe() for _ in range(world_size - 1)]
    ends: list[list[Connection]] = [[head for head, _ in pipes]] + [[worker] for _, worker in pipes]
    rank_args = [(target, rank, ends[rank], spins, args) for rank in range(world_size)]
    try:
        return launch(context, _local_rank, rank_args, limit, parent_ends=[end for pair in pipes for end in pair])
    finally:  # every rank has ended: a ring one of them made and a kill cut short is no one's now
        remove_stale_segments()


@deprecated("metrale_model_engine.shm.run_local is now run_ring (same arguments); run_local goes in 0.3")
def run_local(
    target: Callable[[ShmTransport, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    timeout: float | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
) -> list[int]:
    """The former name of [`run_ring`][metrale_model_engine.shm.run_ring]."""
    return run_ring(target, world_size, *args, timeout=timeout, spin_time=spin_time)


def _local_rank(
    target: Callable[..., None],
    rank: int,
    ends: list[Connection],
    spins: tuple[float, float],
    args: tuple[object, ...],
) -> None:
    transport = _set_up_head(ends, spins) if rank == 0 else _set_up_worker(rank, ends[0], spins)
    with transport:
        target(transport, *args)


_GONE: Final = "it exited before it attached"


def _set_up_head(workers: list[Connection], spins: tuple[float, float]) -> ShmTransport:
    """Set up the ring with the workers, over one pipe each; raise why if any rank could not.

    Three rounds: the head sends the ring's name (``None`` if it could not create
    one), each worker answers ``None`` once attached (else why not), and the head
    sends every worker its verdict (``True``: go), so that no rank starts its
    target on a ring that another rank lacks.
    """
    ring: ShmTransport | None = None
    reasons: dict[int, str] = {}
    try:
        ring = ShmTransport.create(len(workers) + 1, spin_time=spins[0], max_spin_time=spins[1])
    except RING_SETUP_ERRORS as error:
        reasons[0] = setup_reason(error)
    for rank, worker in enumerate(workers, start=1):
        try:
            worker.send(None if ring is None else ring.name)
        except OSError:
            reasons[rank] = _GONE
    if ring is not None:
        for rank, worker in enumerate(workers, start=1):
            if rank not in reasons:
                reason = _answer(worker)
                if reason is not None:
                    reasons[rank] = reason
    for worker in workers:
        with suppress(OSError):  # a worker that failed has left
            worker.send(not reasons)
        worker.close()
    if reasons:
        if ring is not None:
            ring.close()
        raise ring_setup_failed(reasons)
    assert ring is not None
    return ring


def _answer(worker: Connection) -> str | None:
    """A worker's answer: ``None`` once attached, else why not."""
    try:
        if not worker.poll(DEFAULT_SETUP_TIMEOUT):
            return f"it did not attach within {DEFAULT_SETUP_TIMEOUT:g} s"
        reason = worker.recv()
    except (EOFError, OSError):
        return _GONE
    return None if reason is None else str(reason)


def _set_up_worker(rank: int, head: Connection, spins: tuple[float, float]) -> ShmTransport:
    """Attach to the ring the head names, tell it how that went, and wait for its go.

    Without a ring, or without the head's go, it exits with code 2 and says nothing:
    the head raises why, and its launcher reports it.
    """
    try:
        name = head.recv()
    except EOFError:  # the head died: its own error, or its exit code, tells why
        name = None
    if name is None:
        raise SystemExit(SETUP_FAILED)
    try:
        transport = ShmTransport.attach(name, rank, spin_time=spins[0], max_spin_time=spins[1])
    except RING_SETUP_ERRORS as error:
        with suppress(OSError):
            head.send(setup_reason(error))
        raise SystemExit(SETUP_FAILED) from None
    try:
        head.send(None)
        go = head.recv()
    except (EOFError, OSError):
        go = False
    head.close()
    if go is not True:
        transport.close()
        raise SystemExit(SETUP_FAILED)
    return transport
