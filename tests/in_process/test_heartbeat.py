"""Liveness across hosts (``metrale_model_engine._torch.heartbeat``): workers beat in a real ``TCPStore``.

The head's watch names the workers whose beat stopped, and not those that left; while
the head waits, workers silent past its bound are lost, and a paused one that beats
again is not; the watch ends the head's wait by shutting down gloo's connections
alone.  A store of another kind gives no heartbeat; bad arguments are refused
before any group is touched.  A worker ending its process when the store is lost:
``tests/programs/test_heartbeat.py``; the head ending its wait on lost workers in a
group: ``tests/ranks/test_torch.py``.  The head waiting for a re-form's check-ins reads the
beats where the workers beat: a live worker late to check in is waited for.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import cast

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore

from metrale_model_engine._torch import heartbeat, severing
from metrale_model_engine._torch.heartbeat import Heartbeat
from metrale_model_engine._torch.regroup import GroupRegroup, beats_of
from metrale_model_engine._torch.severing import connect_to, published_values, sever_group_connections
from metrale_model_engine._torch.watch import HeadWatch
from metrale_model_engine.torch import TorchTransport, free_port, open_link, open_transport

pytestmark = pytest.mark.torch

PERIOD = 0.02


@pytest.fixture
def store() -> Iterator[TCPStore]:
    served = TCPStore(
        "127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )
    yield served
    del served


def test_the_head_names_the_workers_whose_beat_stopped_and_not_those_that_left(store: TCPStore) -> None:
    one, two = (Heartbeat.start("g", store, rank, PERIOD, None) for rank in (1, 2))
    reader, other_group = (HeadWatch.start(name, store, [1, 2, 3], PERIOD, None) for name in ("g", "another group"))
    assert one is not None and two is not None and reader is not None and other_group is not None
    assert reader.silent([1, 2, 3]) == [3]  # rank 3 never beat
    assert other_group.silent([1, 2]) == [1, 2]  # the counters are the group's own
    two.stop()  # it left the run, and says so
    assert reader.silent([1, 2]) == []
    reader.stop()
    other_group.stop()
    left = "metrale_model_engine/heartbeat/g/2/left"
    assert store.check([left])
    again = Heartbeat.start("g", store, 2, PERIOD, None)  # a later transport of rank 2 has not left
    assert again is not None
    assert not store.check([left])
    again.stop()
    one.stop()
    one.stop()  # idempotent


def test_a_store_other_than_tcp_gives_no_heartbeat() -> None:
    store = HashStore()
    assert Heartbeat.start("g", store, 1, PERIOD, 1.0) is None
    prefixed = PrefixStore("p", store)
    assert Heartbeat.start("g", prefixed, 1, PERIOD, 1.0) is None


@pytest.mark.parametrize(
    ("arguments", "error", "text"),
    [
        ({"heartbeat": 0}, ValueError, r"heartbeat must be a finite number of seconds > 0 or None, got int 0"),
        ({"heartbeat": "1"}, TypeError, r"heartbeat must be a finite number of seconds > 0 or None, got str '1'"),
        (
            {"head_lost_after": float("inf")},
            ValueError,
            r"head_lost_after must be a finite number of seconds > 0 or None, got float inf",
        ),
        ({"head_lost_after": -1}, ValueError, r"head_lost_after must be a finite number of seconds > 0 or None"),
        (
            {"heartbeat": 0.5, "head_lost_after": 1.5},
            ValueError,
            r"head_lost_after=1\.5 must be at least 4 heartbeats \(4 x heartbeat=0\.5 = 2 s\)",
        ),
    ],
)
def test_heartbeat_arguments_are_refused_before_the_group_is_touched(
    arguments: dict[str, object], error: type[Exception], text: str
) -> None:
    assert not dist.is_initialized()
    with pytest.raises(error, match=text):
        TorchTransport(**arguments)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        open_transport("torch", **arguments)  # type: ignore[arg-type]
    with pytest.raises(error, match=text):
        open_link("torch", num_slots=1, **arguments)  # type: ignore[arg-type]


def test_a_worker_whose_beat_cannot_connect_is_not_taken_for_silent(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(store: TCPStore) -> TCPStore:
        raise RuntimeError(f"{store.host}:{store.port} refused the connection")

    monkeypatch.setattr(heartbeat, "connect_to", refuse)
    assert Heartbeat.start("g", store, 1, PERIOD, 1.0) is None
    monkeypatch.undo()
    reader = HeadWatch.start("g", store, [1, 2], PERIOD, None)
    assert reader is not None
    assert reader.silent([1, 2]) == [2]
    reader.stop()


@pytest.mark.serial  # beats 0.08 s inside their bound
def test_while_the_head_waits_workers_silent_past_the_bound_are_lost_and_one_that_beats_again_is_not(
    store: TCPStore,
) -> None:
    one = Heartbeat.start("g", store, 1, PERIOD, None)
    watch = HeadWatch.start("g", store, [1, 2], PERIOD, 10 * PERIOD)
    assert one is not None and watch is not None
    one.stop()  # rank 1 leaves: not lost
    time.sleep(20 * PERIOD)
    assert watch.lost() == {}  # rank 2 never beat, but the head waits on nothing
    with watch.blocking():
        for _ in range(20):  # rank 2 beats (the test beats for it), paused once for less than the bound
            store.add("metrale_model_engine/heartbeat/g/2", 1)
            time.sleep(PERIOD if _ != 10 else 6 * PERIOD)
        assert watch.lost() == {}
        stopped = time.monotonic()  # its beat stops without a word: a cut cable, a machine gone
        while not watch.lost() and time.monotonic() < stopped + 100 * PERIOD:
            time.sleep(PERIOD / 2)
        found = time.monotonic() - stopped
    (seconds,) = watch.lost().values()
    assert list(watch.lost()) == [2]
    assert seconds >= 10 * PERIOD and found < 10 * PERIOD + 5.0  # slack: a reading a beat late on a loaded machine
    watch.stop()


@pytest.mark.serial  # a live worker's beats must keep their period
def test_the_first_worker_past_the_bound_is_named_with_every_worker_silent_by_then(store: TCPStore) -> None:
    """A host's two ranks fall silent a reading apart: one stop names both, and not the rank still beating."""
    period = 0.1
    live = Heartbeat.start("g", store, 3, period, None)
    watch = HeadWatch.start("g", store, [1, 2, 3], period, 10 * period)
    assert live is not None and watch is not None
    with watch.blocking():
        for beat in range(12):  # the test beats for ranks 1 and 2; rank 2 stops two beats after rank 1
            for rank in (1, 2) if beat < 8 else (2,) if beat < 10 else ():
                store.add(f"metrale_model_engine/heartbeat/g/{rank}", 1)
            time.sleep(period)
        deadline = time.monotonic() + 30 * period
        while not watch.lost() and time.monotonic() < deadline:
            time.sleep(period / 2)
    lost = watch.lost()
    assert sorted(lost) == [1, 2], lost
    assert lost[1] >= 10 * period and lost[2] >= 4 * period, lost
    watch.stop()
    live.stop()


def test_a_later_transports_beat_is_not_told_by_the_head_of_an_earlier_epoch(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-formed link's next group bears the same name, and a survivor may keep its rank: the run-over word the
    head of the epoch before added to its counter does not end the new epoch's waits; the new head's word does."""
    severed: list[TCPStore] = []

    def sever(tcp: TCPStore) -> int:
        severed.append(tcp)
        return 0

    monkeypatch.setattr(heartbeat, "sever_group_connections", sever)
    key = heartbeat.beat_key("g", 1)
    store.add(key, heartbeat.RUN_OVER)  # the epoch before: its head found workers lost and told rank 1
    beat = Heartbeat.start("g", store, 1, PERIOD, None)
    assert beat is not None
    time.sleep(10 * PERIOD)
    assert severed == [] and 0 < store.add(key, 0) < heartbeat.RUN_OVER
    store.add(key, heartbeat.RUN_OVER)  # this epoch's head tells it
    deadline = time.monotonic() + 100 * PERIOD
    while not severed and time.monotonic() < deadline:
        time.sleep(PERIOD)
    beat.stop()
    assert len(severed) == 1


@pytest.mark.serial  # a live worker's beats must keep their period
def test_the_head_waiting_for_a_re_forms_check_ins_names_only_the_workers_whose_beat_stopped(store: TCPStore) -> None:
    """Worker 1 beats and worker 3 left its transport (``left``), both check in late; worker 2 never beats: only it
    is lost, though the group's store (where the transports beat) is the ``TCPStore`` under prefixes."""
    period, late = 0.1, 1.2  # late: three times the silence the head allows (four beats)
    dist.init_process_group("gloo", store=PrefixStore("link/0/world/", store), rank=0, world_size=1)
    transport = TorchTransport(heartbeat=period, head_lost_after=None)
    world = dist.group.WORLD
    assert world is not None
    beating, leaving = (Heartbeat.start(world.group_name, world.get_group_store(), r, period, None) for r in (1, 3))
    assert beating is not None and leaving is not None
    leaving.stop()
    idle = datetime.timedelta(seconds=5)
    regroups = [GroupRegroup(connect_to(store) if rank else store, "link", rank, period, beats_of(transport, period),
                             lambda: transport, "gloo", None, idle) for rank in (0, 1, 3)]  # fmt: skip
    told: dict[int, tuple[int, list[int]]] = {}

    def check_in(regroup: GroupRegroup, rank: int) -> None:
        time.sleep(late)
        told[rank] = regroup.join(1, rank, dict, time.monotonic() + 10.0)

    workers = [threading.Thread(target=check_in, args=(regroups[i], rank)) for i, rank in ((1, 1), (2, 3))]
    for worker in workers:
        worker.start()
    lost: dict[int, str] = {}
    try:
        members = regroups[0].survivors(1, [0, 1, 2, 3], lost, dict, time.monotonic() + 10.0)
    finally:
        regroups[0].end()  # the workers' wait for the members ends
        for worker in workers:
            worker.join(15.0)
        beating.stop()
        transport.close()
        dist.destroy_process_group()
    assert members == [0, 1, 3], lost
    assert list(lost) == [2] and lost[2].startswith("fell silent: no heartbeat for "), lost
    assert told == {1: (1, []), 3: (1, [])}


def test_the_watch_shuts_down_gloos_connections_and_no_other(store: TCPStore) -> None:
    other = connect_to(store)  # a connection of the program's own, to an address no rank published
    before = other.add("x", 1)
    assert sever_group_connections(store) == 0  # no group here: nothing of gloo's to end
    assert other.add("x", 1) == before + 1


class Published:
    """A store's reader whose one record holds a ``sockaddr_in``, as gloo's rendezvous records hold each rank's."""

    def __init__(self, address: tuple[str, int]) -> None:
        host, port = address
        self._record = socket.AF_INET.to_bytes(2, sys.byteorder) + port.to_bytes(2, "big") + socket.inet_aton(host)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Its one read answers at once."""

    def list_keys(self) -> list[str]:
        return ["rank0"]

    def get(self, key: str) -> bytes:
        return self._record


def test_a_key_deleted_since_it_was_listed_costs_the_severing_a_second_not_the_stores_timeout(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's own reads wait for a missing key as long as its timeout (5 s here; days for a rendezvous
    store): the severing reads through a connection of its own, each read bounded by a second."""
    store.set("rank0", "first")
    store.set("rank1/left", "1")
    store.set("rank2", "second")
    connect = severing.connect_to
    readers: list[TCPStore] = []

    def reader_after_a_deletion(of: TCPStore) -> TCPStore:
        store.delete_key("rank1/left")  # a heartbeat starting between the listing and the reads
        readers.append(connect(of))
        return readers[-1]

    monkeypatch.setattr(severing, "connect_to", reader_after_a_deletion)
    started = time.monotonic()
    values = published_values(store)
    assert time.monotonic() - started < 3.0  # the read's bound, not the store's 5 s
    assert len(readers) == 1  # read through a connection of its own
    assert sorted(values.split(b"\0")) == [b"first", b"second"]


def test_a_severing_whose_stores_server_is_gone_gives_up_at_once() -> None:
    """The head killed: its store went with it, and a worker's severing must not spend a connect's retries on it."""
    served = TCPStore(
        "127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )
    client = connect_to(served)
    del served  # the server stops with its last reference
    started = time.monotonic()
    assert sever_group_connections(client) == 0
    assert time.monotonic() - started < 3.0  # a new connection would retry for 10 s


def test_a_descriptor_reused_since_it_was_read_is_not_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The program's own socket read, when the descriptors were listed, as one of gloo's: it is another now."""
    with socket.create_server(("127.0.0.1", 0)) as gloos, socket.create_server(("127.0.0.1", 0)) as programs:
        gloo = socket.create_connection(gloos.getsockname())
        gloo_end, _ = gloos.accept()  # this process holds both ends: each has an end at the published address
        own = socket.create_connection(programs.getsockname())
        own_end, _ = programs.accept()
        read = os.readlink
        as_gloos = read(f"/proc/self/fd/{gloo.fileno()}")
        monkeypatch.setattr(
            os, "readlink", lambda path: as_gloos if path == f"/proc/self/fd/{own.fileno()}" else read(path)
        )
        records = Published(gloos.getsockname())
        monkeypatch.setattr(severing, "connect_to", lambda _: records)
        assert sever_group_connections(cast(TCPStore, records)) == 2  # gloo's two ends
        monkeypatch.undo()
        own.sendall(b"x")
        assert own_end.recv(1) == b"x"  # the program's own connection still carries its byte
        assert gloo_end.recv(1) == b""  # gloo's is shut down
        for connection in (gloo, gloo_end, own, own_end):
            connection.close()
