"""A worker killed inside an all-reduce at 4 ranks: the head names it, not a witness.

How it died (``was killed by SIGKILL``) is read from the dead process while its
parent has not reaped it: here the ranks fork from the test suite's start server,
which reaps at once, so the programs tier shows that part
(``tests/programs/test_lost_ranks.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine.torch import run_group

from helpers import forward_sessions as sessions
from helpers.rank_results import load

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_the_head_names_the_rank_killed_inside_an_all_reduce_and_how_not_a_witness(kind: str, tmp_path: Path) -> None:
    codes = run_group(sessions.forward_fault, 4, kind, "kill", 3, str(tmp_path), timeout=120.0)
    assert codes == [1, 1, 1, -9]
    # A witness, had it spoken, is "only witnessed it"; rank 3 is named, not among those that "said nothing".
    sessions.check_the_killed_rank_is_named(str(load(tmp_path, 4)[0]["message"]), 3)
