"""How the head names a worker it lost: how the process ended, and the witnesses told apart from the cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from metrale_model_engine import ProtocolVersion, WorkerFailure
from metrale_model_engine._engine.run_state import CommandStream, ForwardScope, LinkParts, LinkState
from metrale_model_engine._engine.settings import LinkSettings
from metrale_model_engine._engine.way_back.reports import WorkerReports
from metrale_model_engine._host.liveness import exit_status, process_state
from metrale_model_engine.testing import RecordingTransport
from metrale_model_engine.wire import Report, encode_report

from helpers.fakes import FakeTransport


@contextmanager
def a_child(code: str) -> Iterator[subprocess.Popen[bytes]]:
    """A child of this process running ``code``, reaped when the block ends."""
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def until_a_zombie(pid: int) -> None:
    deadline = time.monotonic() + 10.0
    while process_state(pid) != "Z":
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.005)


def reports(world_size: int, pids: dict[int, int], transport: RecordingTransport | None = None) -> WorkerReports:
    settings = LinkSettings.checked(
        0, world_size, num_slots=4, protocol=ProtocolVersion.V2, seq_id_on_wire=True, command_timeout=1.0
    )
    stream = CommandStream()
    stream.begin(0, 5)
    head = RecordingTransport(world_size) if transport is None else transport
    parts = LinkParts(head, settings, stream, LinkState("head"), ForwardScope(True))
    return WorkerReports(parts, pids)


def test_how_a_process_ended_is_read_while_its_parent_has_not_reaped_it() -> None:
    with a_child("import time; time.sleep(30)") as killed, a_child("raise SystemExit(3)") as exited:
        os.kill(killed.pid, signal.SIGKILL)
        until_a_zombie(killed.pid)
        until_a_zombie(exited.pid)
        assert exit_status(killed.pid) == "was killed by SIGKILL"
        assert exit_status(exited.pid) == "exited with status 3"
    assert exit_status(killed.pid) == ""  # reaped: its pid says nothing any more
    assert exit_status(os.getpid()) == ""  # alive


def test_the_head_names_the_rank_that_died_and_how_and_the_others_as_witnesses() -> None:
    with a_child("import time; time.sleep(30)") as dead, a_child("import time; time.sleep(30)") as alive:
        os.kill(dead.pid, signal.SIGKILL)
        until_a_zombie(dead.pid)
        head = reports(4, {1: alive.pid, 3: dead.pid})
        witness = WorkerFailure(2, 18, 0, 5, "an all-reduce failed here: RuntimeError: closed", True, True)
        assert head.stopped_workers(5.0) == ([], [3])  # at once: a zombie is dead, whatever its pidfd says yet
        why = head.why([witness], [3])
        assert why == (
            "worker rank(s) [3] exited (died or left the run) after command 1 (rank 3 was killed by SIGKILL); "
            "worker rank 2 only witnessed it (an all-reduce failed here: RuntimeError: closed)"
        )
        head.close()


def test_witnesses_alone_do_not_end_the_heads_look_at_once() -> None:
    """A witness saw another rank fail: the head goes on looking a moment (``DEATH_GRACE``) for that rank."""
    witness = Report(1, 0, 5, "an all-reduce failed here: RuntimeError: closed", stopped=True, witness=True)
    with a_child("import time; time.sleep(30)") as dying:
        transport = FakeTransport(0, 3)
        transport.waiting = [(2, encode_report(witness))]
        head = reports(3, {1: dying.pid}, transport)
        threading.Timer(0.02, os.kill, (dying.pid, signal.SIGKILL)).start()  # after the head read the witness
        failures, exited = head.stopped_workers(5.0)
        assert [failure.rank for failure in failures] == [2] and exited == [1]
        head.close()
