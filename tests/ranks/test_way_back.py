"""The way back over real processes, over shared memory and over gloo: no rank diverges without the head knowing."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine import WorkerSummary
from metrale_model_engine._core.codec import report_text
from metrale_model_engine._core.errors import error_text
from metrale_model_engine.shm import run_ring
from metrale_model_engine.torch import run_group

from helpers import error_text_sessions, hosts_parts
from helpers import way_back_sessions as sessions
from helpers.rank_results import load

pytestmark = pytest.mark.torch

KINDS = ["shm", "torch", "hosts"]
"""``"hosts"``: a HostsTransport over two hosts this machine stands for (``sessions.open_link_of``)."""
TRANSPORTS = {
    "shm": "ShmTransport",
    "torch": "TorchTransport",
    "hosts": "HostsTransport",
    "hosts-odd-even": "HostsTransport",
}
SIZES = [("shm", 2), ("shm", 3), ("torch", 2), ("torch", 3), ("hosts", 3), ("hosts", 4), ("hosts-odd-even", 4)]
"""Over "hosts", 3 ranks are the head alone and a host of a leader and its reader; 4, two hosts of two."""


@pytest.mark.parametrize(("kind", "world_size"), SIZES)
def test_every_ordinary_bug_reaches_the_head_with_the_rank_and_the_error(
    kind: str, world_size: int, tmp_path: Path
) -> None:
    codes = run_group(sessions.contract, world_size, kind, str(tmp_path), backend="gloo", timeout=120)
    results = load(tmp_path, world_size)
    assert codes == [0] * world_size
    assert results[0]["transport"] == TRANSPORTS[kind]
    sessions.check_contract(results, world_size)


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_that_dies_fails_the_heads_sync_point_within_its_bound(kind: str, tmp_path: Path) -> None:
    codes = run_group(sessions.worker_dies_during_a_sync, 3, kind, str(tmp_path), backend="gloo", timeout=120)
    results = load(tmp_path, 3)
    assert codes[1] == -9
    assert results[0]["transport"] == TRANSPORTS[kind]  # over "hosts", rank 1 leads rank 2's host
    outcome = results[0]["outcome"]
    assert isinstance(outcome, tuple)
    kind_of_error, message = str(outcome[0]), str(outcome[1])
    # The sync point stops the run; over gloo the dead worker may show first as the sync item's broadcast failing.
    assert kind_of_error in ("RunStopped", "EpSendError"), message
    assert "sync point 1" in message or "broadcast to the workers failed" in message, message
    assert "worker rank 1" in message or "worker rank(s) [1]" in message, message  # the lost worker, named
    assert float(results[0]["seconds"]) < 10.0  # type: ignore[arg-type]  # within the command timeout


def test_over_hosts_a_remote_reader_that_dies_is_named_and_the_head_fails_within_its_bound(tmp_path: Path) -> None:
    codes = run_group(sessions.worker_dies_during_a_sync, 3, "hosts", str(tmp_path), 2, backend="gloo", timeout=120)
    results = load(tmp_path, 3)
    assert codes[2] == -9
    assert results[0]["transport"] == "HostsTransport"
    outcome = results[0]["outcome"]
    assert isinstance(outcome, tuple)
    message = str(outcome[1])
    assert str(outcome[0]) in ("RunStopped", "EpSendError"), message
    # Named by its leader's bundle; or, where the leader's relay of the sync item already found the ring's
    # reader dead (and the leader's receive failed), by the exits this head sees (one machine here).
    named = "worker rank 2 did not answer" in message and "worker rank 2 died (pid" in message
    assert named or "worker rank(s) [1, 2] exited" in message, message
    assert float(results[0]["seconds"]) < 10.0  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [*KINDS, "hosts-odd-even"])
def test_a_burst_of_failures_reaches_the_head_every_one_once(kind: str, tmp_path: Path) -> None:
    # Over shared memory, 10,000 overrun each worker's 16-answer ring many times over; over gloo a
    # worker holds its answers for the sync point, where 2,000 arrive in one message as 10,000 would.
    # Over "hosts", 4 ranks: rank 1 answers on the head's ring, rank 3 hands its 2,000 answers to its leader,
    # rank 2, through their host's 16-answer ring at the sync point, and the leader brings both to the head.
    commands = 10_000 if kind == "shm" else 2_000
    world_size = 4 if kind.startswith("hosts") else 3
    codes = run_group(sessions.burst, world_size, kind, commands, str(tmp_path), backend="gloo", timeout=300)
    results = load(tmp_path, world_size)
    assert codes == [0] * world_size
    assert results[0]["transport"] == TRANSPORTS[kind]
    by_rank = results[0]["by_rank"]
    assert isinstance(by_rank, dict)
    for rank in range(1, world_size):
        assert by_rank[rank] == list(range(1, commands + 1))  # every command, once, none lost or doubled
        assert results[rank]["summary"] == WorkerSummary(commands_run=0, commands_failed=commands)
    assert results[0]["texts"] == {f"KeyError: 'slot {slot} is not served here'" for slot in range(4)}
    if kind != "torch":  # a worker on the head's host answers at once, over its ring
        assert int(results[0]["raised"]) > 0  # type: ignore[call-overload]  # raised at the head's next commands too


def test_the_leaders_group_waits_as_long_as_the_whole_group(tmp_path: Path) -> None:
    # An idle leader waits for the next command inside the leaders' group: torch's 30-minute default for a
    # new group would fail it where the whole group's (run_group: 7 days) holds.
    codes = run_group(sessions.group_timeouts, 3, str(tmp_path), backend="gloo", timeout=120)
    results = load(tmp_path, 3)
    assert codes == [0, 0, 0]
    week = 7 * 24 * 3600.0
    assert [results[rank]["world"] for rank in range(3)] == [week] * 3
    assert [results[rank]["leaders"] for rank in range(3)] == [week, week, None]  # rank 2 leads nothing
    assert [results[rank]["subgroup"] for rank in range(3)] == [4321.0] * 3  # a group's own, read back


def bundles_in(out: Path) -> list[list[tuple[int, str]]]:
    """The bundles ``hosts_parts.leader_on_a_ring``'s leader sent, described."""
    return cast(list[list[tuple[int, str]]], load(out, 1)[0]["bundles"])


@pytest.mark.serial  # answers timed to tenths of a second
def test_a_leader_on_a_real_ring_names_the_reader_that_left_not_the_one_it_waited_for(tmp_path: Path) -> None:
    codes = run_ring(hosts_parts.leader_on_a_ring, 3, "gone", str(tmp_path), timeout=60)
    assert codes == [0, 0, 0]
    [bundle] = bundles_in(tmp_path)
    assert bundle == [
        (2, "ack 1"),
        (4, "lost: worker rank 4 closed its transport (on its host's ring, led by rank 2)"),
        (3, "ack 1"),  # it answered after the leader's wait for it failed, because rank 4 had left
    ]


@pytest.mark.serial  # answers timed to tenths of a second
def test_a_reader_late_for_one_sync_point_is_in_step_again_at_the_next(tmp_path: Path) -> None:
    codes = run_ring(hosts_parts.leader_on_a_ring, 3, "late", str(tmp_path), timeout=60)
    assert codes == [0, 0, 0]
    first, second = bundles_in(tmp_path)
    assert first == [
        (2, "ack 1"),
        (4, "ack 1"),
        (3, "lost: worker rank 3 sent no answer within 0.4 s (on its host's ring, led by rank 2)"),
    ]
    assert second == [(2, "ack 2"), (3, "ack 1"), (3, "ack 2"), (4, "ack 2")]  # read up to sync point 2's


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_of_any_text_reaches_the_head_readable_and_the_worker_stays_in_step(kind: str, tmp_path: Path) -> None:
    codes = run_group(error_text_sessions.texts, 2 if kind != "hosts" else 3, kind, str(tmp_path), timeout=120)
    world_size = len(codes)
    results = load(tmp_path, world_size)
    assert codes == [0] * world_size, results
    head = results[0]
    assert head["transport"] == TRANSPORTS[kind]
    expected = [report_text(error_text(error)).decode() for error in error_text_sessions.errors()]
    read = cast(list[str], head["read"])
    assert sorted(read) == sorted(expected * (world_size - 1)), read  # each ordinary failure once, by every worker
    assert expected[0] == "ValueError: no such file: /data/\\udcff.bin"  # escaped, readable
    assert expected[3].startswith("MemoryError: xxx") and expected[3].endswith("...")  # megabytes, cut to one answer
    assert expected[4] == "Unprintable: <its str() raised RuntimeError>"
    assert "failed command 6 (seq_id=0, cmd=2): ValueError: no such file: /data/\\udcff.bin" in str(head["stopped"])
    for rank in range(1, world_size):  # in step through the five failures, then it refused the sixth command
        assert results[rank]["failed"] == 6, results[rank]
