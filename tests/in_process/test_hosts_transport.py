"""``HostsTransport``'s way back and its rings' errors, with its parts stood in for."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine._core.codec import Report, acknowledged, closes_answers, encode_report
from metrale_model_engine.torch import HostsTransport
from metrale_model_engine.transport import PeerLost, TransportClosed, TransportCorrupt, TransportTimeout

from helpers.hosts_parts import Leaders, World, ack, hosts_transport, report

pytestmark = pytest.mark.torch


class Ring:
    """A host's ring as its head (a leader) reads it: each reader's answers in the batches they arrive in.

    As the real one: a wait for a reader with nothing published fails with ``PeerLost`` while any reader
    is gone (whichever), else with ``TransportTimeout``.  A ``None`` batch is a wait that finds nothing
    yet; the batches after it are published by the time the ring is polled.
    """

    def __init__(self, batches: dict[int, list[list[bytes] | None]], gone: dict[int, str] | None = None) -> None:
        self.batches = batches
        self.gone = gone or {}
        self.answered: list[bytes] = []
        self.leaving: dict[int, tuple[str, list[bytes]]] = {}
        """Readers that publish these answers and leave just as the ring is asked who is gone."""

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        batch = self.batches[rank].pop(0) if self.batches.get(rank) else None
        if batch is not None:
            return batch
        if self.gone:
            raise PeerLost(", ".join(f"worker rank {reader} {how}" for reader, how in self.gone.items()))
        raise TransportTimeout(f"worker rank {rank} sent no answer within {timeout} s")

    def poll_answers(self) -> list[tuple[int, bytes]]:
        found = [
            (rank, answer) for rank, batches in self.batches.items() for batch in batches for answer in batch or []
        ]
        self.batches = {}
        return found

    def gone_workers(self) -> dict[int, str]:
        found = dict(self.gone)
        for reader, (how, answers) in self.leaving.items():
            self.batches.setdefault(reader, []).append(answers)
            self.gone[reader] = how
        self.leaving = {}
        return found

    def send(self, parts: Sequence[bytes], timeout: float | None) -> None:
        if self.gone:
            raise PeerLost(f"worker rank(s) {sorted(self.gone)} died (pids [7]); nothing more can reach every worker")

    def answer(self, answer: bytes, timeout: float | None) -> None:
        if self.gone:
            raise PeerLost("the head (pid 7) died")
        self.answered.append(bytes(answer))

    def close(self) -> None:
        pass


def test_an_acknowledgement_of_the_sync_point_or_a_stop_closes_what_a_worker_answers_for_it() -> None:
    assert closes_answers(ack(1)) and closes_answers(ack(1), 1)
    assert not closes_answers(ack(1), 2)  # an earlier sync point's, late
    assert closes_answers(report("boom", stopped=True), 2)
    assert closes_answers(encode_report(Report(2, 0, 5, "a peer's", True, True)), 2)  # a witness stopped too
    assert not closes_answers(report("an ordinary failure"))
    assert not closes_answers(b"\x12")  # shorter than a word: no kind at all
    assert acknowledged(ack(9)) == 9 and acknowledged(report("x")) is None


def bundle_of(ring: Ring, own: list[bytes], timeout: float = 1.0) -> list[bytes]:
    """What leader rank 2 sends the head at a sync point, its own answers ``own``, its readers' on ``ring``."""
    leaders = Leaders()
    leader = hosts_transport(World(2), leaders, ring)
    for answer in own:
        leader.answer(answer, timeout)
    leader.flush_answers(timeout)
    [bundle] = leaders.sent
    return bundle


def head_with(*bundles: list[bytes]) -> tuple[HostsTransport, Leaders]:
    leaders = Leaders({1: list(bundles)})
    return hosts_transport(World(0), leaders, None), leaders


def test_a_leaders_bundle_carries_its_own_answers_and_each_readers_up_to_its_acknowledgement() -> None:
    bundle = bundle_of(Ring({1: [[report("a")], [ack(1)]], 2: [[ack(1), report("after")]]}), [ack(1)])
    head, _ = head_with(bundle)
    assert head.receive_answers(3, 1.0) == [report("a"), ack(1)]  # two reads of ring rank 1, in order
    assert head.receive_answers(2, 1.0) == [ack(1)]  # the leader's own, from the same bundle
    assert head.receive_answers(4, 1.0) == [ack(1), report("after")]


def test_a_reader_behind_by_a_sync_point_is_read_up_to_this_ones_acknowledgement() -> None:
    bundle = bundle_of(Ring({1: [[ack(1)], [report("b"), ack(2)]], 2: [[ack(2)]]}), [ack(2)])
    head, leaders = head_with(bundle)
    assert head.receive_answers(3, 1.0) == [ack(1), report("b"), ack(2)]  # ack 1 alone does not close sync 2
    assert leaders.asked == [1]


def test_a_reader_that_is_gone_is_named_not_the_one_the_leader_was_waiting_for() -> None:
    # Ring rank 2 (rank 4) closed; ring rank 1 (rank 3) acknowledged after the leader began to wait for it,
    # a wait that the ring fails because rank 4 is gone.
    ring = Ring({1: [[report("first")], None, [ack(1)]], 2: []}, gone={2: "closed its transport"})
    bundle = bundle_of(ring, [ack(1)])
    head, _ = head_with(bundle)
    assert head.receive_answers(3, 1.0) == [report("first"), ack(1)]
    with pytest.raises(PeerLost, match=r"^worker rank 4 closed its transport \(on its host's ring, led by rank 2\)$"):
        head.receive_answers(4, 1.0)


def test_a_reader_that_does_not_answer_in_time_is_named_late_after_what_it_did_send() -> None:
    bundle = bundle_of(Ring({1: [[report("first")]], 2: [[ack(1)]]}), [ack(1)], timeout=0.05)
    head, _ = head_with(bundle)
    assert head.receive_answers(3, 1.0) == [report("first")]
    with pytest.raises(
        PeerLost, match=r"worker rank 3 sent no answer within 0.04 s \(on its host's ring, led by rank 2"
    ):
        head.receive_answers(3, 1.0)
    assert head.receive_answers(4, 1.0) == [ack(1)]  # the reader after it was still read


def test_the_head_asks_a_host_for_its_bundle_once_per_sync_point_and_refuses_one_without_the_rank() -> None:
    bundle_without_4 = [rank.to_bytes(4, sys.byteorder) + ack(1) for rank in (2, 3)]  # entries: rank, then answer
    head, leaders = head_with(bundle_without_4, [])
    assert head.receive_answers(2, 1.0) == [ack(1)]
    assert head.receive_answers(3, 1.0) == [ack(1)]
    assert leaders.asked == [1]
    with pytest.raises(TransportCorrupt, match=r"the answers of worker rank 4's host held none of it"):
        head.receive_answers(4, 1.0)


@pytest.mark.parametrize(
    ("failure", "raised"),
    [(TransportTimeout("timed out after 5 s"), TransportTimeout), (RuntimeError("Connection closed"), PeerLost)],
)
def test_a_bundle_that_does_not_come_names_the_host_and_its_leader(failure: Exception, raised: type[Exception]) -> None:
    head = hosts_transport(World(0), Leaders(fail=failure), None)
    with pytest.raises(
        raised, match=r"the answers of the host of ranks \[2, 3, 4\], which its leader, rank 2, bundles"
    ):
        head.receive_answers(3, 1.0)


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


def test_a_reader_whose_leader_is_gone_says_so_and_leaves_its_answers_in_the_store() -> None:
    world = World(3)
    reader = hosts_transport(world, None, Ring({}, gone={1: "died"}))
    reader.answer(report("stopped", stopped=True), 1.0)
    with pytest.raises(
        PeerLost, match=r"the head \(pid 7\) died \(the head of this host's ring is its leader, rank 2\)"
    ):
        reader.flush_answers(1.0)
    reader.close()
    assert world.left == {3: [report("stopped", stopped=True)]} and world.closed


def test_a_leader_closing_leaves_its_own_its_unsent_bundles_and_its_rings_answers_in_the_store() -> None:
    world = World(2)
    leader = hosts_transport(
        world, Leaders(fail=RuntimeError("the head is gone")), Ring({1: [[ack(1)]], 2: [[ack(1)]]})
    )
    leader.answer(ack(1), 1.0)
    with pytest.raises(RuntimeError):
        leader.flush_answers(1.0)  # the bundle was read off the ring, then could not be sent
    leader.answer(report("mine"), 1.0)
    leader.close()
    assert world.left == {2: [ack(1), report("mine")], 3: [ack(1)], 4: [ack(1)]}


def test_a_rings_error_says_how_its_ring_ranks_map_to_ranks_where_they_differ() -> None:
    leader = hosts_transport(World(2), Leaders(), Ring({}, gone={1: "died (pid 7)"}))
    with pytest.raises(
        PeerLost, match=r"^worker rank\(s\) \[1\] died .* \(this host's ring numbers ranks \[2, 3, 4\] from 0\)$"
    ):
        leader.receive(1.0)
    head = hosts_transport(World(0), Leaders(), Ring({}, gone={1: "died (pid 7)"}))
    with pytest.raises(PeerLost, match=r"reach every worker$"):  # the head's host: ring ranks are ranks
        head.send([b"\0" * 12], 1.0)


def test_a_reader_that_answers_and_leaves_while_the_leader_looks_is_not_named_lost() -> None:
    ring = Ring({1: [None], 2: [None]}, gone={2: "closed its transport"})
    ring.leaving = {1: ("closed its transport", [ack(1)])}  # its acknowledgement, then gone, between two looks
    head, _ = head_with(bundle_of(ring, [ack(1)]))
    assert head.receive_answers(3, 1.0) == [ack(1)]
    with pytest.raises(PeerLost, match="worker rank 4 closed its transport"):
        head.receive_answers(4, 1.0)


def test_a_leader_that_fails_while_it_reads_leaves_what_it_had_read_and_its_own_in_the_store() -> None:
    world = World(2)
    ring = Ring({1: [[report("three"), ack(1)]], 2: [None]})  # rank 3's read, then the ring fails at rank 4's
    leader = hosts_transport(world, Leaders(), ring)
    leader.answer(ack(1), 1.0)
    original = ring.receive_answers

    def fails_at_the_second_reader(rank: int, timeout: float | None) -> list[bytes]:
        if rank == 2:
            raise OSError("the ring's memory is gone")
        return original(rank, timeout)

    ring.receive_answers = fails_at_the_second_reader  # type: ignore[method-assign]
    with pytest.raises(OSError):
        leader.flush_answers(1.0)
    leader.close()
    assert world.left == {2: [ack(1)], 3: [report("three"), ack(1)]}


def test_a_bundle_with_another_hosts_rank_is_refused_as_corrupt() -> None:
    head, _ = head_with([rank.to_bytes(4, sys.byteorder) + ack(1) for rank in (2, 1)])
    with pytest.raises(TransportCorrupt, match=r"held answers of rank\(s\) \[1\], of other hosts"):
        head.receive_answers(2, 1.0)


def test_a_leaders_transport_that_fails_to_close_still_leaves_the_ring_and_the_whole_group_closed() -> None:
    world = World(2)
    leaders = Leaders()

    def refuses() -> None:
        raise RuntimeError("the leaders' group is gone")

    leaders.close = refuses  # type: ignore[method-assign]
    ring = Ring({})
    closed: list[str] = []
    ring.close = lambda: closed.append("ring")  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the leaders' group is gone"):
        hosts_transport(world, leaders, ring).close()
    assert closed == ["ring"] and world.closed


def test_last_words_are_appended_on_a_store_with_append_and_on_one_without() -> None:
    from torch._C._distributed_c10d import HashStore, Store

    from metrale_model_engine._torch.answers import append_text

    class WithoutAppend(Store):  # a Store written in Python: torch's append says "Not implemented"
        def __init__(self) -> None:
            super().__init__()
            self.values: dict[str, bytes] = {}

        def set(self, key: str, value: str | bytes) -> None:
            self.values[key] = value.encode() if isinstance(value, str) else value

        def get(self, key: str) -> bytes:
            return self.values[key]

        def check(self, keys: list[str]) -> bool:
            return all(key in self.values for key in keys)

    for store in (HashStore(), WithoutAppend()):
        append_text(store, "words", "ab")
        append_text(store, "words", "cd")
        assert store.get("words") == b"abcd", type(store).__name__
