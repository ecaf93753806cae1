"""Running one function in N fresh processes: the local launchers' common part.

A rank whose setup fails (an [`EpSetupError`][metrale_model_engine.EpSetupError] out of its
function) prints no traceback: it sends the error's text to the launcher and exits
with ``SETUP_FAILED``, and the launcher raises the lowest such rank's error
once every rank has ended.  Every rank of a failed setup raises, most with the same
text, so a program that catches it in the launching process reports it once.

Ctrl-C: a rank interrupted (``KeyboardInterrupt``) exits with ``INTERRUPTED``,
without a traceback.  A rank starts with SIGINT blocked, until its function runs
(or, with ``interrupts_from_rank``, until the function calls
``accept_interrupts``: past its group's rendezvous, which an interrupted system
call would make log a warning), so that an interrupt while it starts prints
nothing and interrupts it only then.  (The launcher blocks it for the few
milliseconds of each start, so that the rank inherits that, and raises an interrupt
of those moments once the rank has started: none is lost.  The block is each
thread's own: a thread a rank starts before then keeps SIGINT blocked, and so does
a program it runs.)  A launcher
interrupted while it waits (or failing there in any way) ends every rank before it
raises: it passes the interrupt to the ranks still running, kills at once those
still starting, waits up to ``INTERRUPT_GRACE`` seconds for the others to leave
(closing what they hold), kills the rest; a second Ctrl-C meanwhile is ignored.  So
the launcher returns or raises only once every rank process it started has ended.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Final, Literal, TypeAlias

from .._core.checks import check_int, check_seconds
from .._core.errors import EpSetupError

SETUP_FAILED: Final = 2
"""A rank's exit code when its setup failed; its launcher raises the error."""
INTERRUPTED: Final = 130
"""A rank's exit code when it was interrupted (Ctrl-C, SIGINT): 128 + 2, as shells report it."""
INTERRUPT_GRACE: Final = 0.5
"""Seconds an interrupted launcher waits for its ranks to leave before it kills them: a rank that holds what
outlives it is left nothing the launcher's caller cannot clean (``/dev/shm``'s rings, by their creator's pid)."""


class _RankStart:
    """How rank processes start: ``spawn`` (the default), from a start server, or as forks of their launcher."""

    method: Literal["spawn", "forkserver", "fork"] = "spawn"
    preload: tuple[str, ...] = ()
    """What the start server imports."""


_START: Final = _RankStart()
_FROZEN_HEAP: Final = f"{__package__}.frozen_heap"
"""The start server's last import: it freezes what the server imported out of its garbage collector."""

RankContext: TypeAlias = "SpawnContext | ForkServerContext | ForkContext"
"""The start methods of rank processes (``rank_context``)."""


def start_ranks_from_a_server(preload: Sequence[str]) -> None:
    """From now on, start rank processes as forks of one server process that imported ``preload`` once.

    Each rank then starts in milliseconds instead of importing torch anew (about a
    second), with what the server imported frozen out of its garbage collector
    (``gc.freeze``, before its first fork): shared with the server, never collected
    in the rank, whose collections then copy none of its pages, not even while it
    imports its target's module.  The test suite does this.  A rank
    still gets the launcher's environment as it is at the start, as a spawned one
    does, and holds Ctrl-C back until it reaches its function, as a spawned one does
    (it inherits the server's signal mask, which the server took from the launch that
    started it).  What differs from the default (``spawn``): the server, not the
    launcher, is a rank's parent, so its siblings cannot tell how it ended.  Call it
    before the first launch of the process.
    """
    _START.method, _START.preload = "forkserver", tuple(preload)


def start_ranks_as_forks() -> None:
    """From now on, start rank processes as forks of the launching process (``fork``).

    For a launcher that imported what its ranks need and runs no other thread at
    the launch (forking copies only the calling thread, and none of the locks other
    threads hold): the test suite runs its programs so, each forked from a process
    that imported torch once.  A rank then starts in milliseconds, the launcher its
    parent as with ``spawn``, with the default action of every signal the launcher
    handled in Python and none of the other ranks' pipes; it ends without running
    the exit hooks (``atexit``) that it inherited from the launcher.
    """
    _START.method, _START.preload = "fork", ()


def rank_context() -> RankContext:
    """The start method of rank processes: ``spawn``, or what ``start_ranks_from_a_server`` or
    ``start_ranks_as_forks`` asked for."""
    if _START.method == "fork":
        return multiprocessing.get_context("fork")
    if _START.method == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*_START.preload, _FROZEN_HEAP])
    return context


def stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker, which every ``spawn`` start runs and which outlives its program.

    For a program's last step, once the ranks it launched have ended (the demo):
    after it, no process the program started is left, not even for the moment the
    tracker takes to see its program gone.  Nothing under the start server of
    ``start_ranks_from_a_server`` (it holds the tracker too), nor where Python
    lacks the tracker's ``_stop``.
    """
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if _START.method == "forkserver" or getattr(tracker, "_pid", None) is None:  # none started by this process
        return
    stop = getattr(tracker, "_stop", None)
    if callable(stop):
        stop()


def check_launch(world_size: object, timeout: object, *, max_world_size: int | None = None) -> float | None:
    """Check a launcher's arguments; return the timeout in seconds (``None``: none).

    Raises:
        TypeError, ValueError: ``world_size`` is not an int in ``1 ..= max_world_size``,
            or ``timeout`` is neither ``None`` nor a positive number of seconds.
    """
    check_int("world_size", world_size, 1, max_world_size)
    return check_seconds("timeout", timeout, allow_none=True)


def launch(
    context: RankContext,
    rank_main: Callable[..., None],
    rank_args: Sequence[tuple[object, ...]],
    timeout: float | None,
    *,
    parent_ends: Sequence[Connection] = (),
    interrupts_from_rank: bool = False,
) -> list[int]:
    """Run ``rank_main(*rank_args[rank])`` in one process per rank; wait for all of them.

    ``parent_ends`` are this process's copies of connections the ranks hold: they
    are closed once every rank has started, so that a rank's death closes its
    peers' ends.  ``interrupts_from_rank``: ``rank_main`` calls
    ``accept_interrupts`` itself, once its start-up is over.  Whatever happens,
    every rank process has ended when it returns or raises.

    Returns:
        Every exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        EpSetupError: a rank's setup failed: the lowest such rank's error.
        TimeoutError: see ``join_all``.
    """
    reports = [context.Pipe(duplex=False) for _ in rank_args]
    forked = not isinstance(context, SpawnContext)
    every_end = [*parent_ends, *(end for pair in reports for end in pair)]
    processes = [
        context.Process(
            target=_run_rank,
            args=(
                rank_main,
                args,
                send,
                dict(os.environ),
                interrupts_from_rank,
                forked,
                _siblings_ends(context, every_end, args, send),
            ),
        )
        for args, (_, send) in zip(rank_args, reports, strict=True)
    ]
    try:
        try:
            if not isinstance(context, ForkContext):  # a spawn or the start server's first start runs the tracker,
                resource_tracker.ensure_running()  # whose own first start unblocks SIGINT: here, not inside the hold
            for process in processes:
                with _interrupts_held():
                    process.start()
        except BaseException:  # Ctrl-C, or out of processes or descriptors: end the ranks that started
            _kill_started(processes)
            raise
        finally:
            for connection in [*parent_ends, *(send for _, send in reports)]:
                connection.close()
        try:
            codes = join_all(processes, timeout)
        except BaseException:  # Ctrl-C, or anything else: no rank outlives the launcher
            _interrupt_all(processes)
            raise
        failures = [text for receive, _ in reports if (text := _report(receive)) is not None]
    finally:
        for receive, _ in reports:
            receive.close()
    if failures:
        raise EpSetupError(failures[0])
    return codes


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT held back while a rank process starts, then taken as if it had come just after.

    The calling thread blocks SIGINT, so that the rank inherits it blocked (across
    ``exec`` too); meanwhile an interrupt that another thread of the launcher takes
    (OpenBLAS's, say) is only noted, so that none raises between the start and the
    moment the launcher records the process.  One noted or left pending is raised
    again once the block ends, under the handler the launcher had; where the start
    raised instead, as ``KeyboardInterrupt`` from its error.  The mask and the handler
    are put back on every path.
    """
    noted: list[int] = []
    holding = True
    handler = signal.getsignal(signal.SIGINT)

    def note(signum: int, frame: FrameType | None) -> None:
        if holding:
            noted.append(signum)
        elif callable(handler):  # left installed by an error in the restore below: the launcher's own handler
            handler(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the mask as it is
        try:
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                yield
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one pending is noted here
        except BaseException as error:
            if noted and not isinstance(error, KeyboardInterrupt):
                raise KeyboardInterrupt from error
            raise
    finally:
        holding = False
        signal.signal(signal.SIGINT, handler)
    if noted:
        signal.raise_signal(signal.SIGINT)


def _kill_started(processes: Sequence[BaseProcess]) -> None:
    """Kill the rank processes that started, then wait for them, a second Ctrl-C ignored (one that started holds
    SIGINT back, so the terminal's Ctrl-C could not end a rank left behind)."""
    with _interrupts_ignored():
        started = [process for process in processes if process.pid is not None]
        for process in started:
            process.kill()
        for process in started:
            process.join()


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile, then the launcher's handler back: a second Ctrl-C while the launcher ends its
    ranks must not leave one behind."""
    interrupts = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, interrupts)


def _siblings_ends(
    context: RankContext, every_end: Sequence[Connection], args: tuple[object, ...], send: Connection
) -> list[Connection]:
    """What a rank forked from its launcher (``fork``) inherits of the others' connections, to close first: a
    rank's death then closes its peers' ends, as it does when each rank gets only its own (``spawn``)."""
    if not isinstance(context, ForkContext):
        return []
    own = {id(send)}
    for arg in args:
        own.update(id(item) for item in (arg if isinstance(arg, (list, tuple)) else [arg]))
    return [end for end in every_end if id(end) not in own]


def join_all(processes: Sequence[BaseProcess], timeout: float | None) -> list[int]:
    """Wait for every started process; with a ``timeout``, kill those still running after it and raise.

    Returns:
        Every exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TimeoutError: ranks still ran ``timeout`` seconds after the start; they were
            killed, and the message names them, the timeout and every exit code.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for process in processes:
        process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in stuck:
        processes[rank].kill()
        processes[rank].join()
    codes = [process.exitcode if process.exitcode is not None else -9 for process in processes]
    if stuck:
        raise TimeoutError(
            f"rank(s) {stuck} still ran {timeout} s after the start and were killed (exit codes by rank: {codes}); "
            "pass a larger timeout, or timeout=None to wait as long as they run"
        )
    return codes


_REPORT_CHARS: Final = 16_384
"""The most of a setup failure's text a rank sends: it must fit the pipe's buffer, read only after the join."""


def _interrupt_all(processes: Sequence[BaseProcess]) -> None:
    """Interrupt the ranks still running, give them ``INTERRUPT_GRACE`` seconds to leave, kill the rest.

    A second Ctrl-C meanwhile is ignored: it must not leave a rank behind.
    """
    with _interrupts_ignored():
        _end_all(processes)


def _end_all(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if process.pid is not None and process.is_alive():
            if _still_starting(process.pid):  # SIGINT still held back: it holds nothing yet
                process.kill()
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGINT)  # a no-op for those the terminal interrupted already
    deadline = time.monotonic() + INTERRUPT_GRACE
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _still_starting(pid: int) -> bool:
    """Whether rank process ``pid`` still blocks SIGINT (it has not reached its function); Linux only.

    Not whether it ignores SIGINT: a rank interrupted once ignores the next ones while it leaves, and gets its grace.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    blocked = next((line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), "0")
    return bool(int(blocked, 16) & (1 << (signal.SIGINT - 1)))


def accept_interrupts() -> None:
    """In a rank whose launch said ``interrupts_from_rank``: from now on Ctrl-C interrupts it (see the module); one
    that came while it started interrupts it here."""
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupt_once(signum: int, frame: object) -> None:
    """A rank's SIGINT handler: ``KeyboardInterrupt`` the first time; later ones (the terminal's and the
    launcher's both arrive) are ignored, so that the rank's cleanup on the way out runs to its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _run_rank(
    rank_main: Callable[..., None],
    args: tuple[object, ...],
    report: Connection,
    environ: dict[str, str],
    interrupts_from_rank: bool,
    forked: bool,
    siblings_ends: Sequence[Connection],
) -> None:
    if forked:  # a fork (of the start server, or of the launcher): begin as a spawned rank does
        gc.freeze()  # the imports, shared: a collection here would copy their pages
        os.environ.clear()
        os.environ.update(environ)
        for end in siblings_ends:
            end.close()
        _default_signal_handlers()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a spawned rank's, still blocked: not the hold's
    try:
        if not interrupts_from_rank:
            accept_interrupts()  # held back while the rank started
        rank_main(*args)
    except EpSetupError as error:
        report.send(str(error)[:_REPORT_CHARS])
        raise SystemExit(SETUP_FAILED) from None
    except KeyboardInterrupt:  # Ctrl-C: the launcher says so, once; no traceback from every rank
        raise SystemExit(INTERRUPTED) from None
    finally:
        report.close()


def _default_signal_handlers() -> None:
    """Put back the default action of every signal the launcher handles in Python (a fresh interpreter's), and no
    wake-up descriptor; a signal it ignores stays ignored, as across a spawn.  SIGINT is the rank's own to set."""
    signal.set_wakeup_fd(-1)
    for number in signal.valid_signals():
        if number != signal.SIGINT and callable(signal.getsignal(number)):
            signal.signal(number, signal.SIG_DFL)


def _report(receive: Connection) -> str | None:
    """The setup failure a rank sent, if it sent one."""
    try:
        text = receive.recv() if receive.poll() else None
    except (EOFError, OSError):  # the rank ended without a word, or died mid-send
        text = None
    return text if isinstance(text, str) else None
