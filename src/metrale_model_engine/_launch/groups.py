"""Process groups for scripts and tests: set one up (loopback or torchrun), run N ranks, leave cleanly."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch
import torch.distributed as dist
from typing_extensions import TypeVarTuple, Unpack, deprecated

from .._host.launch import accept_interrupts, check_launch, launch, rank_context
from .._shm.segment import remove_stale_segments
from .._torch.severing import tcp_table
from .._torch.transport import OPEN_TRANSPORTS

DEFAULT_IDLE_TIMEOUT: Final[datetime.timedelta] = datetime.timedelta(days=7)
"""Group timeout ``init_local_group`` sets: how long an idle worker waits for a header over gloo."""


RENDEZVOUS_WAIT: Final = 5.0
"""Seconds a rank other than 0 waits at most for rank 0's store to listen before it connects to it."""

LOWEST_CHOSEN_PORT: Final = 20_000
"""The lowest port ``free_port`` picks below the kernel's ephemeral range."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a local group's rendezvous.

    Picked at random from ``LOWEST_CHOSEN_PORT`` up to the kernel's ephemeral range (Linux's
    ``net.ipv4.ip_local_port_range``, 32,768 by default), not by ``bind(0)``: a port of that range
    can be taken by any outgoing connection between this probe and rank 0's listen (seen on a
    machine busy with other groups' connections: rank 0 failed with ``EADDRINUSE``).  Without that
    file, or with no free port found there in 64 tries, the kernel's choice.
    """
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = LOWEST_CHOSEN_PORT
    for port in random.sample(range(LOWEST_CHOSEN_PORT, ephemeral), min(64, max(ephemeral - LOWEST_CHOSEN_PORT, 0))):
        if _free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        chosen: int = probe.getsockname()[1]
        return chosen


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cuda_available() -> bool:
    """Whether this process sees at least one CUDA device."""
    return torch.cuda.device_count() > 0


def default_backend(local_ranks: int) -> str:
    """NCCL when this machine has a CUDA device for each of its ``local_ranks``, else gloo."""
    return "nccl" if torch.cuda.device_count() >= local_ranks else "gloo"


def init_local_group(
    rank: int,
    world_size: int,
    *,
    port: int,
    backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_IDLE_TIMEOUT,
) -> None:
    """Initialise this process as ``rank`` of a ``world_size``-rank group on loopback.

    ``backend`` defaults to NCCL when there is a CUDA device per rank and gloo
    otherwise; under NCCL the process uses CUDA device ``rank % device_count``.
    ``timeout`` is the group timeout, which bounds an idle worker's wait for the
    next header over gloo.  A rank other than 0 first waits until rank 0's store
    listens (``await_listener``), so the group forms as soon as every rank is there.

    Raises:
        ValueError: ``rank`` is not in ``0 ..= world_size - 1``.
        RuntimeError: ``backend="nccl"`` on a machine without CUDA devices.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size} (0 ..= {world_size - 1})")
    if rank != 0:
        await_listener(port)
    _init_group(backend, rank, world_size, timeout, f"tcp://127.0.0.1:{port}", rank, world_size)


def init_group_from_env(*, backend: str | None = None, timeout: datetime.timedelta = DEFAULT_IDLE_TIMEOUT) -> None:
    """Initialise the default group from torchrun's variables (``env://``).

    The same backend and device choice as [`init_local_group`][metrale_model_engine.torch.init_local_group], per node:
    ``LOCAL_RANK`` picks the CUDA device, ``LOCAL_WORLD_SIZE`` (else
    ``WORLD_SIZE``) the default backend.  Outside torchrun's agent, with ``MASTER_ADDR``
    a loopback address or ``localhost``, a rank other than 0 first waits until rank 0's
    store listens on ``MASTER_PORT`` (``await_listener``).

    Raises:
        RuntimeError: ``backend="nccl"`` on a machine without CUDA devices.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun's agent listens before any rank starts
        with contextlib.suppress(KeyError, ValueError):
            if int(os.environ["RANK"]) != 0 and _on_loopback(os.environ["MASTER_ADDR"]):
                await_listener(int(os.environ["MASTER_PORT"]))
    _init_group(backend, local_rank, local_ranks, timeout, None, -1, -1)


def await_listener(port: int, limit: float = RENDEZVOUS_WAIT) -> bool:
    """Wait until a socket of this network namespace listens on TCP ``port``, ``limit`` seconds at most; whether one
    did.

    What a rank other than 0 on rank 0's host does before it connects to the store rank 0
    starts: a store client that comes first is refused and tries again only after
    torch's backoff, a random 0.3-0.7 s, so the whole group would start that much later
    (35 of 209 group starts in a test run on a busy 2-core machine; 2-6 in 100 on an idle
    one).  The kernel's table of sockets is read every 2 ms, never a connection made to
    ask: rank 0's store looks up the name of each peer that connects, and one more
    connection a client is one more query that a resolver may drop (a second's wait for
    every rank).  Without that table (``/proc``), or past ``limit``, torch's own connect
    goes on, with its retries, its timeout and its error.
    """
    deadline = time.monotonic() + limit
    while not _listening(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


_LISTEN: Final = "0A"
"""A listening socket's state in ``/proc/net/tcp``."""


def _listening(port: int) -> bool:
    """Whether a socket of this network namespace listens on TCP ``port`` (IPv4 or IPv6); ``True`` where the kernel's
    tables cannot be read, so that nobody waits for what cannot be seen."""
    rows = tcp_table()
    local = f":{port:04X}"
    return rows is None or any(fields[1].endswith(local) and fields[3] == _LISTEN for _, fields in rows)


def _on_loopback(address: str) -> bool:
    """Whether ``address`` (``MASTER_ADDR``) names this machine's loopback, without asking a resolver: only there
    does this rank see rank 0's listening socket (another host's, or a name, is left to torch's connect)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _init_group(
    backend: str | None,
    local_rank: int,
    local_ranks: int,
    timeout: datetime.timedelta,
    init_method: str | None,
    rank: int,
    world_size: int,
) -> None:
    if backend is None:
        backend = default_backend(local_ranks)
    device_id = None
    if backend == "nccl":
        devices = torch.cuda.device_count()
        if devices == 0:
            raise RuntimeError(
                "backend 'nccl' needs a CUDA device, and this machine has none "
                "(torch.cuda.device_count() == 0); use backend 'gloo'"
            )
        torch.cuda.set_device(local_rank % devices)
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


Ts = TypeVarTuple("Ts")


def run_group(
    target: Callable[[int, int, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    backend: str | None = None,
    timeout: float | None = None,
) -> list[int]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` fresh processes that form one group.

    Each process joins a local group ([`init_local_group`][metrale_model_engine.torch.init_local_group]) first and
    leaves it after, unless ``target`` left it itself (``torch.distributed.destroy_process_group()``
    is fine there too).  ``target`` and ``args`` must be picklable (the ``spawn``
    start method).
    (``metrale_model_engine.shm.run_ring`` is its counterpart without torch: its
    target gets ``(transport, *args)``.)

    Every rank process has ended when it returns or raises, whatever happened
    (Ctrl-C included: see ``INTERRUPT_GRACE``), and no ring a rank made is left in
    ``/dev/shm``.  A failed setup is raised here, once, rather than printed by the ranks: an
    [`EpSetupError`][metrale_model_engine.EpSetupError] out of ``target`` (``open_link``'s,
    when ``/dev/shm`` is too small for ``"shm"`` or the ranks disagree) makes its
    rank exit with code 2 and no traceback.

    Returns:
        Every rank's exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TypeError, ValueError: ``world_size`` is not an int ``>= 1``, or ``timeout``
            is neither ``None`` (the default: no limit) nor a positive number of seconds.
        EpSetupError: ``target`` raised one on some rank: the lowest such rank's.
        TimeoutError: ranks still ran after ``timeout`` seconds; they were killed,
            and the message names them.
    """
    limit = check_launch(world_size, timeout)
    context = rank_context()
    port = free_port()
    rank_args = [(target, rank, world_size, port, backend, args) for rank in range(world_size)]
    try:
        return launch(context, _local_rank_main, rank_args, limit, interrupts_from_rank=True)
    finally:  # every rank has ended: a ring one of them made and a kill cut short is no one's now
        remove_stale_segments()


def _local_rank_main(
    target: Callable[..., None],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: tuple[object, ...],
) -> None:
    init_local_group(rank, world_size, port=port, backend=backend)
    accept_interrupts()  # past the rendezvous: an interrupted connect would log a warning with a C++ stack
    try:
        target(rank, world_size, *args)
    finally:
        # The target may have left the group itself, as the README advises ('A worker uses run_worker').
        if dist.is_initialized():
            dist.destroy_process_group()


@atexit.register
def _release_at_exit() -> None:
    """Make a rank's exit clean even when its program never tore the group down.

    A gloo process group destroyed during interpreter teardown, after the modules
    it needs are half gone, aborts the process in about half of the exits
    ("terminate called without an active exception"); that happens whenever a
    Python reference to it (ours, in a live link) outlives
    ``destroy_process_group``.  At exit, before teardown, this drops the references
    of every open transport and destroys the default group if the program did not.
    """
    for transport in list(OPEN_TRANSPORTS):
        transport.close()
    if dist.is_initialized():
        dist.destroy_process_group()


@deprecated("metrale_model_engine.torch.run_local is now run_group (same arguments); run_local goes in 0.3")
def run_local(
    target: Callable[[int, int, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    backend: str | None = None,
    timeout: float | None = None,
) -> list[int]:
    """The former name of [`run_group`][metrale_model_engine.torch.run_group]."""
    return run_group(target, world_size, *args, backend=backend, timeout=timeout)
