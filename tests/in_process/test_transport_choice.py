"""How ``open_transport`` groups the ranks by host from the rows every rank gathers (a pure step)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine._torch.choice import ranks_by_host

pytestmark = pytest.mark.torch

AUTO = 0


def test_ranks_are_grouped_by_host_fingerprint_the_heads_host_first() -> None:
    rows = [[AUTO, 1, 7, 8], [AUTO, 1, 9, 9], [AUTO, 1, 7, 8], [AUTO, 1, 9, 9], [AUTO, 1, 5, 5]]
    assert ranks_by_host(rows) == [[0, 2], [1, 3], [4]]


def test_a_rank_that_cannot_run_a_ring_is_a_host_of_its_own() -> None:
    rows = [[AUTO, 1, 7, 8], [AUTO, 0, 0, 0], [AUTO, 0, 0, 0], [AUTO, 1, 7, 8]]
    assert ranks_by_host(rows) == [[0, 3], [1], [2]]
