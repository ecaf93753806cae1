"""A setup that fails is one ``error: ...`` line with its root cause, from one rank, and exit code 2.

The launchers raise a rank's ``EpSetupError`` once, in the launching process; the
demo and the examples print it.  The real case, a ``/dev/shm`` too small for the
ring, runs in a private mount namespace with a 64 KiB ``/dev/shm`` where this
process may make one (root, ``unshare``), and is skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
from multiprocessing.context import SpawnProcess

import pytest

from metrale_model_engine import EpSetupError
from metrale_model_engine.shm import run_ring, shm_supported

from helpers import shm_programs as programs

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory transport needs Linux")


def test_run_ring_raises_a_setup_failure_of_the_ranks_once(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EpSetupError, match=r"^rank 0: the ranks disagree on the slot count \(rank 0: 8, rank 1: 9, "):
        run_ring(programs.disagree_on_slots, 3, timeout=60.0)
    assert "Traceback" not in capfd.readouterr().err


def test_run_group_raises_a_setup_failure_of_the_ranks_once(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="the torch extra is not installed")
    from metrale_model_engine.torch import run_group

    from helpers import torch_sessions

    with pytest.raises(EpSetupError, match=r"^rank 0: the ranks disagree on the slot count \(rank 0: 4, rank 1: 5\)"):
        run_group(torch_sessions.disagree_on_slots, 2, backend="gloo", timeout=60.0)
    assert "Traceback" not in capfd.readouterr().err


def test_a_setup_failure_longer_than_a_pipe_holds_is_cut_not_stuck() -> None:
    with pytest.raises(EpSetupError) as raised:
        run_ring(programs.refuse_at_length, 2, 1_000_000, timeout=60.0)
    assert str(raised.value) == "x" * 16_384


class _OneStartProcess(SpawnProcess):
    """A process class of which one starts; the next start finds no more processes."""

    starts = 0

    def start(self) -> None:
        if _OneStartProcess.starts:
            raise OSError(errno.EAGAIN, "no more processes")
        _OneStartProcess.starts += 1
        super().start()
