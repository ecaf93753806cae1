"""Ranks on two simulated hosts (:mod:`helpers.hosts`): separate network, mount and pid namespaces.

What one host's tests show must hold when the ranks sit on different machines:
the same tokens and states, ``auto``'s choice made per group (shared memory only
when every rank shares the head's host), and the error contract's bounds when a
worker or a whole host is lost.  Root only (CI runs as root); skipped elsewhere
with the reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine import EpLink, ProtocolVersion
from metrale_model_engine.demo import main as demo_main
from metrale_model_engine.torch import DEFAULT_HEARTBEAT, HEAD_LOST_EXIT_CODE
from metrale_model_engine.toy import ToyModel, ToyState, slots_digest
from metrale_model_engine.transport import SoloTransport

from helpers import programs, way_back_sessions
from helpers.bounded import finish
from helpers.demo_env import leave_torchrun
from helpers.host_programs import COMMAND_TIMEOUT, HEAD_LOST_AFTER
from helpers.hosts import SimulatedHosts, exit_codes, unavailable
from helpers.rank_results import load
from helpers.shm_programs import SLOTS, drive_random

pytestmark = [pytest.mark.torch, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

RUN_BOUND = 90.0
"""Seconds a host's ranks may take before the test fails (they take 3-7 s here)."""
LOST_SLACK = 3.0
"""Seconds past ``head_lost_after`` allowed to a rank that finds the other host lost: a reading of the beats
(a quarter of a second), the link's error path, a loaded 2-core machine."""
LOST_EARLY = 4 * DEFAULT_HEARTBEAT
"""Seconds before ``head_lost_after`` (from the cut) that a rank may find the other host lost: its last beat came
before the cut, by a beat and, on a loaded machine, by that beat's delay (0.35 s seen).  Any other end (a failed
receive, the link's command timeout) comes at once or far later."""


def wait_for(path: Path, process: programs.Popen) -> None:
    """Wait until ``path`` exists (the head is serving), while the head's host runs."""
    deadline = time.monotonic() + RUN_BOUND
    while not path.exists():
        assert time.monotonic() < deadline and process.poll() is None, "the head never got going"
        time.sleep(0.02)


def run_on_hosts(out: Path, scenario: str, *args: str, hosts: int = 2, per_host: int = 2) -> dict[int, int]:
    """Run ``scenario`` of :mod:`helpers.host_programs` on ``hosts`` x ``per_host`` ranks; every rank's exit code."""
    with SimulatedHosts(hosts) as simulated:
        started = [
            simulated.ranks(host, per_host, ["-m", "helpers.host_programs", scenario, str(out), *args])
            for host in range(hosts)
        ]
        codes: dict[int, int] = {}
        for process in started:
            code, stdout, stderr = finish(process, RUN_BOUND)
            assert code == 0, stderr
            codes |= exit_codes(stdout)
    return codes


DEMO = ("--max-new-tokens", "8")


def demo_on_hosts(out: Path, hosts: int, per_host: int) -> tuple[dict[str, object], list[str]]:
    """The demo under torchrun, ``per_host`` ranks on each of ``hosts`` hosts: the head's summary, and stdout."""
    lines: list[str] = []
    with SimulatedHosts(hosts) as simulated:
        argv = ["-m", "metrale_model_engine.demo", *DEMO, "--json", str(out)]
        started = [simulated.torchrun(host, per_host, argv) for host in range(hosts)]
        for process in started:
            code, stdout, stderr = finish(process, RUN_BOUND)
            assert code == 0, stderr
            lines += stdout.splitlines()
    summary: dict[str, object] = json.loads(out.read_text())
    return summary, lines


def test_the_demo_over_two_hosts_serves_what_one_host_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the demo's 4 ranks on this one host, started from this process (their group's code is torchrun's:
    ``test_demo.py``'s run under torchrun)."""
    across, lines = demo_on_hosts(tmp_path / "across.json", hosts=2, per_host=2)
    leave_torchrun(monkeypatch)
    assert demo_main([*DEMO, "--world-size", "4", "--json", str(tmp_path / "one.json")]) == 0
    one_host = json.loads((tmp_path / "one.json").read_text())
    assert (across["ranks"], across["transport"]) == (4, "HostsTransport")  # auto: two hosts of two ranks
    assert (one_host["ranks"], one_host["transport"]) == (4, "ShmTransport")  # auto: one host's own /dev/shm
    assert across["requests"] == one_host["requests"]
    assert "[head] all 4 ranks agree: KV bookkeeping compared at 2 sync points" in lines
    assert {line for line in lines if line.startswith("[worker ")} == {
        f"[worker {rank}] served 40 commands, 0 failed" for rank in (1, 2, 3)
    }


@pytest.mark.parametrize(("kind", "transport"), [("auto", "HostsTransport"), ("torch", "TorchTransport")])
def test_a_random_command_stream_leaves_every_rank_on_both_hosts_in_one_state(
    tmp_path: Path, kind: str, transport: str
) -> None:
    codes = run_on_hosts(tmp_path, "soak", "1500", "11", kind)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    results = load(tmp_path, 4)
    for rank in range(4):  # shared memory asked for across hosts: refused on every rank, with one text
        assert "EpSetupError: " in str(results[rank]["refusal"])
        assert "rank(s) [2, 3] are not on rank 0's host" in str(results[rank]["refusal"])
    assert [results[rank]["host"] for rank in range(4)] == ["host0", "host0", "host1", "host1"]
    assert {results[rank]["transport"] for rank in range(4)} == {transport}
    alone = ToyModel(EpLink(SoloTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2))
    slots: list[ToyState | None] = [None] * SLOTS
    drive_random(alone, slots, 1_500, 11)  # the same stream on one rank: the state every rank must hold
    assert {results[rank]["digest"] for rank in range(4)} == {slots_digest(slots)}


def test_every_ordinary_bug_of_either_host_reaches_the_head_through_its_leader_with_its_rank(tmp_path: Path) -> None:
    codes = run_on_hosts(tmp_path, "contract")
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    results = load(tmp_path, 4)
    assert results[0]["transport"] == "HostsTransport"
    way_back_sessions.check_contract(results, 4)  # ranks 2 and 3 answered through rank 2's bundles


@pytest.mark.parametrize(
    ("victim", "named"),
    [
        (3, "no heartbeat from worker rank(s) [3]"),  # the other host's reader: gloo's text names nobody
        (2, "no heartbeat from worker rank(s) [2]"),  # the other host's leader, its ring's head
        (1, "worker rank(s) [1] exited"),  # on the head's host: its pidfd
    ],
)
def test_a_worker_killed_fails_the_head_within_its_bound_and_is_named(tmp_path: Path, victim: int, named: str) -> None:
    codes = run_on_hosts(tmp_path, "worker_dies", str(victim))
    assert codes == {rank: 3 if rank == 0 else -9 if rank == victim else 0 for rank in range(4)}
    results = load(tmp_path, 4)
    assert results[0]["error_type"] in ("EpSendError", "RunStopped"), results[0]  # a send, or the sync point
    assert named in str(results[0]["error"])
    assert float(str(results[0]["seconds"])) < COMMAND_TIMEOUT
    for rank in {1, 2, 3} - {victim}:  # every other worker ended by itself
        assert results[rank]["error_type"] == "EpReceiveError"
        assert f"worker rank {rank}: receive from the head failed" in str(results[rank]["error"])


def test_every_process_of_the_heads_host_killed_the_other_hosts_workers_exit_within_their_bound(tmp_path: Path) -> None:
    with SimulatedHosts(2) as simulated:
        argv = ["-m", "helpers.host_programs", "head_host_goes", str(tmp_path)]
        head_host, other = (simulated.ranks(host, 2, argv) for host in range(2))
        wait_for(tmp_path / "ready", head_host)
        gone_at = time.time()
        simulated.kill_all(head_host)
        code, stdout, stderr = finish(other, RUN_BOUND)
    assert code == 0, stderr
    assert exit_codes(stdout) == {2: 0, 3: 0}
    results = load(tmp_path, 4)
    for rank in (2, 3):
        assert results[rank]["error_type"] == "EpReceiveError"
        assert f"worker rank {rank}: receive from the head failed" in str(results[rank]["error"])
        assert float(str(results[rank]["at"])) - gone_at < COMMAND_TIMEOUT


def assert_the_head_lost_on_the_cut_host(
    codes: dict[int, int], stderr: str, results: dict[int, dict[str, object]]
) -> None:
    """Rank 2, the cut host's leader, finds the head lost and exits with ``HEAD_LOST_EXIT_CODE``; so does rank 3,
    unless its leader's end reaches it first.

    Both watch their own beats, which the cut stopped within a beat of each other, so their verdicts come up to
    a beat apart; rank 3 reads its leader's ring and shares its collectives, and when the leader's exit is first,
    rank 3's receive or collective fails (its error saved, the process then ends by itself, status 0).
    """
    assert codes[2] == HEAD_LOST_EXIT_CODE, (codes, stderr)
    assert "worker rank 2: the head is lost: no answer from the group's store" in stderr
    if codes[3] == HEAD_LOST_EXIT_CODE:
        assert "worker rank 3: the head is lost: no answer from the group's store" in stderr
    else:
        assert codes[3] == 0 and results[3]["error_type"] in ("EpReceiveError", "RunStopped"), (codes, results.get(3))


@pytest.mark.light  # 3 s of head_lost_after, 1.1-1.4 s of CPU (the hosts' start)
@pytest.mark.parametrize("where", ["command", "sync", "forward"])
def test_the_other_hosts_cable_cut_the_run_ends_on_both_hosts_at_head_lost_after_naming_the_lost_ranks(
    tmp_path: Path, where: str
) -> None:
    """Timed from the cut, beside the other tests: the ranks only wait for head_lost_after meanwhile, and 2 busy loops
    beside it moved the loss from 3.7 s to at most 4.0 s, well inside the bound's 3 s of slack."""
    with SimulatedHosts(2) as simulated:
        argv = ["-m", "helpers.host_programs", "cable_cut", str(tmp_path), where]
        head_host, other = (simulated.ranks(host, 2, argv) for host in range(2))
        wait_for(tmp_path / "ready", head_host)
        simulated.cut(1)
        cut_at = time.monotonic()
        (tmp_path / "cut").touch()
        code, stdout, stderr = finish(other, RUN_BOUND)
        lost_after = time.monotonic() - cut_at
        head = finish(head_host, RUN_BOUND)
        assert code == 0, stderr
        assert_the_head_lost_on_the_cut_host(exit_codes(stdout), stderr, load(tmp_path, 4))
        assert HEAD_LOST_AFTER - LOST_EARLY <= lost_after < HEAD_LOST_AFTER + LOST_SLACK  # from the last beat
        code, stdout, stderr = head
    assert code == 0, stderr
    codes = exit_codes(stdout)
    assert codes[0] == 3, (codes, stderr)
    results = load(tmp_path, 2)
    assert results[0]["error_type"] == "RunStopped", results[0]
    message = str(results[0]["error"])
    assert "worker rank(s) [2, 3] are lost: no heartbeat for " in message, message
    assert "past head_lost_after (their host is unreachable, or they died)" in message, message
    # The same bound as the workers', not the link's command timeout (30 s) or the all-reduce's (300 s).
    assert HEAD_LOST_AFTER - LOST_EARLY <= float(str(results[0]["seconds"])) < HEAD_LOST_AFTER + LOST_SLACK
    # The head's own worker ends with it: its end of the head's collectives or its ring closes with the run.
    assert codes[1] == 0 and results[1]["error_type"] in ("RunStopped", "EpReceiveError"), (codes, results.get(1))
