"""The local launcher's Ctrl-C while ranks start (``_host.launch``): none is lost, none raises mid-start, no rank is
left behind."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import ClassVar

import pytest

from metrale_model_engine._host.launch import _interrupts_held, _still_starting, accept_interrupts, launch


def held(path: Path | str) -> None:
    """A rank's function: save whether SIGINT is blocked and Python's own handler is set, then whether it is
    blocked once ``accept_interrupts`` ran."""
    before = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    accept_interrupts()
    after = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    Path(path).write_text(f"{before} {default} {after}")


def test_an_interrupt_noted_while_a_rank_starts_is_raised_once_its_start_is_over() -> None:
    handler = signal.getsignal(signal.SIGINT)
    reached = False
    with pytest.raises(KeyboardInterrupt), _interrupts_held():
        signal.raise_signal(signal.SIGINT)  # to this thread, which blocks it: pending
        reached = True
    assert reached
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_interrupt_another_thread_takes_while_a_rank_starts_is_raised_once_its_start_is_over() -> None:
    go = threading.Event()

    def take() -> None:
        go.wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # its handler runs in the main thread

    sender = threading.Thread(target=take)
    sender.start()  # before the hold, so it does not block SIGINT: as OpenBLAS's threads, started at import
    reached = False
    with pytest.raises(KeyboardInterrupt), _interrupts_held():
        go.set()
        sender.join()
        reached = True  # the handler ran here, at the latest as the block ends: it only noted it
    assert reached


def test_without_an_interrupt_a_rank_start_raises_nothing_and_puts_everything_back() -> None:
    handler = signal.getsignal(signal.SIGINT)
    with _interrupts_held():
        pass
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_start_that_fails_after_an_interrupt_raises_the_interrupt_from_its_error() -> None:
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as raised, _interrupts_held():
        signal.raise_signal(signal.SIGINT)
        raise OSError(errno.EAGAIN, "no more processes")
    assert isinstance(raised.value.__cause__, OSError)
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGINT) is handler


class _InterruptedStart(SpawnProcess):
    """A rank process interrupted in the moment of its start, as a Ctrl-C then would be (and a second Ctrl-C
    with it, once the first one's cleanup kills what started)."""

    made: ClassVar[list[_InterruptedStart]] = []

    def __init__(self, *, target: Callable[..., object], args: tuple[object, ...]) -> None:
        super().__init__(target=target, args=args)  # as the launcher makes its processes
        _InterruptedStart.made.append(self)

    def start(self) -> None:
        signal.raise_signal(signal.SIGINT)  # to the launching thread: a process-wide one may reach it later
        super().start()

    def kill(self) -> None:
        signal.raise_signal(signal.SIGINT)  # the second Ctrl-C: ignored, every started rank still killed
        super().kill()


class _InterruptedStarts(SpawnContext):
    Process = _InterruptedStart


def test_a_ctrl_c_while_the_first_rank_starts_ends_it_and_starts_no_other() -> None:
    _InterruptedStart.made.clear()
    with pytest.raises(KeyboardInterrupt):
        launch(_InterruptedStarts(), time.sleep, [(20.0,), (20.0,)], 30.0)  # ended by a kill, or 20 s later
    first, second = _InterruptedStart.made
    assert first.pid is not None and first.exitcode == -signal.SIGKILL
    assert second.pid is None


FIRST_LAUNCH = """
import multiprocessing, sys
from metrale_model_engine._host.launch import launch, start_ranks_as_forks, start_ranks_from_a_server, rank_context
from in_process.test_launch import held

if sys.argv[2] == "fork":
    start_ranks_as_forks()
elif sys.argv[2] == "forkserver":
    start_ranks_from_a_server(["metrale_model_engine._host.launch"])
print(launch(rank_context(), held, [(sys.argv[1],)], 60.0, interrupts_from_rank=True))
"""


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_rank_starts_with_sigint_held_back_until_it_accepts_interrupts(method: str, tmp_path: Path) -> None:
    """In a fresh interpreter: its first launch starts multiprocessing's resource tracker (and the start server),
    whose first start unblocks SIGINT."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", FIRST_LAUNCH, str(tmp_path / "0"), method]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (0, "[0]\n"), result.stderr
    assert (tmp_path / "0").read_text() == "True True False"


@pytest.mark.parametrize(
    ("setup", "starting"),
    [
        ("signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})", True),  # as a rank before its function
        ("signal.signal(signal.SIGINT, signal.SIG_IGN)", False),  # a rank leaving after a first interrupt
    ],
)
def test_a_rank_is_still_starting_while_it_blocks_sigint_not_while_it_ignores_it(setup: str, starting: bool) -> None:
    code = f"import signal, sys\n{setup}\nprint('ready', flush=True)\nsys.stdin.read()"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        assert _still_starting(process.pid) is starting
    finally:
        process.kill()
        process.communicate()
