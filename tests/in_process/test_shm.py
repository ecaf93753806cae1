"""The shared-memory ring in one process: a head and its workers as transports, readers in threads."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import threading
import time
from array import array
from collections.abc import Callable, Iterator, MutableSequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from metrale_model_engine import (
    EpLink,
    EpLinkError,
    EpReceiveError,
    EpSendError,
    ProtocolVersion,
    SequenceState,
    shm,
)
from metrale_model_engine._host.liveness import ProcessWatch
from metrale_model_engine._shm import futex as _futex
from metrale_model_engine._shm import segment as _segment
from metrale_model_engine.shm import ShmTransport
from metrale_model_engine.transport import PeerLost, TransportClosed, TransportCorrupt, TransportTimeout

from helpers.fakes import ignore, no_slots

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


def send(head: ShmTransport, message: array[int], timeout: float | None = 5.0) -> None:
    head.send((message,), timeout)


def receive(worker: ShmTransport, timeout: float | None = 5.0) -> array[int]:
    return array("I", worker.receive(timeout).tobytes())


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
    got = in_thread(lambda: receive(worker))
    send(head, sent, 5.0)  # 1000 words: 63 records through a ring of 4, so the reader must keep up
    assert got() == sent


def test_fifo_through_a_full_ring_with_a_slow_reader(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 15, 16, 17, 40, 300]) for _ in range(400)]

    def read_all() -> list[array[int]]:
        got = []
        for index in range(len(sizes)):
            if index % 50 == 0:
                time.sleep(0.01)  # the head fills the ring and waits for room
            got.append(receive(worker))
        return got

    got = in_thread(read_all)
    for seq, words in enumerate(sizes):
        send(head, payload(seq, words), 5.0)
    assert got() == [payload(seq, words) for seq, words in enumerate(sizes)]


def test_positions_past_the_32_bit_boundary(pair: tuple[ShmTransport, ShmTransport]) -> None:
    """The futex word is the low half of a u64 stamp or counter: crossing 2**32 changes nothing."""
    head, worker = pair
    start = 2**32 - 3 * 128
    # Test-only surgery: both ranks as if 2**32 - 384 bytes had gone through already.
    segment = head._segment
    segment.u64[segment.layout.reader_at(0) // 8] = start
    writer, reader = head._writer, worker._reader
    assert writer is not None and reader is not None
    writer._next = reader._next = start
    writer._room_until = start + segment.layout.ring_bytes
    got = in_thread(lambda: [receive(worker) for _ in range(12)])
    for seq in range(12):
        send(head, payload(seq, 16), 5.0)
    assert got() == [payload(seq, 16) for seq in range(12)]
    assert writer._next == reader._next == start + 12 * 128  # 16 words: one 128-byte record each


def test_a_worker_whose_receive_failed_is_gone_for_the_head(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    with pytest.raises(TransportTimeout):
        receive(worker, 0)
    with pytest.raises(PeerLost, match="worker rank 1 stopped: its receive failed"):
        send(head, payload(1, 1), 1.0)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), 0.05])
def test_a_receive_times_out(pair: tuple[ShmTransport, ShmTransport], timeout: float) -> None:
    _, worker = pair
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="timed out: no message from the head within"):
        receive(worker, timeout)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("timeout", [0, -5.0, 0.05])
def test_a_full_ring_fails_the_head_after_its_timeout(pair: tuple[ShmTransport, ShmTransport], timeout: float) -> None:
    head, _ = pair
    for seq in range(3):  # three 128-byte records, and the stamp after them: 392 of 512 bytes
        send(head, payload(seq, 16), timeout)  # room: no waiting, whatever the timeout
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"the ring stayed full .*worker rank\(s\) \[1\] did not read"):
        send(head, payload(3, 16), timeout)
    assert time.monotonic() - started < 1.0


@pytest.mark.serial  # within 10 ms
def test_a_send_cut_short_is_never_taken_for_a_whole_message() -> None:
    """The issue's case: a 4 KiB ring, 1 KiB records, 3,072 words sent while the worker does not read."""
    with ShmTransport.create(2, ring_bytes=4096, chunk_bytes=1024) as head, ShmTransport.attach(head.name, 1) as worker:
        send(head, payload(0, 5), 1.0)
        with pytest.raises(TransportTimeout, match=r"the ring stayed full for 0\.05 s"):
            send(head, payload(1, 3072), 0.05)  # three records fit, then the wait for room times out
        started = time.monotonic()
        with pytest.raises(
            TransportClosed, match=r"the ring is broken since an earlier send failed \(the ring stayed full"
        ):
            send(head, payload(2, 3072), 5.0)  # the caller caught the error and goes on: refused at once
        assert time.monotonic() - started < 0.01
        assert receive(worker) == payload(0, 5)  # whole messages before the cut arrive whole
        with pytest.raises(PeerLost, match=r"a send of the head failed after 3072 of the 12288 bytes of its"):
            receive(worker)
        assert head._segment.bytes[_segment.GONE_AT] == _segment.GONE_FAILED  # the worker left, and says so


def test_a_send_that_fails_before_publishing_ends_the_ring_after_the_whole_messages(
    pair: tuple[ShmTransport, ShmTransport],
) -> None:
    head, worker = pair
    for seq in range(3):
        send(head, payload(seq, 16), 1.0)
    with pytest.raises(TransportTimeout, match="the ring stayed full"):
        send(head, payload(3, 100), 0)  # no room for its first record: nothing of it is published
    for seq in range(3):
        assert receive(worker) == payload(seq, 16)
    with pytest.raises(PeerLost, match="a send of the head failed; the ring is broken, nothing more comes"):
        receive(worker)


@pytest.mark.parametrize("forged", ["offset", "total"])
def test_a_record_that_does_not_continue_its_message_is_corruption(
    pair: tuple[ShmTransport, ShmTransport], forged: str
) -> None:
    head, worker = pair
    send(head, payload(0, 32), 1.0)  # 128 bytes: two records of 64
    second = head._segment.layout.ring_at + 128  # the second record's line: stamp, total, offset
    field = 2 if forged == "offset" else 1
    head._segment.u64[(second >> 3) + field] += 4
    with pytest.raises(TransportCorrupt, match="the ring is corrupt: the record at position 128 holds bytes from"):
        receive(worker)


def _reader_outcomes(worker: ShmTransport, sizes: list[int], stalls: dict[int, float]) -> list[array[int] | str]:
    """Receive every message in order, sleeping before some; stop at the first error (its text)."""
    outcomes: list[array[int] | str] = []
    for index in range(len(sizes)):
        time.sleep(stalls.get(index, 0.0))
        try:
            outcomes.append(receive(worker, 10.0))
        except (PeerLost, TransportTimeout, TransportCorrupt, TransportClosed) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
            break
    return outcomes


@settings(max_examples=int(os.environ.get("METRALE_RING_EXAMPLES", "40")), deadline=None, derandomize=True)
@given(data=st.data())
def test_every_receive_is_exactly_what_was_sent_or_an_error(data: st.DataObject) -> None:
    """Random rings, records, message sizes up to 3x the ring, stalled readers and short head timeouts.

    Whatever point a send fails at, a reader gets the messages before it exactly, then
    a receive error at the cut message, never a cut or mixed message; the head's
    later sends are refused at once.
    """
    chunk = 64 * data.draw(st.integers(1, 8), label="chunk lines")
    ring = 64 * data.draw(st.integers(2 * (chunk + 64) // 64, 64), label="ring lines")
    readers = data.draw(st.integers(1, 2), label="readers")
    sizes = data.draw(st.lists(st.integers(0, 3 * ring // 4), min_size=1, max_size=10), label="message words")
    timeouts = data.draw(st.lists(st.sampled_from([0.0, 0.002, 0.02, 2.0]), min_size=len(sizes), max_size=len(sizes)))
    stalls = [
        data.draw(st.dictionaries(st.integers(0, len(sizes) - 1), st.sampled_from([0.001, 0.01, 0.04]), max_size=3))
        for _ in range(readers)
    ]
    with ShmTransport.create(readers + 1, ring_bytes=ring, chunk_bytes=chunk) as head:
        workers = [ShmTransport.attach(head.name, rank) for rank in range(1, readers + 1)]
        try:
            joins = [
                in_thread(partial(_reader_outcomes, w, sizes, stall)) for w, stall in zip(workers, stalls, strict=True)
            ]
            failed_at = len(sizes)
            for index, (words, timeout) in enumerate(zip(sizes, timeouts, strict=True)):
                try:
                    send(head, payload(index, words), timeout)
                except (TransportTimeout, PeerLost):
                    failed_at = index
                    break
            if failed_at < len(sizes):
                with pytest.raises(TransportClosed, match="the ring is broken since an earlier send failed"):
                    send(head, payload(failed_at + 1, 1), 2.0)
            head.close()
            for outcomes in (join() for join in joins):
                last = outcomes[-1]
                event("no send failed" if failed_at == len(sizes) else "a send failed")
                if isinstance(last, str):
                    event("a reader saw a cut message" if " after " in last else "a reader saw nothing of it")
                assert outcomes[:failed_at] == [payload(index, words) for index, words in enumerate(sizes[:failed_at])]
                if failed_at < len(sizes):
                    assert len(outcomes) == failed_at + 1
                    assert isinstance(outcomes[-1], str) and "a send of the head failed" in outcomes[-1], outcomes[-1]
                else:
                    assert len(outcomes) == len(sizes)
        finally:
            for worker in workers:
                worker.close()


def test_a_closed_worker_fails_the_heads_next_send(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    worker.close()
    worker.close()  # idempotent
    with pytest.raises(PeerLost, match="worker rank 1 closed its transport"):
        send(head, payload(0, 1), 1.0)
    with pytest.raises(TransportClosed, match="was closed"):
        receive(worker)


def test_a_closed_head_ends_the_workers_wait_after_what_it_published(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    send(head, payload(0, 3), 1.0)
    head.close()
    assert head.closed
    assert receive(worker, None) == payload(0, 3)  # published before the close: delivered
    with pytest.raises(PeerLost, match="the head closed the ring"):
        receive(worker, None)
    with pytest.raises(TransportClosed, match="was closed"):
        send(head, payload(1, 1), 1.0)


@pytest.mark.serial  # woken within half a check interval
def test_a_parked_worker_is_woken(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, worker = pair
    got = in_thread(lambda: (receive(worker, None), time.perf_counter()))
    time.sleep(0.2)  # past the spin time: the worker sleeps on the futex
    assert head._segment.bytes[_segment.PARKED_AT] == 1
    sent_at = time.perf_counter()
    send(head, payload(0, 2), 1.0)
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
    with pytest.raises(
        ValueError, match=r"the ranks disagree on the word count of a gather \(rank 0: 2, rank 1: 1, rank 2: 1\)"
    ):
        head.gather([1, 2])
    for join in joins:
        with pytest.raises(ValueError, match="the ranks disagree on the word count of a gather"):
            join()
    for transport in (*workers, head):
        transport.close()


def test_gather_refuses_what_is_not_13_u32_words(pair: tuple[ShmTransport, ShmTransport]) -> None:
    head, _ = pair
    with pytest.raises(ValueError, match=r"at most 13 u32 words, got 14: \[0, 1, "):
        head.gather(list(range(14)))
    with pytest.raises(ValueError, match=r"^words\[1\]=-1 is outside the u32 range 0 ..= 4294967295"):
        head.gather([0, -1])
    with pytest.raises(TypeError, match=r"^words\[0\] must be an int in 0 ..= 4294967295 \(0xFFFFFFFF\), got bool"):
        head.gather([True])


def test_gather_gives_up_after_the_setup_timeout() -> None:
    with ShmTransport.create(3, setup_timeout=0.2) as head, ShmTransport.attach(head.name, 1) as silent:
        with pytest.raises(TransportTimeout, match=r"within setup_timeout=0.2 s; rank\(s\) \[2\] never attached"):
            head.gather([0])
        assert not silent.closed  # rank 1 is there, open and silent: a rank that closed its end ends a gather at once
        assert head.unanswered() == [1, 2]


def test_a_worker_that_closed_its_end_before_answering_ends_the_gather_at_once() -> None:
    """Alive but gone (its setup failed there): the others' gather ends with ``PeerLost`` naming it, not at the
    setup timeout."""
    with ShmTransport.create(3, setup_timeout=30) as head:
        answered, leaves = ShmTransport.attach(head.name, 1), ShmTransport.attach(head.name, 2)
        first = in_thread(lambda: answered.gather([1]))
        leaves.close()
        began = time.monotonic()
        with pytest.raises(PeerLost, match=r"^rank 0: rank\(s\) \[2\] left the ring before every rank could answer"):
            head.gather([0])
        assert time.monotonic() - began < 10.0  # far from the 30 s of the setup timeout
        assert head.unanswered() == []  # rank 2 left on its own: not silent (a re-form lets it check in again)
        with pytest.raises(PeerLost, match=r"^rank 1: rank\(s\) \[2\] left the ring before every rank could answer"):
            first()
        answered.close()


def test_links_agree_over_the_ring_and_a_command_is_one_record() -> None:
    head_side = ShmTransport.create(2)
    worker_side = ShmTransport.attach(head_side.name, 1)
    built = in_thread(lambda: EpLink(worker_side, num_slots=4, protocol=ProtocolVersion.V2))
    head = EpLink(head_side, num_slots=4, protocol=ProtocolVersion.V2)
    worker = built()
    assert worker.rank == 1 and head.world_size == 2
    head.send_word(5)
    assert worker.recv_word() == 5
    before = head_side._writer._next if head_side._writer else 0
    head.send_command(1, 0xFFFFFFE0, 64, list(range(64)), list(range(1000, 1064)))
    assert head_side._writer is not None and head_side._writer._next - before == 640  # one record: a line + 548 bytes
    seen: list[tuple[int, int, int, list[int], list[int]]] = []

    def run(seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        seen.append((seq_id, cmd, worker.recv_word(), worker.recv_tokens(), worker.recv_tokens()))

    assert worker.step(run, no_slots()) is True
    assert seen == [(1, 0xFFFFFFE0, 64, list(range(64)), list(range(1000, 1064)))]
    worker.close()
    head.close()
    assert worker_side.closed and head_side.closed


@pytest.mark.serial  # plants a segment in /dev/shm, which any ring's create may sweep
def test_a_stale_segment_of_a_dead_process_is_removed_and_never_reused(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    stale = Path("/dev/shm", f"{_segment.NAME_PREFIX}{child.pid}-0123456789abcdef")
    stale.write_bytes(bytes(8192))
    with ShmTransport.create(2) as head:
        assert not stale.exists()
        assert head.name != stale.name


def _stale_name_of_a_dead_process() -> str:
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    return f"{_segment.NAME_PREFIX}{child.pid}-{os.urandom(8).hex()}"


@pytest.mark.serial  # plants a segment in /dev/shm, which any ring's create may sweep
def test_a_stale_segment_that_cannot_be_removed_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm is sticky: another user's stale segment cannot be removed, and must not stop this run."""
    stale = Path("/dev/shm", _stale_name_of_a_dead_process())
    stale.write_bytes(b"")
    real_unlink = os.unlink

    def unlink(path: str) -> None:
        if os.path.basename(path) == stale.name:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    try:
        assert stale.name not in _segment.remove_stale_segments()
        with ShmTransport.create(2) as head:
            assert head.name.startswith(_segment.NAME_PREFIX) and stale.exists()
    finally:
        real_unlink(stale)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a part of the test as a second uid")
@pytest.mark.serial  # plants a segment in /dev/shm, which any ring's create may sweep
@pytest.mark.serial  # plants a segment in /dev/shm, which any ring's create may sweep
def test_another_users_stale_segment_never_blocks_a_create() -> None:
    """A segment root left behind, and a create by uid 65534 (nobody) in a forked child, as on a shared host."""
    stale = Path("/dev/shm", _stale_name_of_a_dead_process())
    stale.write_bytes(bytes(4096))  # owned by root, mode 0644, in the sticky /dev/shm
    receive, send = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the interpreter is loaded already, so dropping privileges costs no file access
        outcome = "no outcome"
        try:
            os.setgid(65534)
            os.setuid(65534)
            with ShmTransport.create(2) as head:
                outcome = f"created {head.name} as uid {os.getuid()}"
        except BaseException as error:  # noqa: BLE001  (reported to the parent)
            outcome = f"{type(error).__name__}: {error}"
        finally:
            os.write(send, outcome.encode())
            os._exit(0)
    os.close(send)
    try:
        _, status = os.waitpid(pid, 0)
        outcome = os.read(receive, 4096).decode()
    finally:
        os.close(receive)
        stale.unlink(missing_ok=True)  # a root process's create elsewhere on the machine may have swept it
    assert os.waitstatus_to_exitcode(status) == 0
    assert outcome.startswith("created metrale-ep-") and outcome.endswith("as uid 65534"), outcome


def test_segment_names_are_unguessable() -> None:
    names = set()
    for _ in range(3):
        with ShmTransport.create(2) as head:
            names.add(head.name)
            suffix = head.name.rsplit("-", 1)[1]
            assert len(suffix) == 16 and int(suffix, 16) >= 0  # 64 random bits from secrets
    assert len(names) == 3


def test_attach_refuses_what_is_not_a_live_ring() -> None:
    with pytest.raises(FileNotFoundError, match="no shared-memory segment"):
        ShmTransport.attach(f"{_segment.NAME_PREFIX}{os.getpid()}-missing", 1)
    with pytest.raises(ValueError, match="is not a segment name of this library"):
        ShmTransport.attach("psm_other", 1)
    garbage = Path("/dev/shm", f"{_segment.NAME_PREFIX}{os.getpid()}-garbage")
    garbage.write_bytes(bytes(8192))
    try:
        with pytest.raises(
            TransportCorrupt, match=f"is not a ring of this library's layout version {_segment.LAYOUT_VERSION}"
        ):
            ShmTransport.attach(garbage.name, 1)
    finally:
        garbage.unlink()
    with ShmTransport.create(2) as head:
        with pytest.raises(ValueError, match=r"rank=2 is out of range for the ring's world_size=2 \(1 ..= 1\)"):
            ShmTransport.attach(head.name, 2)
        with (
            ShmTransport.attach(head.name, 1),
            pytest.raises(ValueError, match=r"rank 1 of ring .* is attached already, by pid"),
        ):
            ShmTransport.attach(head.name, 1)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"world_size": 2.0}, TypeError, "world_size must be an int in 1 ..= 64, got float"),
        ({"world_size": 0}, ValueError, r"world_size must be an int in 1 \.\.= 64, got int 0"),
        ({"world_size": 65}, ValueError, r"world_size must be an int in 1 \.\.= 64, got int 65"),
        ({"ring_bytes": 192, "chunk_bytes": 64}, ValueError, r"ring_bytes must be an int in 256 \.\.= .* got int 192"),
        ({"ring_bytes": True}, TypeError, "ring_bytes must be an int"),
        ({"ring_bytes": 300_016}, ValueError, "ring_bytes must be a multiple of 64, got 300016"),
        ({"chunk_bytes": 100}, ValueError, "chunk_bytes must be a multiple of 64, got 100"),
        ({"chunk_bytes": 0}, ValueError, r"chunk_bytes must be an int in 64 \.\.= .* got int 0"),
        ({"spin_time": -1.0}, ValueError, "spin_time must be a finite number of seconds >= 0, got float -1.0"),
        ({"max_spin_time": -1}, ValueError, "max_spin_time must be a finite number of seconds >= 0, got int -1"),
        ({"spin_time": float("inf")}, ValueError, "spin_time must be"),
        ({"spin_time": "1"}, TypeError, "spin_time must be a finite number of seconds >= 0, got str"),
        ({"setup_timeout": 0}, ValueError, "setup_timeout must be a finite number of seconds > 0, got int 0"),
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
    with pytest.raises(ValueError, match=r"rank must be an int in 1 \.\.= 63, got int 0"):
        ShmTransport.attach("metrale-ep-1-x", 0)
    with pytest.raises(ValueError, match="spin_time must be"):
        ShmTransport.attach("metrale-ep-1-x", 1, spin_time=-0.5)


def test_a_small_dev_shm_is_reported_before_anything_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs("/dev/shm")

    class Small:
        f_bavail, f_frsize = 1, real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: Small())
    mine = f"{_segment.NAME_PREFIX}{os.getpid()}-"  # this process's segments: other runs may share /dev/shm
    before = {name for name in os.listdir("/dev/shm") if name.startswith(mine)}
    with pytest.raises(OSError, match=r"/dev/shm has 0.0 MiB free, too little for the ring's 1.0 MiB") as raised:
        ShmTransport.create(2)
    assert raised.value.errno == errno.ENOSPC
    assert {name for name in os.listdir("/dev/shm") if name.startswith(mine)} == before


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


# -- each failure mapped once, by the link -------------------------------------------


def _exit_after_attaching(name: str) -> None:
    ShmTransport.attach(name, 1)
    os._exit(0)  # gone before the setup exchange


def test_a_worker_that_died_during_setup_is_a_link_error_on_the_head_not_a_receive() -> None:
    with ShmTransport.create(2, setup_timeout=30) as head:
        child = multiprocessing.get_context("fork").Process(target=_exit_after_attaching, args=(head.name,))
        child.start()
        child.join(30)
        with pytest.raises(EpLinkError, match=r"rank 0: the setup exchange failed: rank 0: process\(es\) \[") as info:
            EpLink(head, num_slots=2)
    assert type(info.value) is EpLinkError and type(info.value.__cause__) is PeerLost
    assert info.value.__cause__.__cause__ is None


def test_a_setup_nobody_answers_is_a_link_error_caused_by_the_timeout() -> None:
    with ShmTransport.create(2, setup_timeout=0.2) as head, pytest.raises(EpLinkError) as info:
        EpLink(head, num_slots=2)
    assert type(info.value) is EpLinkError and type(info.value.__cause__) is TransportTimeout
    assert "never attached" in str(info.value)


def _linked_pair(**head_options: int) -> tuple[EpLink, EpLink]:
    head_side = ShmTransport.create(2, **head_options)
    worker_side = ShmTransport.attach(head_side.name, 1)
    built = in_thread(lambda: EpLink(worker_side, num_slots=2, protocol=ProtocolVersion.V2, command_timeout=0.2))
    head = EpLink(head_side, num_slots=2, protocol=ProtocolVersion.V2, command_timeout=0.2)
    return head, built()


def test_a_closed_worker_makes_the_heads_next_header_a_send_error_caused_by_the_ring_once() -> None:
    head, worker = _linked_pair()
    worker.close()
    with pytest.raises(EpSendError, match="head: broadcast to the workers failed: worker rank 1 closed") as info:
        head.send_header(0, 1)
    assert type(info.value.__cause__) is PeerLost and info.value.__cause__.__cause__ is None
    head.close()


def test_a_worker_meets_a_closed_head_and_a_cut_message_as_receive_errors_caused_by_the_ring() -> None:
    head, worker = _linked_pair()
    head.send_header(0, 1)
    head.close()  # not shut down: the close item, then the ring's own close
    with pytest.raises(EpReceiveError, match="the head closed its link before shutting the workers down"):
        worker.step(lambda seq_id, cmd, slots: ignore(seq_id, worker.recv_word(), slots), no_slots())
    worker.close()
    head, worker = _linked_pair(ring_bytes=512, chunk_bytes=64)
    with pytest.raises(EpSendError) as sent:
        head.send_command(0, 1, list(range(200)))  # 808 bytes into a ring of 512: cut when it stays full
    assert type(sent.value.__cause__) is TransportTimeout
    with pytest.raises(EpReceiveError, match="a send of the head failed after") as received:
        worker.step(ignore, no_slots())
    assert type(received.value.__cause__) is PeerLost
    worker.close()
    head.close()


def test_a_follow_up_that_never_comes_is_a_receive_error_caused_by_the_timeout() -> None:
    head, worker = _linked_pair()
    head.send_header(0, 1)
    expected = (
        r"expected a follow-up word of command 1 \(seq_id=0, cmd=1\), and none came within 0\.2 s "
        r"\(the command timeout\): the head sent fewer follow-ups than this worker reads, or stalls"
    )
    with pytest.raises(EpReceiveError, match=expected) as info:
        worker.step(lambda seq_id, cmd, slots: ignore(seq_id, worker.recv_word(), slots), no_slots())
    assert type(info.value.__cause__) is TransportTimeout
    worker.close()
    head.close()
