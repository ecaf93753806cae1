"""The shared-memory ring in one process: a head and its workers as transports, readers in threads."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from metrale_model_engine import (
    EpProtocol,
    EpReceiveError,
    EpSendError,
    EpSetupError,
    SequenceState,
    WireEp,
    _futex,
    _segment,
    shm,
)
from metrale_model_engine._liveness import ProcessWatch
from metrale_model_engine.shm import ShmTransport

pytestmark = pytest.mark.skipif(not shm.shm_supported(), reason="the shared-memory transport needs Linux x86-64/arm64")

T = TypeVar("T")


@pytest.fixture
def pair() -> Iterator[tuple[ShmTransport, ShmTransport]]:
    """A head and its one worker, in this process, on a ring of four 128-byte records (64-byte chunks)."""
    head = ShmTransport.create(2, ring_bytes=512, chunk_bytes=64)
    worker = ShmTransport.attach(head.name, 1)
    yield head, worker
    worker.close()
    head.close()


def payload(seq: int, words: int) -> array[int]:
    """Words that say which message they belong to and where: a torn or stale read shows."""
    return array("I", [(seq * 1_000_003 + i) & 0xFFFF_FFFF for i in range(words)])


def receive(worker: ShmTransport, words: int, timeout: float | None = 5.0) -> array[int]:
    buffer = array("I", bytes(4 * words))
    worker.bind(buffer)(timeout)
    return buffer


def in_thread(function: Callable[[], T]) -> Callable[[], T]:
    """Start ``function`` in a thread; the returned call joins it and returns (or raises) its result."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(function())
        except BaseException as error:  # noqa: BLE001  (handed to the joining test)
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> T:
        thread.join(30)
        assert not thread.is_alive(), "the thread did not finish"
        if failure:
            raise failure[0]
        return outcome[0]

    return join


# -- the ring --------------------------------------------------------------------


@pytest.mark.parametrize("words", [0, 1, 16, 17, 1000])
def test_a_message_of_any_length_arrives_whole(pair: tuple[ShmTransport, ShmTransport], words: int) -> None:
    head, worker = pair
    sent = payload(9, words)
    got = in_thread(lambda: receive(worker, words))
    head.bind(sent)(5.0)  # 1000 words: 63 records through a ring of 4, so the reader must keep up
    assert got() == sent


def test_fifo_through_a_full_ring_with_a_slow_reader(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 15, 16, 17, 40, 300]) for _ in range(400)]

    def read_all() -> list[array[int]]:
        got = []
        for index, words in enumerate(sizes):
            if index % 50 == 0:
                time.sleep(0.01)  # the head fills the ring and waits for room
            got.append(receive(worker, words))
        return got

    got = in_thread(read_all)
    for seq, words in enumerate(sizes):
        head.bind(payload(seq, words))(5.0)
    assert got() == [payload(seq, words) for seq, words in enumerate(sizes)]


def test_positions_past_the_32_bit_boundary(pair: tuple[ShmTransport, ShmTransport]) -> None:
    """The futex word is the low half of a u64 stamp or counter: crossing 2**32 changes nothing."""
    head, worker = pair
    start = 2**32 - 3 * 128
    # Test-only surgery: both ranks as if 2**32 - 384 bytes had gone through already.
    segment = head._segment
    segment.u64[segment.layout.reader_at(0) // 8] = start
    head._next = worker._next = start
    head._room_until = start + segment.layout.ring_bytes
    got = in_thread(lambda: [receive(worker, 16) for _ in range(12)])
    for seq in range(12):
        head.bind(payload(seq, 16))(5.0)
    assert got() == [payload(seq, 16) for seq in range(12)]
    assert head._next == worker._next == start + 12 * 128  # 16 words: one 128-byte record each


def test_a_receive_of_another_length_names_both_and_consumes_the_message(
    pair: tuple[ShmTransport, ShmTransport],
) -> None:
    head, worker = pair
    head.bind(payload(0, 40))(1.0)
    with pytest.raises(EpReceiveError, match="a message of 40 words, but this rank expected 39 words"):
        receive(worker, 39)
    with pytest.raises(EpSendError, match="worker rank 1 stopped: its receive failed"):
        head.bind(payload(1, 1))(1.0)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), 0.05])
def test_a_receive_times_out(pair: tuple[ShmTransport, ShmTransport], timeout: float) -> None:
    _, worker = pair
    started = time.monotonic()
    with pytest.raises(EpReceiveError, match="timed out: no message from the head"):
        receive(worker, 1, timeout)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("timeout", [0, -5.0, 0.05])
def test_a_full_ring_fails_the_head_after_its_timeout(pair: tuple[ShmTransport, ShmTransport], timeout: float) -> None:
    head, _ = pair
    for seq in range(3):  # three 128-byte records, and the stamp after them: 392 of 512 bytes
        head.bind(payload(seq, 16))(timeout)  # room: no waiting, whatever the timeout
    started = time.monotonic()
    with pytest.raises(EpSendError, match=r"the ring stayed full .*worker rank\(s\) \[1\] did not read"):
        head.bind(payload(3, 16))(timeout)
    assert time.monotonic() - started < 1.0


def test_a_closed_worker_fails_the_heads_next_send(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    worker.close()
    worker.close()  # idempotent
    with pytest.raises(EpSendError, match="worker rank 1 closed its transport"):
        head.bind(payload(0, 1))(1.0)
    with pytest.raises(EpReceiveError, match="was closed"):
        receive(worker, 1)


def test_a_closed_head_ends_the_workers_wait_after_what_it_published(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    head.bind(payload(0, 3))(1.0)
    head.close()
    assert head.closed
    assert receive(worker, 3, None) == payload(0, 3)  # published before the close: delivered
    with pytest.raises(EpReceiveError, match="the head closed the ring"):
        receive(worker, 3, None)
    with pytest.raises(EpSendError, match="was closed"):
        head.bind(payload(1, 1))(1.0)


def test_a_parked_worker_is_woken(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    got = in_thread(lambda: (receive(worker, 2, None), time.perf_counter()))
    time.sleep(0.2)  # past the spin time: the worker sleeps on the futex
    assert head._segment.bytes[_segment.PARKED_AT] == 1
    sent_at = time.perf_counter()
    head.bind(payload(0, 2))(1.0)
    received, received_at = got()
    assert received == payload(0, 2)
    assert received_at - sent_at < 0.5 * shm.CHECK_INTERVAL  # woken, not timed out of its nap


# -- gather, setup, lifecycle ---------------------------------------------------


def test_gather_collects_every_rank_and_removes_the_name() -> None:
    head = ShmTransport.create(3)
    workers = [ShmTransport.attach(head.name, rank) for rank in (1, 2)]
    path = Path("/dev/shm", head.name)
    assert path.exists()
    joins = [in_thread(lambda w=worker: w.gather([w.rank, 7])) for worker in workers]  # type: ignore[misc]
    expected = [[0, 7], [1, 7], [2, 7]]
    assert head.gather([0, 7]) == expected
    assert [join() for join in joins] == [expected, expected]
    assert not path.exists()  # every worker attached: nothing can leak from here on
    joins = [in_thread(lambda w=worker: w.gather([w.rank])) for worker in workers]  # type: ignore[misc]
    with pytest.raises(EpSetupError, match=r"different word counts \(rank 0: 2, rank 1: 1, rank 2: 1\)"):
        head.gather([1, 2])
    for join in joins:
        with pytest.raises(EpSetupError, match="different word counts"):
            join()
    for transport in (*workers, head):
        transport.close()


def test_gather_refuses_what_is_not_13_u32_words(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, _ = pair
    with pytest.raises(ValueError, match="at most 13 u32 words"):
        head.gather(list(range(14)))
    with pytest.raises(ValueError, match="at most 13 u32 words"):
        head.gather([-1])


def test_gather_gives_up_after_the_setup_timeout() -> None:
    with ShmTransport.create(3, setup_timeout=0.2) as head:
        ShmTransport.attach(head.name, 1).close()
        with pytest.raises(EpSetupError, match=r"within setup_timeout=0.2 s; rank\(s\) \[2\] never attached"):
            head.gather([0])


def test_wire_models_agree_over_the_ring() -> None:
    head = ShmTransport.create(2)
    worker_side = ShmTransport.attach(head.name, 1)
    built = in_thread(lambda: WireEp[SequenceState](worker_side, num_slots=4, protocol=EpProtocol.V2))
    model = WireEp[SequenceState](head, num_slots=4, protocol=EpProtocol.V2)
    worker = built()
    assert isinstance(worker, WireEp) and worker.rank == 1 and model.is_ep()
    model.ep_broadcast_cmd(5)
    assert worker.ep_recv_word() == 5
    worker_side.close()
    head.close()


def test_a_stale_segment_of_a_dead_process_is_removed_and_never_reused(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    stale = Path("/dev/shm", f"{_segment.NAME_PREFIX}{child.pid}-0123456789abcdef")
    stale.write_bytes(bytes(8192))
    with ShmTransport.create(2) as head:
        assert not stale.exists()
        assert head.name != stale.name


def test_attach_refuses_what_is_not_a_live_ring() -> None:
    with pytest.raises(EpSetupError, match="no shared-memory segment"):
        ShmTransport.attach(f"{_segment.NAME_PREFIX}{os.getpid()}-missing", 1)
    with pytest.raises(ValueError, match="is not a segment name of this library"):
        ShmTransport.attach("psm_other", 1)
    garbage = Path("/dev/shm", f"{_segment.NAME_PREFIX}{os.getpid()}-garbage")
    garbage.write_bytes(bytes(8192))
    try:
        with pytest.raises(EpSetupError, match="is not a ring of this library's layout version 1"):
            ShmTransport.attach(garbage.name, 1)
    finally:
        garbage.unlink()
    with ShmTransport.create(2) as head:
        with pytest.raises(ValueError, match=r"rank=2 is out of range for the ring's world_size=2 \(1 ..= 1\)"):
            ShmTransport.attach(head.name, 2)
        with (
            ShmTransport.attach(head.name, 1),
            pytest.raises(EpSetupError, match=r"rank 1 of ring .* is attached already, by pid"),
        ):
            ShmTransport.attach(head.name, 1)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"world_size": 2.0}, TypeError, "world_size must be an int in 1 ..= 64, got float"),
        ({"world_size": 0}, ValueError, r"world_size=0 is out of range \(1 ..= 64\)"),
        ({"world_size": 65}, ValueError, r"world_size=65 is out of range"),
        ({"ring_bytes": 192, "chunk_bytes": 64}, ValueError, r"ring_bytes=192 is out of range \(256 ..= "),
        ({"ring_bytes": True}, TypeError, "ring_bytes must be an int"),
        ({"ring_bytes": 300_016}, ValueError, "ring_bytes must be a multiple of 64, got 300016"),
        ({"chunk_bytes": 100}, ValueError, "chunk_bytes must be a multiple of 64, got 100"),
        ({"chunk_bytes": 0}, ValueError, r"chunk_bytes=0 is out of range \(64 ..= "),
        ({"spin_time": -1.0}, ValueError, "spin_time must be a finite number of seconds >= 0, got -1.0"),
        ({"spin_time": float("inf")}, ValueError, "spin_time must be"),
        ({"spin_time": "1"}, TypeError, "spin_time must be a finite number of seconds >= 0, got str"),
        ({"setup_timeout": 0}, ValueError, "setup_timeout must be a finite number of seconds > 0, got 0"),
        ({"setup_timeout": True}, TypeError, "setup_timeout must be"),
    ],
)
def test_create_checks_its_arguments(arguments: dict[str, object], error: type[Exception], message: str) -> None:
    options: dict[str, object] = {"world_size": 2, **arguments}
    with pytest.raises(error, match=message):
        ShmTransport.create(**options)  # type: ignore[arg-type]


def test_attach_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="name must be a str"):
        ShmTransport.attach(b"name", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank=0 is out of range \(1 ..= 63\)"):
        ShmTransport.attach("metrale-ep-1-x", 0)
    with pytest.raises(ValueError, match="spin_time must be"):
        ShmTransport.attach("metrale-ep-1-x", 1, spin_time=-0.5)


def test_a_small_dev_shm_is_reported_before_anything_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs("/dev/shm")

    class Small:
        f_bavail, f_frsize = 1, real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: Small())
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError, match=r"/dev/shm has 0.0 MiB free, too little for the ring's 1.0 MiB") as raised:
        ShmTransport.create(2)
    assert raised.value.errno == errno.ENOSPC
    assert set(os.listdir("/dev/shm")) == before


def test_an_unsupported_platform_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_futex, "SUPPORTED", False)
    assert not shm.shm_supported()
    with pytest.raises(RuntimeError, match="the shared-memory transport needs Linux on x86-64 or arm64"):
        ShmTransport.create(2)


def test_close_releases_the_mapping_and_the_name() -> None:
    head = ShmTransport.create(2)
    path = Path("/dev/shm", head.name)
    head.close()  # no BufferError: every view of the mapping is released first
    head.close()
    assert not path.exists() and head.closed
    assert "closed" in repr(head)


def test_a_dropped_head_removes_its_name() -> None:
    head = ShmTransport.create(2)
    path = Path("/dev/shm", head.name)
    del head
    assert not path.exists()


# -- the primitives underneath ---------------------------------------------------


def test_process_watch_sees_an_exit() -> None:
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.3,))
    child.start()
    assert child.pid is not None
    watch = ProcessWatch()
    watch.add(child.pid)
    watch.add(child.pid)  # once is enough
    watch.add(os.getpid())
    assert len(watch) == 2 and watch.dead() == []
    child.join()
    assert watch.dead() == [child.pid]
    watch.close()
    assert len(watch) == 0 and watch.dead() == []


def test_futex_wait_returns_at_once_when_the_word_moved_and_sleeps_until_woken() -> None:
    word = array("I", [5])
    address = word.buffer_info()[0]
    started = time.monotonic()
    _futex.futex_wait(address, 4, 5.0)  # not 4: no sleep
    assert time.monotonic() - started < 1.0

    def sleep_on_five() -> float:
        _futex.futex_wait(address, 5, 10.0)
        return time.monotonic()

    woke = in_thread(sleep_on_five)
    time.sleep(0.1)
    word[0] = 6
    _futex.futex_wake(address)
    assert woke() - started < 5.0
