"""How ``open_transport`` groups the ranks by host from the rows every rank gathers, and what it refuses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine import EpSetupError
from metrale_model_engine._launch.choice import _choose, ranks_by_host
from metrale_model_engine.torch import TRANSPORT_KINDS, TorchTransport, TransportKind

pytestmark = pytest.mark.torch

AUTO = 0


def test_ranks_are_grouped_by_host_fingerprint_the_heads_host_first() -> None:
    rows = [[AUTO, 1, 7, 8], [AUTO, 1, 9, 9], [AUTO, 1, 7, 8], [AUTO, 1, 9, 9], [AUTO, 1, 5, 5]]
    assert ranks_by_host(rows) == [[0, 2], [1, 3], [4]]


def test_a_rank_that_cannot_run_a_ring_is_a_host_of_its_own() -> None:
    rows = [[AUTO, 1, 7, 8], [AUTO, 0, 0, 0], [AUTO, 0, 0, 0], [AUTO, 1, 7, 8]]
    assert ranks_by_host(rows) == [[0, 3], [1], [2]]


class RowsOnly:
    """A stand-in for the choosing transport: its gather returns the rows given, as every rank would see them."""

    def __init__(self, rank: int, rows: list[list[int]]) -> None:
        self.rank = rank
        self.world_size = len(rows)
        self._rows = rows

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        return [list(row) for row in self._rows]


def choose(kind: TransportKind, rows: list[list[int]]) -> object:
    base = RowsOnly(0, [[TRANSPORT_KINDS.index(kind), *row[1:]] for row in rows])
    return _choose(cast(TorchTransport, base), kind, (0.001, 0.001))


ONE_RANK_HOSTS = [[0, 1, 7, 8], [0, 1, 9, 9]]


def test_shm_is_refused_on_hosts_of_one_rank_each_naming_the_ranks_elsewhere() -> None:
    with pytest.raises(EpSetupError, match=r"rank\(s\) \[1\] are not on rank 0's host"):
        choose("shm", ONE_RANK_HOSTS)
    with pytest.raises(EpSetupError, match=r"rank\(s\) \[1\] are not on rank 0's host"):
        choose("shm", [[0, 1, 7, 8], [0, 0, 0, 0]])  # one host, but rank 1 cannot run a ring


@pytest.mark.parametrize("kind", ["auto", "torch"])
def test_hosts_of_one_rank_each_keep_the_flat_broadcast(kind: TransportKind) -> None:
    assert isinstance(choose(kind, ONE_RANK_HOSTS), RowsOnly)
