"""A setup that fails is one ``error: ...`` line with its root cause, from one rank, and exit code 2.

The launchers raise a rank's ``EpSetupError`` once, in the launching process; the
demo and the examples print it.  The real case, a ``/dev/shm`` too small for the
ring, runs in a private mount namespace with a 64 KiB ``/dev/shm`` where this
process may make one (root, ``unshare``), and is skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import importlib
import multiprocessing
import os
import runpy
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path

import pytest

from metrale_model_engine import EpSetupError
from metrale_model_engine._core.errors import ring_setup_failed
from metrale_model_engine._host.launch import launch
from metrale_model_engine._shm import run as shm_run
from metrale_model_engine._shm.run import _set_up_head, _set_up_worker
from metrale_model_engine.shm import ShmTransport, shm_supported

from helpers.setup_texts import NO_ROOM

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory transport needs Linux")

ROOT = Path(__file__).resolve().parents[2]
SPINS = (0.0, 0.0)


def test_a_head_that_cannot_create_the_ring_tells_every_worker_and_raises() -> None:
    pipes = [multiprocessing.Pipe() for _ in range(64)]  # 65 ranks: one more than a ring serves
    with pytest.raises(EpSetupError, match=r"^the shared-memory ring could not be set up \(rank 0: world_size must"):
        _set_up_head([head for head, _ in pipes], SPINS)
    assert all(worker.recv() is None for _, worker in pipes)


def test_a_worker_that_cannot_attach_is_named_by_the_head() -> None:
    head_end, worker_end = multiprocessing.Pipe()
    worker_end.send("no room for it")  # what the worker will answer, sent ahead
    with pytest.raises(EpSetupError, match=r"^the shared-memory ring could not be set up \(rank 1: no room for it\)$"):
        _set_up_head([head_end], SPINS)
    name = worker_end.recv()
    assert isinstance(name, str) and not Path("/dev/shm", name).exists()  # the head removed its ring


def test_a_worker_that_exits_before_it_attaches_is_named_by_the_head() -> None:
    head_end, worker_end = multiprocessing.Pipe()
    worker_end.close()
    with pytest.raises(EpSetupError, match=r"\(rank 1: it exited before it attached\)$"):
        _set_up_head([head_end], SPINS)


def test_a_worker_tells_the_head_why_it_could_not_attach() -> None:
    head_end, worker_end = multiprocessing.Pipe()
    head_end.send("metrale-ep-no-such-ring")
    with pytest.raises(SystemExit) as exit_:
        _set_up_worker(1, worker_end, SPINS)
    assert exit_.value.code == 2
    assert str(head_end.recv()).startswith("no shared-memory segment 'metrale-ep-no-such-ring' in /dev/shm: ")


@pytest.mark.parametrize("head_fails", ["no ring", "head died"])
def test_a_worker_without_a_ring_exits_quietly_for_the_head_to_say_why(head_fails: str) -> None:
    head_end, worker_end = multiprocessing.Pipe()
    if head_fails == "no ring":
        head_end.send(None)
    else:
        head_end.close()
    with pytest.raises(SystemExit) as exit_:
        _set_up_worker(1, worker_end, SPINS)
    assert exit_.value.code == 2


def test_a_worker_that_attached_tells_the_head_and_starts_on_its_go() -> None:
    ring = ShmTransport.create(2)
    head_end, worker_end = multiprocessing.Pipe()
    head_end.send(ring.name)
    head_end.send(True)  # the go, sent ahead
    with ring, _set_up_worker(1, worker_end, SPINS) as worker:
        assert worker.rank == 1 and head_end.recv() is None


@pytest.mark.parametrize("verdict", ["no go", "head died"])
def test_a_worker_that_attached_leaves_quietly_without_the_heads_go(verdict: str) -> None:
    ring = ShmTransport.create(2)
    head_end, worker_end = multiprocessing.Pipe()
    head_end.send(ring.name)
    if verdict == "no go":
        head_end.send(False)
    with ring:
        if verdict == "head died":
            with pytest.raises(SystemExit) as exit_:
                _set_up_worker_after_the_head_leaves(worker_end, head_end)
        else:
            with pytest.raises(SystemExit) as exit_:
                _set_up_worker(1, worker_end, SPINS)
            assert head_end.recv() is None  # it did attach
    assert exit_.value.code == 2


def _set_up_worker_after_the_head_leaves(worker_end: Connection, head_end: Connection) -> ShmTransport:
    """The worker attaches and answers; the head's end closes before any verdict."""
    closer = threading.Timer(0.2, head_end.close)
    closer.start()
    try:
        return _set_up_worker(1, worker_end, SPINS)
    finally:
        closer.join()


def test_one_worker_that_cannot_attach_stops_the_others_that_did() -> None:
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    pipes[0][1].send(None)  # rank 1 attached
    pipes[1][1].send("no room for it")  # rank 2 did not
    with pytest.raises(EpSetupError, match=r"\(rank 2: no room for it\)$"):
        _set_up_head([head for head, _ in pipes], SPINS)
    name = pipes[0][1].recv()
    assert isinstance(name, str) and pipes[0][1].recv() is False  # rank 1's verdict: no go


def test_a_worker_that_never_answers_is_named_after_the_setup_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_run, "DEFAULT_SETUP_TIMEOUT", 0.1)
    head_end, worker_end = multiprocessing.Pipe()
    with pytest.raises(EpSetupError, match=r"\(rank 1: it did not attach within 0.1 s\)$"):
        _set_up_head([head_end], SPINS)
    worker_end.close()


def test_a_head_without_room_in_dev_shm_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    free = os.statvfs_result((4096, 4096, 16, 16, 16, 0, 0, 0, 0, 255))  # 64 KiB free
    monkeypatch.setattr(os, "statvfs", lambda path: free)  # what _segment asks
    head_end, worker_end = multiprocessing.Pipe()
    with pytest.raises(EpSetupError) as raised:
        _set_up_head([head_end], SPINS)
    assert f"error: {raised.value}" == NO_ROOM
    assert worker_end.recv() is None and worker_end.recv() is False


def test_ranks_that_cannot_all_start_are_ended_and_the_error_raised() -> None:
    _OneStartProcess.starts = 0
    started = time.monotonic()
    with pytest.raises(OSError, match="no more processes"):
        launch(_OneStart(), time.sleep, [(60.0,), (60.0,)], None)
    assert time.monotonic() - started < 30.0  # the rank that started was killed, not waited for


class _OneStartProcess(SpawnProcess):
    """A process class of which one starts; the next start finds no more processes."""

    starts = 0

    def start(self) -> None:
        if _OneStartProcess.starts:
            raise OSError(errno.EAGAIN, "no more processes")
        _OneStartProcess.starts += 1
        super().start()


class _OneStart(SpawnContext):
    Process = _OneStartProcess


def test_the_demo_prints_a_setup_failure_in_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch", reason="the demo needs the torch extra")
    from metrale_model_engine import demo
    from metrale_model_engine import torch as ep_torch

    def refuse(*args: object, **kwargs: object) -> list[int]:
        raise ring_setup_failed({0: "no room", 1: "no platform"})

    monkeypatch.setattr(ep_torch, "run_group", refuse)
    monkeypatch.delenv("RANK", raising=False)
    assert demo.main(["--transport", "shm"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "error: the shared-memory ring could not be set up (rank 0: no room; rank 1: no platform)\n",
    )


@pytest.mark.parametrize(
    ("example", "launcher"), [("shm_local.py", "shm.run_ring"), ("ep_model.py", "torch.run_group")]
)
def test_an_example_prints_a_setup_failure_in_one_line_and_exits_2(
    example: str, launcher: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module_name, function = launcher.split(".")
    if module_name == "torch":
        pytest.importorskip("torch", reason="the example needs the torch extra")
    module = importlib.import_module(f"metrale_model_engine.{module_name}")

    def refuse(*args: object, **kwargs: object) -> list[int]:
        raise EpSetupError("the ranks disagree")

    monkeypatch.setattr(module, function, refuse)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [example])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "examples" / example), run_name="__main__")
    assert exit_.value.code == 2
    assert capsys.readouterr() == ("", "error: the ranks disagree\n")
