"""The all-reduce of ``Collectives`` over a ring, through shared memory: its sums, its failures, its file.

Real rank processes over ``open_link("shm")`` (``host_sum_sessions.Sums``); the failures reuse the faults of
``forward_sessions`` (a worker killed, a worker hung, inside its forward), whose all-reduces over a ring now go
through shared memory too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine.torch import run_group

from helpers import forward_sessions, host_sum_sessions
from helpers.rank_results import load, read_note

pytestmark = pytest.mark.torch

RUN_LIMIT = 120.0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_holds_the_sum_in_rank_order_of_every_case_and_nothing_is_left_in_dev_shm(
    world_size: int, tmp_path: Path
) -> None:
    codes = run_group(host_sum_sessions.sums, world_size, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [0] * world_size
    results = load(tmp_path, world_size)
    assert all(results[rank]["through"] == "HostSum" for rank in range(world_size)), results[0]["through"]
    for case in host_sum_sessions.CASES:
        want = host_sum_sessions.expected(case, world_size)
        for rank in range(world_size):
            got = results[rank]["sums"][case]  # type: ignore[index]
            assert isinstance(got, torch.Tensor)
            assert got.dtype == want.dtype and got.shape == want.shape, (case, rank)
            assert torch.equal(got, want), (case, rank)  # the same bits on every rank
        if want.is_floating_point() and world_size == 2:  # two ranks: what gloo computes, a + b
            parts = [host_sum_sessions.part(case, rank) for rank in range(2)]
            assert torch.equal(want, parts[0] + parts[1])
    pids = [int(results[rank]["pid"]) for rank in range(world_size)]  # type: ignore[call-overload]
    assert all(results[rank]["left"] == [] for rank in range(world_size)), results[0]["left"]
    assert not [name for name in os.listdir("/dev/shm") if any(f"metrale-ep-{pid}-" in name for pid in pids)]


def test_without_room_in_dev_shm_the_backend_sums_as_before(tmp_path: Path) -> None:
    codes = run_group(host_sum_sessions.sums, 3, str(tmp_path), True, timeout=RUN_LIMIT)
    assert codes == [0, 0, 0]
    results = load(tmp_path, 3)
    assert all(results[rank]["through"] == "NoneType" for rank in range(3)), results[0]["through"]
    for case in host_sum_sessions.CASES:
        want = host_sum_sessions.expected(case, 3)
        got = results[1]["sums"][case]  # type: ignore[index]
        assert isinstance(got, torch.Tensor)
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1.0), case  # gloo's order of the sum


def run_fault(fault: str, world_size: int, tmp_path: Path) -> tuple[list[int], dict[int, dict[str, object]], float]:
    codes = run_group(forward_sessions.forward_fault, world_size, "shm", fault, 1, str(tmp_path), timeout=RUN_LIMIT)
    return codes, load(tmp_path, world_size), float(read_note(tmp_path, "struck")["at"])  # type: ignore[arg-type]


@pytest.mark.serial  # within 1 s
def test_a_peer_killed_in_its_forward_fails_every_other_ranks_all_reduce_within_a_second(tmp_path: Path) -> None:
    codes, results, struck = run_fault("kill", 3, tmp_path)
    assert codes == [1, -9, 1]
    assert str(results[0]["message"]).startswith(
        f"head: the run stopped in command {forward_sessions.FAULTY_STEP} (seq_id=0, cmd={forward_sessions.FORWARD})"
        ": worker rank(s) [1] exited"
    ), results[0]["message"]
    assert "an all-reduce failed" in str(results[2]["message"]), results[2]
    assert "rank(s) [1] exited or left the all-reduces" in str(results[2]["message"]), results[2]
    for rank in (0, 2):
        assert float(results[rank]["at"]) - struck < 1.0, (rank, results[rank])  # type: ignore[arg-type]


@pytest.mark.light  # 2 s of the collective's timeout, 0.3 s of CPU
def test_a_peer_that_never_arrives_fails_the_others_at_the_timeout_naming_it(tmp_path: Path) -> None:
    codes, results, struck = run_fault("hang", 3, tmp_path)
    assert codes[0] == 1 and codes[2] == 1
    message = str(results[2]["message"])
    assert "an all-reduce failed" in message and "rank(s) [1] did not reach the all-reduce in time" in message, message
    for rank in (0, 2):
        took = float(results[rank]["at"]) - struck  # type: ignore[arg-type]
        timeout = forward_sessions.COLLECTIVE_TIMEOUT
        assert timeout - 0.5 <= took < timeout + 5.0, (rank, took)


def test_tensors_that_differ_between_ranks_fail_every_ranks_all_reduce_naming_each_ranks_size(tmp_path: Path) -> None:
    codes = run_group(host_sum_sessions.mismatched, 2, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [0, 0]
    results = load(tmp_path, 2)
    sizes = (
        "the ranks disagree on the all-reduce's tensor (rank 0: 8 bytes in items of 4, rank 1: 12 bytes in items of 4)"
    )
    for rank in (0, 1):
        assert results[rank]["kind"] == "RunStopped", results[rank]
        assert "an all-reduce failed" in str(results[rank]["message"]), results[rank]
        assert sizes in str(results[rank]["message"]), results[rank]
