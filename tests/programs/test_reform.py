"""Re-forms as a user's program meets them: ``examples/reform_model.py``, and ranks on simulated hosts.

The example's ranks are children of its launcher (spawned, as in a user's run, or forks
of it, as the program server runs it: ``helpers.programs``): the launcher keeps a dead rank
unreaped while the head runs, so the head says how it ended (``was killed by
SIGKILL``), which the ranks forked from the test suite's start server cannot show
(it reaps at once).  Across two simulated hosts
(root only: :mod:`helpers.hosts`), a host's leader dies, then the whole other host:
the head goes on with its own host's rank, the leaders chosen again in between; and the
reference model served by ``Server`` loses the other host whole mid-run: every request
completes on the head's host, with the tokens of a run that lost nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from helpers import programs, recovery_sessions
from helpers import reform_host_programs as host_programs
from helpers import reform_sessions as sessions
from helpers.bounded import finish
from helpers.hosts import SimulatedHosts, exit_codes, unavailable
from helpers.rank_results import load

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
RUN_BOUND = 120.0
"""Seconds a program may take before the test fails (a simulated host's launcher imports torch: seconds)."""
EXAMPLE = ROOT / "examples" / "reform_model.py"


@pytest.mark.parametrize("transport", ["auto", "torch"])
def test_the_example_goes_on_past_its_killed_worker_and_the_head_says_how_it_ended(transport: str) -> None:
    """Over torch a fresh start, its ranks spawned as a user's are; over auto (shared memory) forked."""
    start = subprocess.Popen if transport == "torch" else programs.Popen
    process = start(
        [sys.executable, str(EXAMPLE), "--transport", transport],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    code, stdout, stderr = finish(process, RUN_BOUND)
    assert code == 0, (stdout, stderr)
    assert sorted(stdout.splitlines()) == [
        "head: 6 of 6 outputs as the MLP alone, 3 rank(s) now",
        "worker 1 of 4: now rank 1 of 3, 6 commands, 1 re-form(s)",
        "worker 2 of 4: now rank 2 of 3, 6 commands, 1 re-form(s)",
    ], stdout
    # Ranks that are the launcher's children: it keeps the dead rank unreaped while the head runs, so its end is told.
    assert "worker rank(s) [3] exited (died or left the run) after command 3 (rank 3 was killed by SIGKILL)" in stderr
    (stop,) = [line for line in stderr.splitlines() if line.startswith("head: the run stopped")]
    # The witnesses, whose all-reduce failed with rank 3, are neither blamed nor said to have said nothing.
    assert " failed command" not in stop and "said nothing" not in stop, stop
    assert "head: the link re-formed at epoch 1: 3 rank(s) of 4 in " in stderr
    assert " ms (worker rank 3 was killed by SIGKILL)" in stderr


def kill_the_other_host(program: str, out: Path) -> tuple[int, str, str]:
    """Run ``python -m program OUT`` on 2 simulated hosts of 2 ranks; kill the other host whole once the head asks
    (it notes ``host-please``; then ``host-gone``, once every process of that host ended: the kill reaches its ranks
    through its pid namespace's end, and a head that went on before would step with them still there).  The head's
    host's exit code, stdout and stderr."""
    with SimulatedHosts(2) as simulated:
        head_host, other = (simulated.ranks(host, 2, ["-m", program, str(out)]) for host in range(2))
        deadline = time.monotonic() + RUN_BOUND
        while not (out / "host-please.pkl").exists():
            assert time.monotonic() < deadline and head_host.poll() is None, "the head never asked"
            time.sleep(0.02)
        simulated.kill_all(other)
        finish(other, RUN_BOUND)  # its pipes closed: no process of that host is left
        (out / "host-gone").touch()
        code, stdout, stderr = finish(head_host, RUN_BOUND)
    return code, stdout, stderr


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_leader_killed_then_the_other_host_whole_and_the_head_goes_on_with_its_own_host(tmp_path: Path) -> None:
    code, stdout, stderr = kill_the_other_host("helpers.reform_host_programs", tmp_path)
    assert code == 0, stderr
    assert exit_codes(stdout) == {0: 0, 1: 0}, stdout
    results: dict[int, Any] = load(tmp_path, 4)
    head, own = results[0], results[1]
    assert head["outs"] == [sessions.expected(step) for step in range(1, host_programs.STEPS + 1)]
    assert head["transports"] == ["HostsTransport", "HostsTransport", "ShmTransport"]
    first, second = head["reforms"]
    assert (first["epoch"], first["world_size"], first["ranks"]) == (1, 3, (0, 1, 3))
    assert [rank for rank, _ in first["lost"]] == [2]  # the other host's leader: rank 3 leads it now (rank 2 of 3)
    assert (second["world_size"], second["ranks"]) == (2, (0, 1))
    ((rank, how),) = second["lost"]
    assert rank == 2 and how.startswith("fell silent: no heartbeat for "), second  # the whole host, killed
    assert own["reforms"] == [(1, 1, 3), (second["epoch"], 1, 2)] and own["transport"] == "ShmTransport"


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_the_served_model_loses_the_other_host_whole_and_every_request_completes_on_its_own(tmp_path: Path) -> None:
    """2 hosts of 2 ranks over a ``HostsTransport``; the other host killed whole before step 4 (requests in flight):
    one recovery, 4 -> 2 ranks over the head's own ring, every request's tokens those of a run that lost nothing (the
    greedy ones and the seeded sampled one alike), no request failed."""
    code, stdout, stderr = kill_the_other_host("helpers.recovery_host_programs", tmp_path)
    assert code == 0, stderr
    assert exit_codes(stdout) == {0: 0, 1: 0}, stdout
    results: dict[int, Any] = load(tmp_path, 4)
    head, own = results[0], results[1]
    assert head["tokens"] == recovery_sessions.unfailed()
    assert set(head["reasons"].values()) == {"length"} and set(head["errors"].values()) == {None}
    ((line, world_size, lost, _),) = head["recoveries"]
    assert (world_size, sorted(lost), head["world_size"]) == (2, [2, 3], 2), line
    assert line.startswith("recovered from lost workers (worker rank 2 ") and "4 -> 2 rank(s) at epoch 1" in line
    assert "failed: none" in line and line.count("fell silent: no heartbeat") == 2, line  # the host, silent
    assert head["transports"] == own["transports"] == ["HostsTransport", "ShmTransport"]
    assert own["reforms"] == 1
    carried = re.search(r"; (\d+) request\(s\) carried on", line)
    assert carried is not None and int(carried.group(1)) > 0, line  # the loss met requests in flight
