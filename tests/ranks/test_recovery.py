"""Killing workers of the reference model while ``Server`` serves: the ranks left re-form, every request carries on.

The programs (``recovery_sessions``) serve a few greedy requests and a seeded sampled
one, more than the slots, at 4 ranks over shared memory and over torch.distributed
(gloo), and SIGKILL a worker in a prefill, in a decode, inside an all-reduce, at a sync
point, between two steps, or while the link forms again after a first loss; losses
repeat down to the head alone.  Every request completes with the tokens of a run that
lost nothing (one rank, in this process), the sampled one too (its generator's state
is carried on); a request whose command a worker refused before it left is failed and
named, and only that one.  No rank process or ring is left.  Times are measured by the
benchmark (``benchmarks/bench_recovery.py``), never asserted here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine.torch import run_group

from helpers import recovery_sessions as sessions
from helpers.rank_results import load

pytestmark = pytest.mark.torch

RUN_LIMIT = 240.0
"""Seconds a run may take at most (measured: 20 to 30 on a busy 2-core machine, most of it starting 4 ranks)."""


@pytest.fixture(scope="module")
def unfailed() -> dict[int, list[int]]:
    return sessions.unfailed()


def served(kind: str, plan: sessions.Plan, out: Path) -> tuple[list[int], dict[int, Any]]:
    codes = run_group(sessions.serve, 4, kind, plan, str(out), timeout=RUN_LIMIT)
    results: dict[int, Any] = load(out, 4)
    pids = {int(result["pid"]) for result in results.values()}
    rings = [name for name in os.listdir("/dev/shm") if name.startswith("metrale-ep-")]
    assert not [name for name in rings if int(name.split("-")[2]) in pids], rings  # no ring of any rank left
    return codes, results


CASES = [
    ("shm", "prefill", 2),
    ("shm", "decode", 3),
    ("shm", "all-reduce", 2),
    ("shm", "sync", 4),
    ("shm", "idle", 5),
    ("torch", "prefill", 3),
    ("torch", "decode", 2),
    ("torch", "all-reduce", 3),
    ("torch", "sync", 3),
]


@pytest.mark.parametrize(("kind", "point", "at"), CASES, ids=[f"{k}-{p}" for k, p, _ in CASES])
def test_a_worker_killed_costs_no_request_and_no_token(
    kind: str, point: str, at: int, unfailed: dict[int, list[int]], tmp_path: Path
) -> None:
    codes, results = served(kind, {3: (point, at)}, tmp_path)
    assert codes == [0, 0, 0, -9], results
    head = results[0]
    assert head["tokens"] == unfailed
    assert set(head["reasons"].values()) == {"length"} and set(head["errors"].values()) == {None}
    ((line, world_size, lost, recompute_s),) = head["recoveries"]
    assert (world_size, lost, head["world_size"]) == (3, [3], 3)
    assert line.startswith("recovered from lost workers (worker rank 3 ") and "4 -> 3 rank(s) at epoch 1" in line
    assert recompute_s is not None and "failed: none" in line
    assert head["reloaded"] > 0  # the slices rank 0 did not hold before
    assert [(results[rank]["rank_now"], results[rank]["world_size"]) for rank in (1, 2)] == [(1, 3), (2, 3)]


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_loss_during_the_recovery_begins_it_again_without_that_rank(
    kind: str, unfailed: dict[int, list[int]], tmp_path: Path
) -> None:
    """Rank 2, whose first try at the new epoch failed with rank 1's death, checks in late for the next one: alive,
    it is waited for, not named silent."""
    codes, results = served(kind, {3: ("decode", 2), 1: ("forming", 1), 2: ("late", 2)}, tmp_path)
    assert codes == [0, -9, 0, -9], results
    head = results[0]
    assert head["tokens"] == unfailed
    ((line, world_size, lost, _),) = head["recoveries"]
    assert (world_size, sorted(lost)) == (2, [1, 3]), line
    assert (results[2]["rank_now"], results[2]["world_size"]) == (1, 2)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_losses_down_to_the_head_alone_and_every_request_goes_on(
    kind: str, unfailed: dict[int, list[int]], tmp_path: Path
) -> None:
    plan = {3: ("prefill", 2), 2: ("all-reduce", 4), 1: ("decode", 8)}
    codes, results = served(kind, plan, tmp_path)
    assert codes == [0, -9, -9, -9], results
    head = results[0]
    assert head["tokens"] == unfailed
    assert [(world_size, lost) for _, world_size, lost, _ in head["recoveries"]] == [(3, [3]), (2, [2]), (1, [1])]
    assert head["world_size"] == 1


def test_a_request_whose_command_a_worker_refused_fails_named_and_the_others_go_on(
    unfailed: dict[int, list[int]], tmp_path: Path
) -> None:
    codes, results = served("shm", {2: ("refuses", 1)}, tmp_path)
    assert codes == [0, 0, 1, 0], results
    head = results[0]
    failed = [i for i, reason in head["reasons"].items() if reason == "error"]
    assert failed == [0], head["reasons"]  # its alloc was the victim's first: its prefill was refused
    assert "worker rank 2 failed command" in head["errors"][0] and "slot 0 is free" in head["errors"][0]
    assert {i: tokens for i, tokens in head["tokens"].items() if i != 0} == {i: t for i, t in unfailed.items() if i}
    ((line, world_size, lost, _),) = head["recoveries"]
    assert (world_size, lost) == (3, [2]) and line.endswith("failed: 0"), line
