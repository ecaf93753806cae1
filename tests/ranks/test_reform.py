"""Killing ranks of a run whose model re-forms its link: the survivors form a new link and go on, exactly.

The programs (``reform_sessions``) run a tensor-parallel MLP of integer weights at 4
ranks over shared memory and over torch.distributed (gloo), and SIGKILL workers
between commands, in a command's hook, inside an all-reduce, at a sync point and
while the link forms again; the head checks every output against the whole MLP.  A
model that does not opt in ends as before; over one ring without torch, the toy
model's state digests agree after two losses.  Times are measured by the programs,
never asserted here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine.shm import run_ring
from metrale_model_engine.torch import run_group

from helpers import reform_sessions as sessions
from helpers.rank_results import load

pytestmark = pytest.mark.torch

RUN_LIMIT = 120.0
"""Seconds a run of these programs may take at most (measured: a few)."""
KILLED = ("was killed by SIGKILL", "exited")
"""How the head says a killed rank ended: as the dead process tells it, or ``exited`` once its parent reaped it (the
test suite's start server reaps at once: ``tests/programs/test_reform.py`` shows the first without it)."""


def nothing_left(results: dict[int, Any]) -> None:
    """No socket of the first group open, no thread past its count, no ring of any rank in ``/dev/shm``."""
    pids = {int(result["pid"]) for result in results.values()}
    for rank, result in results.items():
        left = result.get("left")
        if left is not None:
            assert left["sockets"] == [] and left["threads"] <= 0, (rank, left)
    rings = [name for name in os.listdir("/dev/shm") if name.startswith("metrale-ep-")]
    assert not [name for name in rings if int(name.split("-")[2]) in pids], rings


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_losses_down_to_the_head_alone_each_at_another_point_and_the_run_goes_on_exactly(
    kind: str, tmp_path: Path
) -> None:
    plan = {2: ("idle", 3), 4: ("all-reduce", 2), 6: ("sync", 1)}
    codes = run_group(sessions.losses, 4, kind, plan, 8, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [0, -9, -9, -9]
    results: dict[int, Any] = load(tmp_path, 4)
    head = results[0]
    assert head["outs"] == [sessions.expected(step) for step in range(1, 9)]
    reforms = head["reforms"]
    assert [(reform["epoch"], reform["world_size"], reform["attempts"]) for reform in reforms] == [
        (1, 3, 1),
        (2, 2, 1),
        (3, 1, 1),
    ]
    # Each loss is named by its rank in the epoch it was lost from: 3 of 4, then 2 of 3, then 1 of 2.
    assert [[rank for rank, _ in reform["lost"]] for reform in reforms] == [[3], [2], [1]]
    assert all(how in KILLED for reform in reforms for _, how in reform["lost"])
    stops = head["stops"]
    assert len(stops) == 3, stops
    for stop, rank in zip(stops, (3, 2, 1), strict=True):
        assert f"worker rank(s) [{rank}] exited (died or left the run)" in stop or (
            f"worker rank {rank} did not answer (it exited" in stop
        ), stop
        assert "said nothing" not in stop and " failed command" not in stop, stop  # witnesses are not blamed
    assert head["world_size"] == 1 and head["epoch"] == 3
    nothing_left(results)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_killed_mid_command_then_one_killed_as_the_link_forms_again_and_the_rest_go_on(
    kind: str, tmp_path: Path
) -> None:
    codes = run_group(sessions.losses, 4, kind, {2: ("hook", 3)}, 5, str(tmp_path), 2, timeout=RUN_LIMIT)
    assert codes == [0, 0, -9, -9]
    results: dict[int, Any] = load(tmp_path, 4)
    head, survivor = results[0], results[1]
    assert head["outs"] == [sessions.expected(step) for step in range(1, 6)]
    (reform,) = head["reforms"]
    # The first epoch tried lost rank 2 before its setup passed: the re-form began again without it.
    assert (reform["epoch"], reform["world_size"], reform["attempts"], reform["ranks"]) == (2, 2, 2, (0, 1))
    assert [rank for rank, _ in reform["lost"]] == [2, 3]
    assert "worker rank(s) [3] exited (died or left the run) after command 2" in str(head["stops"])
    assert survivor["summary"].reforms == 1 and survivor["reforms"] == [(2, 1, 2)]
    nothing_left(results)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_survivor_whose_agreement_fails_frees_the_ranks_waiting_on_it_and_the_link_forms_at_the_next_epoch(
    kind: str, tmp_path: Path
) -> None:
    """Rank 1 fails the first epoch's setup agreement before its collective, alive, while the head and rank 2 wait on
    it there: it ends their wait as its death would (without, they waited out the re-form's bound, and the run
    stopped), and all three form the next epoch."""
    codes = run_group(sessions.losses, 4, kind, {2: ("hook", 3)}, 5, str(tmp_path), -1, False, 1, timeout=RUN_LIMIT)
    results: dict[int, Any] = load(tmp_path, 4)
    assert codes == [0, 0, 0, -9], results.get(0)
    head, failed, other = results[0], results[1], results[2]
    assert head["outs"] == [sessions.expected(step) for step in range(1, 6)]
    (reform,) = head["reforms"]
    assert (reform["epoch"], reform["world_size"], reform["attempts"], reform["ranks"]) == (2, 3, 2, (0, 1, 2))
    assert [rank for rank, _ in reform["lost"]] == [3]
    assert failed["summary"].reforms == 1 and failed["reforms"] == [(2, 1, 3)]
    assert other["summary"].reforms == 1 and other["reforms"] == [(2, 2, 3)]
    nothing_left(results)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_model_that_does_not_opt_in_ends_every_rank_as_before(kind: str, tmp_path: Path) -> None:
    codes = run_group(sessions.losses, 4, kind, {2: ("hook", 3)}, 5, str(tmp_path), -1, True, timeout=RUN_LIMIT)
    assert codes == [1, 1, 1, -9]
    results: dict[int, Any] = load(tmp_path, 4)
    head = results[0]
    assert "worker rank(s) [3] exited (died or left the run) after command 2" in str(head["stops"])
    assert head["refused"] == (
        "head: the link cannot re-form: its model does not re-form (LinkedEp.ep_reforms is False): a lost worker "
        "ends the run"
    )
    for rank in (1, 2):
        assert results[rank]["error"] == "RunStopped", results[rank]


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_the_head_lost_every_worker_of_a_model_that_re_forms_ends_as_before(kind: str, tmp_path: Path) -> None:
    codes = run_group(sessions.losses, 4, kind, {2: ("hook", 0)}, 5, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [-9, 1, 1, 1]  # the head is out of a re-form's reach: its workers end, none waits long
    results: dict[int, Any] = load(tmp_path, 4)
    for rank in (1, 2, 3):
        assert results[rank]["error"] == "RunStopped", results[rank]
        assert f"worker rank {rank}: the run stopped in command 2" in results[rank]["message"], results[rank]


def test_over_one_ring_without_torch_the_survivors_states_agree_after_two_losses(tmp_path: Path) -> None:
    codes = run_ring(sessions.ring_losses, 4, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [0, -9, 0, -9]
    results: dict[int, Any] = load(tmp_path, 4)
    head, survivor = results[0], results[2]
    assert [(reform["epoch"], reform["world_size"]) for reform in head["reforms"]] == [(1, 3), (2, 2)]
    assert [[rank for rank, _ in reform["lost"]] for reform in head["reforms"]] == [[3], [1]]
    assert survivor["reforms"] == [(1, 2, 3), (2, 1, 2)]  # rank 2 of 4, then of 3, then rank 1 of 2
    assert survivor["summary"].reforms == 2
    assert survivor["digest"] == head["digest"]
    nothing_left(results)
