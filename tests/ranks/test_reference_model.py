"""The sharded reference model over 2 and 4 ranks in real processes (gloo) against one rank.

Logits within ``atol=1e-4`` of one rank's (measured: 6e-6), every rank of a run bit for bit
the same (the all-reduce hands each the same sums), greedy tokens equal.  The other tolerances
are in ``tests/in_process/test_reference_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine.reference import Checkpoint
from metrale_model_engine.torch import run_group

from helpers.greedy import LOGIT_TOLERANCE, Greedy, greedy_session, shipped_model

pytestmark = pytest.mark.torch


def sharded_session(rank: int, world_size: int, out: str) -> None:
    """A rank of :func:`test_sharded_equals_one_rank` (module level, for ``spawn``)."""
    torch.set_num_threads(1)

    def all_reduce(tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(tensor)

    model = shipped_model(Checkpoint.open(), 3, rank=rank, world_size=world_size, all_reduce=all_reduce)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(greedy_session(model)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_equals_one_rank(world_size: int, tmp_path: Path, greedy_one_rank: Greedy) -> None:
    assert run_group(sharded_session, world_size, str(tmp_path), backend="gloo", timeout=120.0) == [0] * world_size
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    for result in results:
        assert result == results[0]  # bit for bit: every rank gets the same sums
    expected = torch.tensor(greedy_one_rank["logits"])
    torch.testing.assert_close(torch.tensor(results[0]["logits"]), expected, atol=LOGIT_TOLERANCE, rtol=0)
    assert results[0]["tokens"] == greedy_one_rank["tokens"]
