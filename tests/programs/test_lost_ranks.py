"""A worker killed inside an all-reduce, its ranks the launcher's children: the head says which rank died and how.

``tests/ranks/test_lost_ranks.py`` runs the same program from the test suite's start
server, which reaps a dead rank at once, so how it ended cannot be read there.  Here
a program launches the ranks (forked from the program server, ``helpers.programs``;
its ranks are forks of it, its children as spawned ranks are): the launcher keeps the
dead rank unreaped while the head runs, and the head's line names rank 3 and its
SIGKILL, not a witness whose all-reduce failed with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from helpers import forward_sessions as sessions
from helpers import programs
from helpers.bounded import finish
from helpers.rank_results import load

pytestmark = pytest.mark.torch

TESTS = Path(__file__).resolve().parents[1]
RUN_BOUND = 120.0
"""Seconds the program may take before the test fails."""
PROGRAM = """
import sys
from helpers import forward_sessions
from metrale_model_engine.torch import run_group
print(run_group(forward_sessions.forward_fault, 4, "torch", "kill", 3, sys.argv[1]))
"""


def test_rank_3_of_4_killed_over_torch_is_named_with_how_it_ended_and_no_witness_is_blamed(tmp_path: Path) -> None:
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    process = programs.Popen(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )
    code, stdout, stderr = finish(process, RUN_BOUND)
    assert (code, stdout) == (0, "[1, 1, 1, -9]\n"), (stdout, stderr)
    sessions.check_the_killed_rank_is_named(str(load(tmp_path, 4)[0]["message"]), 3, "rank 3 was killed by SIGKILL")
