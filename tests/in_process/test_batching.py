"""Batched commands, their checks, prefill chunks; the toy's batched decode; a refused command."""

from array import array
from collections.abc import MutableSequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandFailed,
    EpCommandRefused,
    EpLink,
    EpLinkError,
    EpMismatchError,
    ProtocolVersion,
    RunStopped,
    SequenceState,
    WorkerSummary,
    run_worker,
)
from metrale_model_engine.batching import check_batch, prefill_chunks, recv_batch, send_batch
from metrale_model_engine.testing import RecordingEp, RecordingTransport, ReplayTransport
from metrale_model_engine.toy import ToyModel, ToyState, slots_digest
from metrale_model_engine.wire import Report, decode_answer

from helpers.messages import header, tokens, whole, word

Slots = MutableSequence[SequenceState | None]


def test_a_batch_is_one_message_a_count_and_two_arrays() -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    send_batch(recorder.ep_link, 0xFFFFFFE0, [2, 0], [70, 71])
    assert recorder.wire == [whole(0xFFFFFFE0, 0) + word(2) + tokens([2, 0]) + tokens([70, 71])]
    with pytest.raises(ValueError, match="a batch needs one value per slot: 2 slot ids, 1 values"):
        send_batch(recorder.ep_link, 9, [2, 0], [70])
    with pytest.raises(TypeError, match=r"slot_ids\[0\] must be an int"):
        send_batch(recorder.ep_link, 9, [True], [70])
    assert len(recorder.wire) == 1


@pytest.mark.parametrize(
    ("ids", "values", "error", "fragment"),
    [
        ([0, -1], [5, 6], ValueError, r"slot_ids\[1\]=-1 is outside the u32 range"),
        ((0, 1), (5, 2**32), ValueError, r"values\[1\]=4294967296 is outside the u32 range"),
        ([0, 1], [5, False], TypeError, r"values\[1\] must be an int .*got bool False"),
        ([0, 1], [5, "6"], TypeError, r"values\[1\] must be an int"),
    ],
)
def test_a_batch_from_lists_names_its_bad_id_or_value_and_sends_nothing(
    ids: list[int], values: list[int], error: type[Exception], fragment: str
) -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    with pytest.raises(error, match=fragment):
        send_batch(recorder.ep_link, 9, ids, values)
    assert recorder.wire == []


def test_a_batch_from_lists_tuples_or_arrays_is_the_same_message() -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    send_batch(recorder.ep_link, 9, [3, 1], [2**31, 7])  # a token past 2**31: the careful path
    send_batch(recorder.ep_link, 9, (3, 1), (2**31, 7))
    send_batch(recorder.ep_link, 9, array("I", [3, 1]), array("I", [2**31, 7]))
    assert recorder.wire == [whole(9, 0) + word(2) + tokens([3, 1]) + tokens([2**31, 7])] * 3


@pytest.mark.parametrize(
    ("ids", "error", "fragment"),
    [
        ([0, 4], IndexError, r"slot_ids\[1\]=4 is out of range for 4 slots"),
        ([1, 0, 1], ValueError, r"slot_ids\[2\]=1 repeats: a batch names each slot once"),
        ([0, 2], KeyError, r"slot_ids\[1\]=2: the slot is free"),
        ([0, True], TypeError, r"slot_ids\[1\] must be an int, got bool True"),
        ([0, 1.0], TypeError, r"slot_ids\[1\] must be an int, got float 1.0"),
    ],
)
def test_a_batch_is_checked_before_any_slot_is_touched(ids: list[int], error: type[Exception], fragment: str) -> None:
    slots: Slots = [SequenceState(0), SequenceState(1), None, SequenceState(3)]
    with pytest.raises(error, match=fragment):
        check_batch(ids, slots)
    check_batch([3, 0, 1], slots)
    check_batch([], slots)


def test_a_batch_takes_any_integer_ids() -> None:
    numpy = pytest.importorskip("numpy")
    slots: Slots = [SequenceState(0), SequenceState(1)]
    check_batch(numpy.array([1, 0]).tolist(), slots)
    check_batch(list(numpy.array([1, 0], dtype=numpy.uint32)), slots)  # numpy's own integer type


def test_a_worker_reads_the_whole_batch_before_checking_it() -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=4)
    send_batch(recorder.ep_link, 7, [0, 2], [5, 6])  # slot 2 is free on the worker
    send_batch(recorder.ep_link, 7, [0], [8])
    worker = EpLink(ReplayTransport(recorder.wire), num_slots=4, protocol=ProtocolVersion.V2)
    slots: Slots = [SequenceState(0), None, None, None]

    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        ids, values = recv_batch(worker, slots)
        for slot, value in zip(ids, values, strict=True):
            state = slots[slot]
            assert state is not None
            state.append(value)

    with pytest.raises(EpCommandFailed, match=r"KeyError: 'slot_ids\[1\]=2: the slot is free'"):
        worker.step(run, slots)
    assert worker.step(run, slots) is True  # nothing was left unread: the next batch runs
    assert slots[0] == SequenceState(0, [8])


def test_a_batch_of_the_wrong_shape_is_a_mismatch() -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=4)
    recorder.ep_link.send_command(0, 7, 2, [0, 1], [5])
    worker = EpLink(ReplayTransport(recorder.wire), num_slots=4, protocol=ProtocolVersion.V2)

    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        recv_batch(worker, slots)

    with pytest.raises(EpCommandFailed) as info:
        worker.step(run, [SequenceState(0)] * 4)
    assert isinstance(info.value.cause, EpMismatchError)
    assert "expected a token array of 2 tokens, but the head sent a token array of 1 token" in str(info.value)


@pytest.mark.parametrize(
    ("length", "chunk", "expected"),
    [
        (0, 4, []),
        (3, 4, [(0, 3)]),
        (8, 4, [(0, 4), (4, 4)]),
        (9, 4, [(0, 4), (4, 4), (8, 1)]),
        (5, 1, [(i, 1) for i in range(5)]),
    ],
)
def test_prefill_chunks_cover_the_prompt(length: int, chunk: int, expected: list[tuple[int, int]]) -> None:
    assert prefill_chunks(length, chunk) == expected


@pytest.mark.parametrize(
    ("length", "chunk", "error", "fragment"),
    [(-1, 4, ValueError, "length must be an int >= 0, got int -1"), (4, 0, ValueError, "chunk must be an int >= 1"),
     (4, 2.0, TypeError, "chunk must be an int >= 1, got float 2.0")],
)  # fmt: skip
def test_prefill_chunks_check_their_arguments(
    length: object, chunk: object, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        prefill_chunks(length, chunk)  # type: ignore[arg-type]


def test_the_toys_batched_decode_is_one_command_and_matches_single_decodes() -> None:
    recording = RecordingTransport(world_size=2)
    head = ToyModel(EpLink(recording, num_slots=4, protocol=ProtocolVersion.V2))
    batched: list[ToyState | None] = [None] * 4
    single: list[ToyState | None] = [None] * 4
    for slots in (batched, single):
        for seq_id in (0, 2, 3):
            slots[seq_id] = ToyState(seq_id)
            slots[seq_id].consume([seq_id + 1])  # type: ignore[union-attr]
    sent = len(recording.messages)
    picked = head.decode_batch(batched, [3, 0])
    assert len(recording.messages) == sent + 1
    assert picked == [single[3].next_token(), single[0].next_token()]  # type: ignore[union-attr]
    for seq_id, token in zip((3, 0), picked, strict=True):
        single[seq_id].consume([token])  # type: ignore[union-attr]
    assert slots_digest(batched) == slots_digest(single)
    with pytest.raises(KeyError, match="the slot is free"):
        head.decode_batch(batched, [1])
    assert len(recording.messages) == sent + 1


def test_a_worker_replays_the_toys_batched_decodes_to_the_same_state() -> None:
    recording = RecordingTransport(world_size=2)
    head = ToyModel(EpLink(recording, num_slots=4, protocol=ProtocolVersion.V2))
    head_slots: list[ToyState | None] = [None] * 4
    for seq_id in (1, 2):
        head.alloc(head_slots, seq_id)
        head.prefill(head_slots, seq_id, [seq_id] * 3)
    for _ in range(4):
        head.decode_batch(head_slots, [1, 2])
    head.ep_link.shutdown_workers()
    worker = ToyModel(EpLink(ReplayTransport(recording.messages), num_slots=4, protocol=ProtocolVersion.V2))
    worker_slots: list[ToyState | None] = [None] * 4
    assert run_worker(worker, worker_slots) == WorkerSummary(commands_run=8, commands_failed=0)
    assert worker_slots == head_slots


def test_a_refused_command_is_reported_then_ends_the_worker() -> None:
    replay = ReplayTransport([header(7, 2), header(CMD_SHUTDOWN)])
    worker = EpLink(replay, num_slots=4, protocol=ProtocolVersion.V2)

    def refuse(seq_id: int, cmd: int, slots: Slots) -> None:
        raise EpCommandRefused("refused before its forward") from KeyError(f"slot {seq_id} is free here")

    slots: Slots = [None] * 4
    with pytest.raises(EpCommandRefused) as info:
        worker.step(refuse, slots)
    assert isinstance(info.value, EpLinkError)  # run_worker re-raises it: the worker leaves
    (report,) = [decode_answer(answer) for answer in replay.answers]
    assert report == Report(1, 2, 7, "EpCommandRefused: refused before its forward", stopped=True)  # by name
    assert worker.stopped is not None and str(worker.stopped) == str(info.value)
    assert type(worker.stopped) is EpCommandRefused and worker.stopped.__traceback__ is None  # a copy, kept bare
    with pytest.raises(RunStopped, match="the run stopped earlier"):  # the link runs no more commands
        worker.step(refuse, slots)


def first_problem(ids: list[int], slots: Slots) -> str | None:
    """What check_batch must say of ``ids``: the first bad id in order, as its contract words it."""
    seen: set[int] = set()
    for index, seq_id in enumerate(ids):
        if not 0 <= seq_id < len(slots):
            return f"slot_ids[{index}]={seq_id} is out of range for {len(slots)} slots"
        if seq_id in seen:
            return f"slot_ids[{index}]={seq_id} repeats: a batch names each slot once"
        if slots[seq_id] is None:
            return f"slot_ids[{index}]={seq_id}: the slot is free"
        seen.add(seq_id)
    return None


@given(st.lists(st.integers(-2, 9), max_size=10), st.lists(st.booleans(), min_size=1, max_size=8))
def test_the_fast_check_of_a_batch_says_what_the_careful_one_says(ids: list[int], live: list[bool]) -> None:
    slots: Slots = [SequenceState(i) if alive else None for i, alive in enumerate(live)]
    expected = first_problem(ids, slots)
    if expected is None:
        check_batch(ids, slots)
        return
    with pytest.raises((IndexError, ValueError, KeyError)) as info:
        check_batch(ids, slots)
    assert expected in str(info.value)
