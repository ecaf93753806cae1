"""Rank programs for the shared-memory tests: each runs in a process of ``shm.run_ring``.

Each takes its rank's :class:`ShmTransport` first and writes what it saw with
:func:`rank_results.save`.  Torch-free: these run on every Python version.
"""

from __future__ import annotations

import os
import random
import signal
import time
from array import array
from multiprocessing.connection import Connection

from metrale_model_engine import EpLink, EpSetupError, LinkedEp, ProtocolVersion, run_worker
from metrale_model_engine._core.state import S
from metrale_model_engine._shm import waiting as _waiting
from metrale_model_engine.shm import ShmTransport
from metrale_model_engine.toy import ToyCommand, ToyModel, ToyState, slots_digest

from helpers.faulty_toy import CMD_CHECK, CMD_DIE, FaultyToy
from helpers.rank_results import save, wait_until_dead
from helpers.usage import IdleSampler

SLOTS = 8
GIANT_PROMPT = 1_048_576
PROMPT_LENGTHS = (0, 1, 13, 14, 15, 40, 300, 4_096)


def drive_random(model: ToyModel, slots: list[ToyState | None], commands: int, seed: int) -> None:
    """Head: ``commands`` random toy commands (alloc, prefill, decode, free) over the slots.

    Prompts of every interesting length (empty, inline, just past a frame, longer
    than a ring slot) and, half way, one of 1,048,576 tokens.
    """
    rng = random.Random(seed)
    sent = 0
    while sent < commands:
        free = [s for s, state in enumerate(slots) if state is None]
        live = [s for s, state in enumerate(slots) if state is not None]
        roll = rng.random()
        if free and (not live or roll < 0.1):
            model.alloc(slots, rng.choice(free))
        elif roll < 0.2:
            seq_id = rng.choice(live)
            length = GIANT_PROMPT if sent == commands // 2 else rng.choice(PROMPT_LENGTHS)
            if length == 4_096 and rng.random() < 0.9:
                length = 15  # keep long prompts rare: they cost every rank a Python loop
            model.prefill(slots, seq_id, [rng.randrange(32_000) for _ in range(length)])
        elif roll < 0.25:
            model.free(slots, rng.choice(live))
        else:
            model.decode(slots, rng.choice(live))
        sent += 1
    model.ep_link.shutdown_workers()


def serve_until_error(model: LinkedEp[S], slots: list[S | None], out: str) -> None:
    """Worker: run until shutdown or an error; save the error's type, text and time (``None`` if none)."""
    try:
        run_worker(model, slots)
    except Exception as error:
        save(out, model.ep_link.rank, error_type=type(error).__name__, error=str(error), at=time.time())
        return  # a normal exit: the process must end by itself
    save(out, model.ep_link.rank, error_type=None, at=time.time())


def stall_inside_a_command(model: ToyModel, slots: list[ToyState | None], check: int, stall: float, out: str) -> None:
    """Head: a header whose follow-up word comes ``stall`` seconds late, then two sends; save what they raised."""
    model.alloc(slots, 0)
    model.ep_broadcast_cmd_for_seq(0, check)
    sent_at = time.time()
    time.sleep(stall)
    sends: list[str] = []
    for _ in range(2):
        try:
            model.ep_broadcast_cmd(0)
            sends.append("sent")
        except Exception as error:
            sends.append(f"{type(error).__name__}: {error}")
    save(out, 0, sends=sends, header_sent_at=sent_at)


def note_parent(transport: ShmTransport, out: str) -> None:
    """Every rank saves the pid of its parent process."""
    save(out, transport.rank, parent=os.getppid())


def soak(transport: ShmTransport, commands: int, seed: int, out: str) -> None:
    """Random commands from the head; every rank saves its slot digest."""
    model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SLOTS
    if transport.rank == 0:
        name = transport.name
        drive_random(model, slots, commands, seed)
        save(out, 0, digest=slots_digest(slots), name=name)
    else:
        summary = run_worker(model, slots)
        save(out, transport.rank, digest=slots_digest(slots), summary=summary)


def head_dies(transport: ShmTransport, mid_command: bool, out: str) -> None:
    """The head kills itself while the workers wait: idle, or inside a command (after its header)."""
    model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SLOTS
    if transport.rank == 0:
        model.alloc(slots, 0)
        model.prefill(slots, 0, [1, 2, 3])
        if mid_command:
            model.ep_broadcast_cmd_for_seq(0, ToyCommand.DECODE)  # its token never follows
        time.sleep(0.3)  # long past the spin time: the workers sleep in the kernel
        save(out, 0, died_at=time.time(), name=transport.name)
        os.kill(os.getpid(), signal.SIGKILL)
    serve_until_error(model, slots, out)


def worker_dies(transport: ShmTransport, out: str) -> None:
    """Worker 1 kills itself inside a command; the head keeps sending until a send fails."""
    pids = [words[0] for words in transport.gather([os.getpid()])]
    model = FaultyToy(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=5.0))
    slots: list[ToyState | None] = [None] * SLOTS
    if transport.rank != 0:
        serve_until_error(model, slots, out)
        return
    model.alloc(slots, 0)
    model.ep_broadcast_cmd_for_seq(0, CMD_DIE)
    model.ep_broadcast_cmd(1)
    wait_until_dead(pids[1], timeout=30.0)
    died = time.monotonic()
    sends = 0
    try:
        while time.monotonic() - died < 30.0:
            model.decode(slots, 0)
            sends += 1
    except Exception as error:
        save(out, 0, error_type=type(error).__name__, error=str(error), seconds=time.monotonic() - died, sends=sends)
        return
    save(out, 0, error_type=None, sends=sends)


def head_stalls(transport: ShmTransport, stall: float, out: str) -> None:
    """The head stalls inside a command longer than the workers' command timeout (1 s)."""
    model = FaultyToy(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=1.0))
    slots: list[ToyState | None] = [None] * SLOTS
    if transport.rank != 0:
        serve_until_error(model, slots, out)
    else:
        stall_inside_a_command(model, slots, CMD_CHECK, stall, out)


def wakeups(transport: ShmTransport, gaps_s: list[float], out: str) -> None:
    """Timestamps sent after idle gaps around the spin time; workers record each one's latency.

    The sleep cap is raised to 2 s in every rank, so that a lost wake-up, which
    only the cap would end, shows as a latency of a second or more.  Run it with
    the spin learning off (``max_spin_time=spin_time``): the gaps must reach the
    futex, not a learned spin.
    """
    _waiting.CHECK_INTERVAL = 2.0  # type: ignore[misc]  # deliberately, for this test
    if transport.rank == 0:
        for gap in gaps_s:
            deadline = time.perf_counter() + gap
            while time.perf_counter() < deadline:
                pass  # a busy wait: sleep() granularity is coarser than the gaps
            transport.send((array("Q", [time.perf_counter_ns()]),), 10.0)
        return
    latencies = []
    for _ in gaps_s:
        sent = array("Q", transport.receive(10.0).tobytes())[0]
        latencies.append((time.perf_counter_ns() - sent) / 1e9)
    save(out, transport.rank, latencies=latencies)


def idle_cpu(transport: ShmTransport, idle: float, window: float, out: str) -> None:
    """Worker CPU over ``window`` seconds after ``idle`` seconds without a message, then the wake-up.

    A sampler thread (``usage.IdleSampler``) reads the worker's own CPU time while the
    main thread waits in its receive.
    """
    transport.gather([0])  # both ranks are here: the idle time starts now
    if transport.rank == 0:
        time.sleep(idle + window + 0.2)
        transport.send((array("Q", [time.perf_counter_ns()]),), 10.0)
        return
    sampler = IdleSampler(idle, window)
    sent = array("Q", transport.receive(None).tobytes())[0]
    latency = (time.perf_counter_ns() - sent) / 1e9
    save(out, transport.rank, cpu_fraction=sampler.share(), wake_latency=latency)


def forked_worker(name: str, rank: int, digests: Connection) -> None:
    """A worker started by ``fork``: it attaches by name, serves, and sends its slot digest back."""
    with ShmTransport.attach(name, rank) as transport:
        model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V1))
        slots: list[ToyState | None] = [None] * SLOTS
        run_worker(model, slots)
        digests.send(slots_digest(slots))


def stoppable_worker(name: str, report: Connection) -> None:
    """A worker started by ``fork`` that serves until an error, then reports it and its slot state."""
    with ShmTransport.attach(name, 1) as transport:
        model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=30.0))
        slots: list[ToyState | None] = [None] * SLOTS
        try:
            run_worker(model, slots)
            outcome = "shut down"
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
        report.send((outcome, {s.seq_id: list(s.tokens) for s in slots if s is not None}))


def cadence(transport: ShmTransport, steps: int, gap: float, out: str) -> None:
    """Decode steps a gap apart, as a server sends them, with every worker spinning between them."""
    model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SLOTS
    if transport.rank == 0:
        started = time.monotonic()
        for seq_id in range(SLOTS):
            model.alloc(slots, seq_id)
        for step in range(steps):
            time.sleep(gap)
            model.decode(slots, step % SLOTS)
        model.ep_link.shutdown_workers()
        save(out, 0, digest=slots_digest(slots), seconds=time.monotonic() - started)
    else:
        summary = run_worker(model, slots)
        save(out, transport.rank, digest=slots_digest(slots), summary=summary)


def disagree_on_slots(transport: ShmTransport) -> None:
    """Each rank asks for a different slot count: the link's setup raises ``EpSetupError`` on every rank."""
    EpLink(transport, num_slots=SLOTS + transport.rank)


def refuse_at_length(transport: ShmTransport, length: int) -> None:
    """Rank 0 raises an ``EpSetupError`` of ``length`` characters, more than a pipe's buffer holds."""
    if transport.rank == 0:
        raise EpSetupError("x" * length)
