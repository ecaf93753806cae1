"""How ``open_transport`` groups the ranks by host from the rows every rank gathers, what it refuses, and how
a failed exchange of the rings' setup ends."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch.distributed as dist

from metrale_model_engine import EpLinkError, EpSetupError
from metrale_model_engine._launch import choice
from metrale_model_engine._launch.choice import _choose, ranks_by_host
from metrale_model_engine.shm import ShmTransport, shm_supported
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


RING_STEPS = [
    "passing each ring's name to its host",
    "gathering whether every rank has its ring",
    "gathering whether every ring's setup exchange passed",
]
"""The exchanges over the group while the rings are set up, in order."""


class FailingOnTurn:
    """Rank 0's choosing transport in a group of 3 ranks: exchange number ``failing`` (from 1) fails.

    ``gather`` returns this rank's words and zeros for the others; ``all_gather_object``
    (for ``torch.distributed``'s) fills in this rank's object and ``None`` for the others.
    """

    rank = 0
    world_size = 3
    group = None

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.exchanges = 0

    def _exchange(self) -> None:
        self.exchanges += 1
        if self.exchanges == self.failing:
            raise RuntimeError("Connection reset by peer")

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        self._exchange()
        return [list(words)] + [[0] * len(words)] * (self.world_size - 1)

    def all_gather_object(self, objects: list[object], mine: object, group: object = None) -> None:
        self._exchange()
        objects[self.rank] = mine


@pytest.mark.skipif(not shm_supported(), reason="the shared-memory transport needs Linux")
@pytest.mark.parametrize("failing", [1, 2, 3], ids=RING_STEPS)
def test_a_failed_exchange_of_the_rings_setup_names_its_step_and_closes_the_ring(
    failing: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 creates the ring of host [0, 1] (rank 2 is on a host of its own); exchange ``failing`` fails.

    For the third exchange the ring's setup gather must pass first: rank 1 of the ring
    attaches and gathers in a thread.
    """
    base = FailingOnTurn(failing)
    monkeypatch.setattr(dist, "all_gather_object", base.all_gather_object)
    made: list[ShmTransport] = []
    peers: list[threading.Thread] = []
    create = ShmTransport.create

    def recorded(world_size: int, *, spin_time: float, max_spin_time: float) -> ShmTransport:
        ring = create(world_size, spin_time=spin_time, max_spin_time=max_spin_time)
        made.append(ring)
        if failing == 3:
            peers.append(threading.Thread(target=attach_and_confirm, args=(ring.name,), daemon=True))
            peers[0].start()
        return ring

    monkeypatch.setattr(ShmTransport, "create", recorded)
    step = RING_STEPS[failing - 1]
    with pytest.raises(EpLinkError, match=f"^rank 0: choosing the transport failed while {step}: RuntimeError: "):
        choice._host_rings(cast(TorchTransport, base), "shm", [[0, 1], [2]], (0.001, 0.001))
    for peer in peers:
        peer.join(10.0)
    (ring,) = made
    assert base.exchanges == failing  # nothing more after the failed one
    assert ring.closed and not Path("/dev/shm", ring.name).exists()


def attach_and_confirm(name: str) -> None:
    """Rank 1 of the ring: attach, take part in the setup gather, leave."""
    with ShmTransport.attach(name, 1, setup_timeout=10.0) as ring:
        ring.gather([0])
