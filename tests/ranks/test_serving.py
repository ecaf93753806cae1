"""The reference model served through the protocol: same tokens at every world size, faults inside a forward.

The multi-rank tests run real processes (``torch.run_group``), bounded by a timeout.
Float tolerance: a sharded forward sums its partial products in another order than
one rank does, so the head's logits match one rank's to ``helpers.greedy.LOGIT_TOLERANCE``
(float32), not bit for bit; the greedy tokens must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")


from metrale_model_engine import EpLink
from metrale_model_engine.reference import ReferenceLm
from metrale_model_engine.torch import run_group

from helpers import serving_sessions as sessions
from helpers.greedy import LOGIT_TOLERANCE
from helpers.rank_results import load

pytestmark = pytest.mark.torch

RUN_LIMIT = 240.0
"""Seconds a multi-rank test may run before its ranks are killed."""
FAULT_BOUND = 10.0
"""Seconds from a rank's death (or refusal) to the error on every other rank."""


# -- one rank, in this process ---------------------------------------------------


def _a_group_of_another_size(rank: int, world_size: int, out: str) -> None:
    from helpers.fakes import RealHead
    from helpers.rank_results import save

    try:
        ReferenceLm(EpLink(RealHead(), num_slots=2))
    except ValueError as error:
        save(out, rank, message=str(error))


def test_the_group_must_be_the_links(tmp_path: Path) -> None:
    assert run_group(_a_group_of_another_size, 1, str(tmp_path), timeout=RUN_LIMIT) == [0]
    message = load(tmp_path, 1)[0]["message"]
    assert message == (
        "group: this process is rank 0 of 1 there, but rank 0 of 2 on the link; "
        "the all-reduces must run over the link's ranks"
    )


# -- several ranks, real processes ----------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "kind", "protocol"),
    [(2, "shm", "v1"), (2, "torch", "v2"), (4, "shm", "v2"), (4, "torch", "v1")],  # each value twice, pairwise
)
def test_every_world_size_serves_the_tokens_of_one_rank(
    world_size: int,
    kind: str,
    protocol: str,
    served_one_rank: sessions.Served,
    tmp_path: Path,
) -> None:
    tokens, logits, digest = served_one_rank
    codes = run_group(sessions.serve_workload, world_size, kind, protocol, str(tmp_path), timeout=RUN_LIMIT)
    assert codes == [0] * world_size
    results = load(tmp_path, world_size)
    head = results[0]
    assert head["tokens"] == tokens
    assert len(head["logits"]) == len(logits)  # type: ignore[arg-type]
    for step, (sharded, alone) in enumerate(zip(head["logits"], logits, strict=True)):  # type: ignore[call-overload]
        difference = float((sharded - alone).abs().max())
        assert difference <= LOGIT_TOLERANCE, f"step {step}: logits differ by {difference}"
    assert {results[rank]["digest"] for rank in range(world_size)} == {digest}
    assert all(results[rank]["failed"] == 0 for rank in range(1, world_size))


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_killed_inside_a_decode_stops_the_head_with_its_rank(kind: str, tmp_path: Path) -> None:
    codes = run_group(sessions.fault, 2, kind, 1, "die", str(tmp_path), timeout=RUN_LIMIT)
    assert codes[1] < 0  # killed
    head, victim = load(tmp_path, 2)[0], load(tmp_path, 2)[1]
    assert head["kind"] == "RunStopped", head
    assert "worker rank(s) [1] exited" in head["message"]  # type: ignore[operator]
    assert 0 <= head["at"] - victim["killed_at"] < FAULT_BOUND  # type: ignore[operator]


def test_the_head_killed_inside_a_decode_stops_every_worker(tmp_path: Path) -> None:
    codes = run_group(sessions.fault, 4, "shm", 0, "die", str(tmp_path), timeout=RUN_LIMIT)
    assert codes[0] < 0
    results = load(tmp_path, 4)
    for rank in (1, 2, 3):
        assert results[rank]["kind"] == "RunStopped", results[rank]
        assert "the run stopped in command" in results[rank]["message"]  # type: ignore[operator]
        assert "an all-reduce failed, so a rank died" in results[rank]["message"]  # type: ignore[operator]
        assert 0 <= results[rank]["at"] - results[0]["killed_at"] < FAULT_BOUND  # type: ignore[operator]


def test_a_refused_prefill_stops_every_rank_and_the_head_learns_why(tmp_path: Path) -> None:
    run_group(sessions.fault, 4, "shm", 2, "forget", str(tmp_path), timeout=RUN_LIMIT)
    results = load(tmp_path, 4)
    head = results[0]
    assert head["kind"] == "RunStopped", head
    assert "worker rank 2 failed command" in head["message"]  # type: ignore[operator]
    assert "KeyError: 'slot 0 is free'" in head["message"]  # type: ignore[operator]
    assert results[2]["kind"] == "EpCommandRefused"
    refused = "which runs collectives, failed here, so the run stops on every rank: KeyError: 'slot 0 is free'"
    assert refused in results[2]["message"]  # type: ignore[operator]
    for rank in (1, 3):  # in the forward's all-reduce with the head when rank 2 left
        assert results[rank]["kind"] == "RunStopped", results[rank]
    refused_at = float(results[2]["at"])  # type: ignore[arg-type]
    assert all(0 <= float(results[rank]["at"]) - refused_at < FAULT_BOUND for rank in range(4))  # type: ignore[arg-type]


def test_a_refusal_over_the_backend_reaches_the_head_with_its_rank_and_error(tmp_path: Path) -> None:
    run_group(sessions.fault, 2, "torch", 1, "forget", str(tmp_path), timeout=RUN_LIMIT)
    results = load(tmp_path, 2)
    assert results[0]["kind"] == "RunStopped", results[0]
    # The refusing worker left its report in the group's store: its error reaches the head over gloo too.
    assert "worker rank 1 failed command 4" in results[0]["message"]  # type: ignore[operator]
    assert "KeyError: 'slot 0 is free'" in results[0]["message"]  # type: ignore[operator]
    assert results[1]["kind"] == "EpCommandRefused"
    assert 0 <= results[0]["at"] - results[1]["at"] < FAULT_BOUND  # type: ignore[operator]


# -- the server keeps every request whole, whatever a step meets -------------------


# -- the deeper sync point: KV cache values -----------------------------------------


def test_a_worker_whose_kv_cache_was_altered_is_named_at_the_next_deep_sync_point(tmp_path: Path) -> None:
    run_group(sessions.tampered_cache, 2, "shm", str(tmp_path), timeout=RUN_LIMIT)
    head = load(tmp_path, 2)[0]
    assert head["kind"] == "EpDivergenceError" and head["ranks"] == (1,), head
    assert "worker rank 1: its state digest is" in str(head["message"])
    assert head["clean_syncs"] == 2  # the sync points of the two decodes before the alteration agreed
