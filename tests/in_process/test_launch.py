"""The local launcher's Ctrl-C while ranks start (``_host.launch``): none is lost, none raises mid-start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path

import pytest

from metrale_model_engine._host.launch import _interrupts_held, _still_starting, accept_interrupts, launch


def held(path: Path | str) -> None:
    """A rank's function: save whether SIGINT is blocked now, then once ``accept_interrupts`` ran."""
    before = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    accept_interrupts()
    after = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    Path(path).write_text(f"{before} {after}")


def test_an_interrupt_noted_while_a_rank_starts_is_raised_once_its_start_is_over() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt), _interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)  # pending: this thread blocks it
        reached = True
    assert reached
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_another_thread_takes_while_a_rank_starts_is_raised_once_its_start_is_over() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt), _interrupts_held():
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
        sender.start()  # the kernel hands it to the one thread that does not block it
        sender.join()
        time.sleep(0.01)  # the handler runs here, in this thread: it only notes it
        reached = True
    assert reached


def test_without_an_interrupt_a_rank_start_raises_nothing() -> None:
    with _interrupts_held():
        pass
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class _InterruptedStart(SpawnProcess):
    """A rank process whose start is interrupted, as a Ctrl-C in the moment of its ``fork`` would."""

    def start(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        super().start()


class _InterruptedStarts(SpawnContext):
    Process = _InterruptedStart


def test_a_ctrl_c_while_the_first_rank_starts_ends_the_launch_with_every_rank_ended() -> None:
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(_InterruptedStarts(), time.sleep, [(30.0,), (30.0,)], None)
    assert time.monotonic() - started < 10.0  # the rank that started was ended, not waited for


FIRST_LAUNCH = """
import sys
from multiprocessing.context import SpawnContext
from metrale_model_engine._host.launch import launch
from in_process.test_launch import held

print(launch(SpawnContext(), held, [(sys.argv[1],)], None, interrupts_from_rank=True))
"""


def test_a_rank_starts_with_sigint_held_back_until_it_accepts_interrupts(tmp_path: Path) -> None:
    """In a fresh interpreter: its first launch starts multiprocessing's resource tracker, which unblocks SIGINT."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", FIRST_LAUNCH, str(tmp_path / "0")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[0]\n", "")
    assert (tmp_path / "0").read_text() == "True False"


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
