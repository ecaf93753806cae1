"""``HostsTransport``'s way back, with its parts stood in for: what a leader bundles, what the head takes from it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import cast

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine._core.codec import Ack, Report, closes_answers, encode_ack, encode_report
from metrale_model_engine.shm import ShmTransport
from metrale_model_engine.torch import HostsTransport, TorchTransport
from metrale_model_engine.transport import PeerLost, TransportClosed, TransportCorrupt

pytestmark = pytest.mark.torch

HOSTS = [[0, 1], [2, 3, 4]]
"""The head's host (ranks 0 and 1), and a host led by rank 2 with readers 3 and 4 (ring ranks 1 and 2)."""


def ack(number: int) -> bytes:
    return encode_ack(Ack(number, 7, 3, 0, None))


def report(text: str, *, stopped: bool = False) -> bytes:
    return encode_report(Report(2, 0, 5, text, stopped))


class World:
    """The whole group's transport: the store's last words, and the calls that reach it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 5
        self.left: dict[int, list[bytes]] = {}
        self.closed = False

    def leave_answers(self, rank: int, answers: Sequence[bytes]) -> None:
        if answers:
            self.left[rank] = list(answers)

    def poll_answers(self) -> list[tuple[int, bytes]]:
        return [(rank, answer) for rank, answers in self.left.items() for answer in answers]

    def close(self) -> None:
        self.closed = True


class Leaders:
    """The leaders' group: a leader's bundle sent, or the bundles the head receives, by host."""

    def __init__(self, bundles: dict[int, list[list[bytes]]] | None = None) -> None:
        self.sent: list[list[bytes]] = []
        self.bundles = bundles or {}
        self.asked: list[int] = []

    def send_answers(self, answers: Sequence[bytes], timeout: float | None) -> None:
        self.sent.append(list(answers))

    def receive_answers(self, host: int, timeout: float | None) -> list[bytes]:
        self.asked.append(host)
        return self.bundles[host].pop(0)

    def close(self) -> None:
        pass


class Ring:
    """A host's ring, as its head (a leader) reads its readers' answers: queued lists, or an error."""

    def __init__(self, answers: dict[int, list[list[bytes] | Exception]], unread: dict[int, list[bytes]] | None = None):
        self.answers = answers
        self.unread = unread or {}  # what a close finds on the ring
        self.answered: list[bytes] = []

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        found = self.answers[rank].pop(0)
        if isinstance(found, Exception):
            raise found
        return found

    def answer(self, answer: bytes, timeout: float | None) -> None:
        self.answered.append(bytes(answer))

    def poll_answers(self) -> list[tuple[int, bytes]]:
        return [(rank, answer) for rank, answers in self.unread.items() for answer in answers]

    def close(self) -> None:
        pass


def hosts_transport(world: World, leaders: Leaders | None, ring: Ring | None) -> HostsTransport:
    return HostsTransport(
        cast(TorchTransport, world), cast(TorchTransport | None, leaders), cast(ShmTransport | None, ring), hosts=HOSTS
    )


def test_only_an_acknowledgement_or_a_stop_closes_what_a_worker_answers_for_a_sync_point() -> None:
    assert closes_answers(ack(1))
    assert closes_answers(report("boom", stopped=True))
    assert not closes_answers(report("an ordinary failure"))
    assert not closes_answers(b"\x12")  # shorter than a word: no kind at all


def test_a_leaders_bundle_carries_its_own_answers_and_each_readers_up_to_its_acknowledgement() -> None:
    leaders = Leaders()
    ring = Ring({1: [[report("a")], [ack(1)]], 2: [[ack(1), report("after")]]})
    leader = hosts_transport(World(2), leaders, ring)
    leader.answer(ack(1), 1.0)
    leader.flush_answers(1.0)

    head = hosts_transport(World(0), Leaders({1: leaders.sent}), None)
    assert head.receive_answers(3, 1.0) == [report("a"), ack(1)]  # two reads of ring rank 1, in order
    assert head.receive_answers(2, 1.0) == [ack(1)]  # the leader's own, from the same bundle
    assert head.receive_answers(4, 1.0) == [ack(1), report("after")]


def test_a_reader_the_leader_cannot_read_is_named_lost_with_its_global_rank_after_what_it_did_send() -> None:
    leaders = Leaders()
    ring = Ring({1: [[report("first")], PeerLost("worker rank(s) [1] died (pids [77])")], 2: [[ack(1)]]})
    leader = hosts_transport(World(2), leaders, ring)
    leader.answer(ack(1), 1.0)
    leader.flush_answers(1.0)

    head = hosts_transport(World(0), Leaders({1: leaders.sent}), None)
    assert head.receive_answers(3, 1.0) == [report("first")]
    with pytest.raises(PeerLost, match=r"worker rank 3's answers could not be read on its host's ring, led by rank 2"):
        head.receive_answers(3, 1.0)
    assert head.receive_answers(4, 1.0) == [ack(1)]  # the reader after it was still read


def test_the_head_asks_a_host_for_its_bundle_once_per_sync_point_and_refuses_one_without_the_rank() -> None:
    bundle_without_4 = [rank.to_bytes(4, sys.byteorder) + ack(1) for rank in (2, 3)]  # entries: rank, then answer
    leaders = Leaders({1: [bundle_without_4]})
    head = hosts_transport(World(0), leaders, None)
    assert head.receive_answers(2, 1.0) == [ack(1)]
    assert head.receive_answers(3, 1.0) == [ack(1)]
    assert leaders.asked == [1]
    leaders.bundles[1].append([])
    with pytest.raises(TransportCorrupt, match=r"the answers of worker rank 4's host held none of it"):
        head.receive_answers(4, 1.0)


def test_workers_answer_by_host_the_heads_at_once_on_its_ring_the_others_at_their_sync_point() -> None:
    near_ring = Ring({})
    near = hosts_transport(World(1), None, near_ring)
    near.answer(report("x"), 1.0)
    assert near_ring.answered == [report("x")]  # on the head's ring at once

    far_ring = Ring({})
    far = hosts_transport(World(3), None, far_ring)
    far.answer(report("y"), 1.0)
    far.answer(ack(1), 1.0)
    assert far_ring.answered == []  # held: its leader reads its ring only at sync points
    far.flush_answers(1.0)
    assert far_ring.answered == [report("y"), ack(1)]

    with pytest.raises(TransportClosed, match="the head does not answer"):
        hosts_transport(World(0), Leaders(), near_ring).answer(ack(1), 1.0)
    with pytest.raises(ValueError, match="an answer takes at most 248 bytes, got 252"):
        far.answer(bytes(252), 1.0)


def test_answers_held_at_close_are_left_in_the_store_the_leaders_readers_by_their_global_rank() -> None:
    world = World(3)
    reader = hosts_transport(world, None, Ring({}))
    reader.answer(report("stopped", stopped=True), 1.0)
    reader.close()
    assert world.left == {3: [report("stopped", stopped=True)]} and world.closed

    leader_world = World(2)
    leader = hosts_transport(leader_world, Leaders(), Ring({}, {1: [report("late")]}))
    leader.answer(report("mine"), 1.0)
    leader.close()
    assert leader_world.left == {2: [report("mine")], 3: [report("late")]}
