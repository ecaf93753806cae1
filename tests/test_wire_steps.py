"""The worker's side of the framed wire: mismatches, skipped follow-ups, slots, bad frames.

A recorded head (``RecordingEp``) drives each case; its wire is replayed into a worker
in the same process, so every receive is checked for the exact length sent.
"""

from array import array
from collections.abc import MutableSequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_model_engine import (
    INLINE_TOKENS,
    EpCommandFailed,
    EpMismatchError,
    EpProtocol,
    EpReceiveError,
    SequenceState,
    WireEp,
)
from metrale_model_engine.testing import RecordingEp, ReplayTransport

from frames import header

WORD, TOKENS, NOTHING, INTO = 1, 2, 3, 4
LONG = list(range(100, 100 + INLINE_TOKENS + 6))  # travels as frame + bulk


class Worker(WireEp[SequenceState]):
    """Reads, per command: one word; a token list of ``self.expect``; nothing; tokens into a buffer."""

    __slots__ = ("expect",)

    def __init__(
        self, wire: list[tuple[int, ...]], *, protocol: EpProtocol = EpProtocol.V2, v1_slot: bool = True
    ) -> None:
        super().__init__(ReplayTransport(wire), num_slots=4, protocol=protocol, v1_slot=v1_slot, command_timeout=5)
        self.expect: int | None = None

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd == WORD:
            slots[seq_id] = SequenceState(seq_id, [self.ep_recv_word()])
        elif cmd == TOKENS:
            slots[seq_id] = SequenceState(seq_id, self.ep_recv_tokens(self.expect))
        elif cmd == INTO:
            buffer = array("I", bytes(4 * (self.expect or 0)))
            self.ep_recv_tokens_into(buffer)
            slots[seq_id] = SequenceState(seq_id, buffer)
        elif cmd == NOTHING:
            slots[seq_id] = SequenceState(seq_id)
        else:
            super().ep_run_command(seq_id, cmd, slots)


def head(protocol: EpProtocol = EpProtocol.V2) -> RecordingEp[SequenceState]:
    return RecordingEp(protocol_v2=protocol is EpProtocol.V2, num_slots=4)


def failure(worker: Worker, slots: MutableSequence[SequenceState | None]) -> str:
    with pytest.raises(EpCommandFailed) as info:
        worker.ep_worker_step(slots)
    return str(info.value)


@pytest.mark.parametrize("payload", [[7], LONG], ids=["inline", "bulk"])
def test_out_of_range_slot_skips_the_commands_follow_ups(payload: list[int]) -> None:
    recorder = head()
    recorder.ep_broadcast_cmd_for_seq(3, TOKENS)  # the worker has only 2 slots
    recorder.ep_broadcast_cmd(5)
    recorder.ep_broadcast_tokens(payload)
    recorder.ep_broadcast_cmd_for_seq(1, NOTHING)
    worker = Worker(recorder.wire)
    slots: list[SequenceState | None] = [None, None]
    assert "IndexError: seq_id=3 is out of range for 2 slots" in failure(worker, slots)
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, SequenceState(1)]


@pytest.mark.parametrize("sent", [[1, 2], LONG], ids=["inline", "bulk"])
@pytest.mark.parametrize("cmd", [TOKENS, INTO])
def test_token_length_mismatch_names_both_lengths_and_stays_in_step(sent: list[int], cmd: int) -> None:
    for expected in (len(sent) - 1, len(sent) + 1):
        recorder = head()
        recorder.ep_broadcast_cmd_for_seq(0, cmd)
        recorder.ep_broadcast_tokens(sent)
        recorder.ep_broadcast_cmd_for_seq(1, WORD)
        recorder.ep_broadcast_cmd(9)
        worker = Worker(recorder.wire)
        worker.expect = expected
        slots: list[SequenceState | None] = [None] * 4
        message = failure(worker, slots)
        assert f"expected a token array of {expected} tokens, but the head sent a token array of {len(sent)}" in message
        assert worker.ep_worker_step(slots) is True
        assert slots == [None, SequenceState(1, [9]), None, None]


@pytest.mark.parametrize("cmd", [TOKENS, INTO])
def test_tokens_arrive_inline_and_in_bulk(cmd: int) -> None:
    recorder = head()
    for seq_id, payload in enumerate(([], [5], list(range(INLINE_TOKENS)), LONG)):
        recorder.ep_broadcast_cmd_for_seq(seq_id, cmd)
        recorder.ep_broadcast_tokens(payload)
    worker = Worker(recorder.wire)
    slots: list[SequenceState | None] = [None] * 4
    for payload in ([], [5], list(range(INLINE_TOKENS)), LONG):
        worker.expect = len(payload)
        assert worker.ep_worker_step(slots) is True
    assert [state.tokens if state else None for state in slots] == [[], [5], list(range(INLINE_TOKENS)), LONG]


def test_a_missing_follow_up_meets_the_next_header_which_still_runs() -> None:
    recorder = head()
    recorder.ep_broadcast_cmd_for_seq(0, WORD)  # the head forgets the word
    recorder.ep_broadcast_cmd_for_seq(2, NOTHING)
    worker = Worker(recorder.wire)
    slots: list[SequenceState | None] = [None] * 4
    message = failure(worker, slots)
    assert "expected a follow-up word, but the head sent the next command's header (cmd=3, seq_id=2)" in message
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, None, SequenceState(2), None]


def test_a_follow_up_of_another_kind_is_a_mismatch() -> None:
    recorder = head()
    recorder.ep_broadcast_cmd_for_seq(0, WORD)
    recorder.ep_broadcast_tokens(LONG)  # tokens where a word was expected: the bulk is drained
    recorder.ep_broadcast_cmd_for_seq(1, TOKENS)
    recorder.ep_broadcast_cmd(4)  # a word where tokens were expected
    recorder.ep_broadcast_cmd_for_seq(2, NOTHING)
    worker = Worker(recorder.wire)
    slots: list[SequenceState | None] = [None] * 4
    assert f"expected a follow-up word, but the head sent a token array of {len(LONG)} tokens" in failure(worker, slots)
    assert "expected a token array, but the head sent a follow-up word (4)" in failure(worker, slots)
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, None, SequenceState(2), None]


def test_follow_ups_left_unread_by_a_successful_command_are_reported_once() -> None:
    recorder = head()
    recorder.ep_broadcast_cmd_for_seq(0, NOTHING)
    recorder.ep_broadcast_cmd(1)
    recorder.ep_broadcast_tokens(LONG)
    recorder.ep_broadcast_cmd_for_seq(1, NOTHING)
    recorder.ep_shutdown_workers()
    worker = Worker(recorder.wire)
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True
    message = failure(worker, slots)
    assert "command 3 (seq_id=0) left a follow-up word (1), a token array of 20 tokens unread" in message
    assert worker.ep_worker_step(slots) is True
    assert slots == [SequenceState(0), SequenceState(1), None, None]
    assert worker.ep_worker_step(slots) is False


def test_mismatch_outside_a_command_is_raised_untagged() -> None:
    recorder = head()
    recorder.ep_broadcast_cmd_for_seq(0, NOTHING)
    worker = Worker(recorder.wire)
    with pytest.raises(EpMismatchError, match="expected a follow-up word, but the head sent the next command's header"):
        worker.ep_recv_word()
    with pytest.raises(EpMismatchError):  # the header waits for the next step, whatever is asked
        worker.ep_recv_tokens()
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True and slots[0] == SequenceState(0)


@pytest.mark.parametrize(("count", "error"), [(-1, ValueError), (True, TypeError), (2.0, TypeError), ("2", TypeError)])
def test_recv_tokens_checks_count(count: object, error: type[Exception]) -> None:
    worker = Worker([])
    with pytest.raises(error, match=r"count must be None or an int >= 0, got"):
        worker.ep_recv_tokens(count)  # type: ignore[arg-type]


def test_a_corrupt_frame_is_a_receive_error() -> None:
    worker = Worker([tuple([0xDEAD] * 16)])
    with pytest.raises(EpReceiveError, match=r"received a corrupt frame \(first word 0xdead\)"):
        worker.ep_worker_step([None])


@pytest.mark.parametrize(("v1_slot", "seen"), [(True, 2), (False, 0)])
def test_v1_carries_the_slot_unless_told_not_to(v1_slot: bool, seen: int) -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=False, num_slots=4)
    recorder.ep_broadcast_cmd_for_seq(2, NOTHING)
    wire = recorder.wire
    if not v1_slot:
        wire = [header(NOTHING, 0)]  # what a bare-v1 head sends
    worker = Worker(wire, protocol=EpProtocol.V1, v1_slot=v1_slot)
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True
    assert slots[seen] == SequenceState(seen)


def test_bare_v1_head_leaves_the_slot_off() -> None:
    from metrale_model_engine.testing import RecordingTransport

    recording = RecordingTransport(world_size=2)
    bare: WireEp[SequenceState] = WireEp(recording, num_slots=4, protocol=EpProtocol.V1, v1_slot=False)
    bare.ep_broadcast_cmd_for_seq(2, NOTHING)
    assert recording.broadcasts == [header(NOTHING, 0)]
    assert bare.carries_seq_id is False


def test_the_shutdown_word_is_reserved_for_ep_shutdown_workers() -> None:
    recorder = head()
    with pytest.raises(ValueError, match=r"cmd=0xffffffff is the reserved shutdown word; call ep_shutdown_workers\(\)"):
        recorder.ep_broadcast_cmd_for_seq(0, 0xFFFFFFFF)
    assert recorder.wire == [] and recorder.events == []


u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


@settings(max_examples=60, deadline=None)
@given(st.lists(u32, max_size=40), st.sampled_from(list(EpProtocol)))
def test_any_token_array_arrives_as_sent(tokens: list[int], protocol: EpProtocol) -> None:
    recorder = head(protocol)
    recorder.ep_broadcast_cmd_for_seq(1, TOKENS)
    recorder.ep_broadcast_tokens(tokens)
    recorder.ep_broadcast_cmd_for_seq(2, INTO)
    recorder.ep_broadcast_tokens_into(array("I", tokens))
    worker = Worker(recorder.wire, protocol=protocol)
    worker.expect = len(tokens)
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) and worker.ep_worker_step(slots)
    assert slots[1] == SequenceState(1, tokens) and slots[2] == SequenceState(2, tokens)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=0xFFFFFFFE), u32, st.sampled_from(list(EpProtocol)))
def test_any_header_arrives_as_sent(seq_id: int, cmd: int, protocol: EpProtocol) -> None:
    from metrale_model_engine.testing import RecordingTransport

    if cmd == 0xFFFFFFFF:
        cmd = 0  # the shutdown word is not a command
    recording = RecordingTransport(world_size=2)
    sender: WireEp[SequenceState] = WireEp(recording, num_slots=0xFFFFFFFF, protocol=protocol)
    sender.ep_broadcast_cmd_for_seq(seq_id, cmd)
    seen: list[tuple[int, int]] = []

    class Recorder(WireEp[SequenceState]):
        __slots__ = ()

        def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
            seen.append((seq_id, cmd))

    receiver = Recorder(ReplayTransport(recording.broadcasts), num_slots=0xFFFFFFFF, protocol=protocol)

    class AnySlot(list[SequenceState | None]):
        def __len__(self) -> int:
            return 0xFFFFFFFF

    assert receiver.ep_worker_step(AnySlot()) is True
    assert seen == [(seq_id, cmd)]
