"""RecordingEp: exact event sequences, real checks, replay into a worker."""

import logging
import zlib
from collections.abc import MutableSequence, Sequence

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpDivergenceError,
    EpLink,
    EpReceiveError,
    EpSetupError,
    LinkedEp,
    ProtocolVersion,
    SequenceState,
    WorkerSummary,
)
from metrale_model_engine.testing import EpEvent, RecordingEp, RecordingTransport, ReplayTransport

from helpers.messages import header, sync, tokens, whole, word


def schedule_step(model: RecordingEp[SequenceState], seq_id: int, prompt: list[int]) -> None:
    """What a scheduler does before one prefill: header, a follow-up word, tokens."""
    model.ep_broadcast_cmd_for_seq(seq_id, 2)
    model.ep_broadcast_cmd(len(prompt))
    model.ep_broadcast_tokens(prompt)


@pytest.mark.parametrize("v2", [False, True])
def test_records_events_and_wire(v2: bool) -> None:
    model: RecordingEp[SequenceState] = RecordingEp(protocol_v2=v2, num_slots=4)
    assert model.is_ep() is True and model.ep_protocol_v2() is v2
    schedule_step(model, 3, [10, 11])
    model.ep_link.shutdown_workers()
    assert model.events == [
        EpEvent("cmd_for_seq", (3, 2)),
        EpEvent("cmd", (2,)),
        EpEvent("tokens", (10, 11)),
        EpEvent("sync", (1,)),  # shutting down is a sync point: the workers answer it first
        EpEvent("shutdown", ()),
    ]
    assert model.wire == [header(2, 3), word(2), tokens([10, 11]), sync(1), header(CMD_SHUTDOWN)]


def test_a_one_message_command_records_the_same_events() -> None:
    model: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    model.ep_link.send_command(3, 2, 2, [10, 11])
    assert model.events == [EpEvent("cmd_for_seq", (3, 2)), EpEvent("cmd", (2,)), EpEvent("tokens", (10, 11))]
    assert model.wire == [whole(2, 3) + word(2) + tokens([10, 11])]


def test_single_gpu_recorder_records_calls_but_nothing_on_the_wire() -> None:
    model: RecordingEp[SequenceState] = RecordingEp(is_ep=False)
    assert model.is_ep() is False
    schedule_step(model, 0, [1])
    assert [e.kind for e in model.events] == ["cmd_for_seq", "cmd", "tokens"]
    assert model.wire == []


def test_invalid_calls_raise_like_the_real_thing_and_are_not_recorded() -> None:
    model: RecordingEp[SequenceState] = RecordingEp(num_slots=2)
    with pytest.raises(ValueError, match=r"seq_id=2 is out of range for 2 slots"):
        model.ep_broadcast_cmd_for_seq(2, 1)
    with pytest.raises(TypeError, match="cmd must be an int"):
        model.ep_broadcast_cmd(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tokens\[0\]=-3 is outside"):
        model.ep_broadcast_tokens([-3])
    assert model.events == [] and model.wire == []


class EchoWorker(LinkedEp[SequenceState]):
    """A worker that applies the prefill that schedule_step sends."""

    __slots__ = ("ep_link",)

    def __init__(self, num_slots: int, protocol: ProtocolVersion) -> None:
        self.ep_link = EpLink(ReplayTransport(()), num_slots=num_slots, protocol=protocol)  # no process group

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd != 2:
            super().ep_run_command(seq_id, cmd, slots)
        count = self.ep_link.recv_word()
        slots[seq_id] = SequenceState(seq_id, self.ep_link.recv_tokens(count))


def test_replay_into_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    head: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=3)
    schedule_step(head, 1, [5, 6, 7])
    head.ep_broadcast_cmd_for_seq(0, 99)  # unknown to the worker: fails, the loop goes on
    schedule_step(head, 2, [8])
    worker = EchoWorker(3, ProtocolVersion.V2)
    slots: list[SequenceState | None] = [None, None, None]
    with caplog.at_level(logging.ERROR):
        summary = head.replay(worker, slots)
    assert summary == WorkerSummary(commands_run=2, commands_failed=1)
    assert slots == [None, SequenceState(1, [5, 6, 7]), SequenceState(2, [8])]
    assert "unknown command word 99" in caplog.text
    assert head.replay(worker, [None, None, None]) == summary
    with pytest.raises(EpReceiveError, match="the recording has no more messages"):
        worker.ep_worker_step(slots)  # back on its own (empty) link


def test_replay_refuses_a_mismatched_worker() -> None:
    head: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=3)
    worker = EchoWorker(3, ProtocolVersion.V1)
    with pytest.raises(EpSetupError, match=r"the ranks disagree on the protocol \(rank 0: v2, rank 1: v1\)"):
        head.replay(worker, [None] * 3)
    other = EchoWorker(4, ProtocolVersion.V2)
    with pytest.raises(EpSetupError, match=r"the ranks disagree on the slot count \(rank 0: 3, rank 1: 4\)"):
        head.replay(other, [None] * 4)


def test_replay_needs_a_multi_rank_recording() -> None:
    head: RecordingEp[SequenceState] = RecordingEp(is_ep=False)
    worker = EchoWorker(8, ProtocolVersion.V1)
    with pytest.raises(ValueError, match="replay\\(\\) needs a recording made with is_ep=True"):
        head.replay(worker, [None] * 8)


def test_replay_of_a_mismatched_command_fails_it_and_stays_in_step(caplog: pytest.LogCaptureFixture) -> None:
    head: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=2)
    head.ep_broadcast_cmd_for_seq(0, 2)
    head.ep_broadcast_cmd(3)
    head.ep_broadcast_tokens([1, 2])  # says 3, sends 2
    schedule_step(head, 1, [9])
    worker = EchoWorker(2, ProtocolVersion.V2)
    slots: list[SequenceState | None] = [None, None]
    with caplog.at_level(logging.ERROR):
        assert head.replay(worker, slots) == WorkerSummary(commands_run=1, commands_failed=1)
    assert "expected a token array of 3 tokens, but the head sent a token array of 2 tokens" in caplog.text
    assert slots == [None, SequenceState(1, [9])]


def test_replay_transport_past_the_end() -> None:
    worker = EchoWorker(1, ProtocolVersion.V1)
    with pytest.raises(EpReceiveError, match="the recording has no more messages"):
        worker.ep_worker_step([None])


def test_the_recording_heads_workers_agree_after_a_long_message() -> None:
    """The pretend workers digest each message as a real worker does (``fold_message``), long ones too."""
    recorder: RecordingEp[SequenceState] = RecordingEp(num_slots=2)
    recorder.ep_link.send_command(0, 5, list(range(2_100)))  # over 8 KiB: folded by its length and edges
    recorder.ep_link.shutdown_workers()  # a sync point first: it raises unless the digests agree
    assert len(recorder.wire) == 3


PREFILL, CLOSE = 2, 3


def digest(slots: Sequence[SequenceState | None]) -> int:
    """The slots' state as a u64, the same function on every rank."""
    return zlib.crc32(repr([None if s is None else (s.seq_id, list(s.tokens)) for s in slots]).encode())


class TwiceWorker(EchoWorker):
    """A prefill that feeds its prompt twice (when ``twice``); CLOSE frees the slot, erasing the difference."""

    __slots__ = ("twice",)

    def __init__(self, twice: bool) -> None:
        super().__init__(4, ProtocolVersion.V1)
        self.ep_link.state_digest = digest
        self.twice = twice

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd == CLOSE:
            slots[seq_id] = None
            return
        super().ep_run_command(seq_id, cmd, slots)
        state = slots[seq_id]
        if self.twice and state is not None:
            state.extend(state.tokens)


def prefill_then_close(head: RecordingEp[SequenceState], slots: list[SequenceState | None]) -> None:
    schedule_step(head, 0, [5, 6])
    slots[0] = SequenceState(0, [5, 6])  # the head's state changes once the command's broadcasts are out
    schedule_step(head, 1, [7])
    slots[1] = SequenceState(1, [7])
    head.ep_broadcast_cmd_for_seq(0, CLOSE)
    slots[0] = None


def test_a_replay_compares_the_workers_state_with_the_heads_after_every_command() -> None:
    head: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    head.ep_link.state_digest = digest
    head_slots: list[SequenceState | None] = [None] * 4
    head.record_digests(head_slots)
    prefill_then_close(head, head_slots)
    assert head.replay(TwiceWorker(twice=False), [None] * 4) == WorkerSummary(commands_run=3, commands_failed=0)
    with pytest.raises(EpDivergenceError) as info:
        head.replay(TwiceWorker(twice=True), [None] * 4)  # the close at command 3 would erase the difference
    assert str(info.value).startswith(
        f"replay: after command 1 (seq_id=0, cmd={PREFILL}), worker rank 1's state digest is "
    )
    assert info.value.ranks == (1,)


def test_without_recorded_digests_a_replay_compares_no_state() -> None:
    head: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    prefill_then_close(head, [None] * 4)
    slots: list[SequenceState | None] = [None] * 4
    assert head.replay(TwiceWorker(twice=True), slots).commands_run == 3
    assert slots == [None, SequenceState(1, [7, 7]), None, None]  # the difference a digest would have caught


def test_recording_digests_needs_the_heads_state_digest() -> None:
    head: RecordingEp[SequenceState] = RecordingEp(num_slots=4)
    with pytest.raises(ValueError, match=r"record_digests\(\) needs ep_link.state_digest"):
        head.record_digests([None] * 4)


def test_a_sync_point_that_compares_states_over_a_recording_passes() -> None:
    link = EpLink(RecordingTransport(3), num_slots=2, protocol=ProtocolVersion.V2)
    link.state_digest = digest
    slots: list[SequenceState | None] = [SequenceState(0, [1]), None]
    link.send_command(0, PREFILL)
    link.sync(slots)  # the pretend workers, in step, answer the head's own digest
    link.shutdown_workers(slots)
