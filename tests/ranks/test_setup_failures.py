"""A rank's setup failure is raised once by its launcher, ``run_group`` and ``run_ring``, in real rank processes
(the one-line messages and the in-process cases: ``tests/in_process/test_setup_failures.py``)."""

from __future__ import annotations

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
