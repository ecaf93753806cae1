"""The worker's side of the wire: mismatches, skipped follow-ups, slots, corrupt messages, both command forms.

A recorded head (``RecordingEp``) drives each case, sending each command either item
by item (the trait's per-word calls) or as one message (``send_command``); its wire
is replayed into a worker in the same process.  A worker must read both the same way.
"""

from array import array
from collections.abc import MutableSequence, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_model_engine import (
    EpCommandFailed,
    EpLink,
    EpMismatchError,
    EpReceiveError,
    LinkedEp,
    ProtocolVersion,
    SequenceState,
    TokenArray,
)
from metrale_model_engine.testing import RecordingEp, RecordingTransport, ReplayTransport

from helpers.messages import header, whole

WORD, TOKENS, NOTHING, INTO = 1, 2, 3, 4
LONG = list(range(100, 120))

FollowUp = int | TokenArray


class Worker(LinkedEp[SequenceState]):
    """Reads, per command: one word; a token list of ``self.expect``; nothing; tokens into a buffer."""

    __slots__ = ("ep_link", "expect")

    def __init__(
        self,
        wire: Sequence[Sequence[int]],
        *,
        protocol: ProtocolVersion = ProtocolVersion.V2,
        seq_id_on_wire: bool = True,
    ) -> None:
        transport = ReplayTransport(wire)
        self.ep_link = EpLink(
            transport, num_slots=4, protocol=protocol, seq_id_on_wire=seq_id_on_wire, command_timeout=5
        )
        self.expect: int | None = None

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        link = self.ep_link
        if cmd == WORD:
            slots[seq_id] = SequenceState(seq_id, [link.recv_word()])
        elif cmd == TOKENS:
            slots[seq_id] = SequenceState(seq_id, link.recv_tokens(self.expect))
        elif cmd == INTO:
            buffer = array("I", bytes(4 * (self.expect or 0)))
            link.recv_tokens_into(buffer)
            slots[seq_id] = SequenceState(seq_id, buffer)
        elif cmd == NOTHING:
            slots[seq_id] = SequenceState(seq_id)
        else:
            super().ep_run_command(seq_id, cmd, slots)


class Head:
    """A recorded head that sends each command in one of the two forms."""

    def __init__(self, one_message: bool, protocol: ProtocolVersion = ProtocolVersion.V2) -> None:
        self.recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=protocol is ProtocolVersion.V2, num_slots=4)
        self.one_message = one_message

    def command(self, seq_id: int, cmd: int, *follow_ups: FollowUp) -> None:
        if self.one_message:
            self.recorder.ep_link.send_command(seq_id, cmd, *follow_ups)
            return
        self.recorder.ep_broadcast_cmd_for_seq(seq_id, cmd)
        for follow_up in follow_ups:
            if isinstance(follow_up, int):
                self.recorder.ep_broadcast_cmd(follow_up)
            else:
                self.recorder.ep_broadcast_tokens(follow_up)

    def worker(self, protocol: ProtocolVersion = ProtocolVersion.V2) -> Worker:
        return Worker(self.recorder.wire, protocol=protocol)


@pytest.fixture(params=[False, True], ids=["item-by-item", "one-message"])
def head(request: pytest.FixtureRequest) -> Head:
    return Head(one_message=request.param)


def failure(worker: Worker, slots: MutableSequence[SequenceState | None]) -> str:
    with pytest.raises(EpCommandFailed) as info:
        worker.ep_worker_step(slots)
    return str(info.value)


@pytest.mark.parametrize("payload", [[7], LONG], ids=["short", "long"])
def test_out_of_range_slot_skips_the_commands_follow_ups(head: Head, payload: list[int]) -> None:
    head.command(3, TOKENS, 5, payload)  # the worker has only 2 slots
    head.command(1, NOTHING)
    worker = head.worker()
    slots: list[SequenceState | None] = [None, None]
    assert "IndexError: seq_id=3 is out of range for 2 slots" in failure(worker, slots)
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, SequenceState(1)]


@pytest.mark.parametrize("sent", [[1, 2], LONG], ids=["short", "long"])
@pytest.mark.parametrize("cmd", [TOKENS, INTO])
def test_token_length_mismatch_names_both_lengths_and_stays_in_step(head: Head, sent: list[int], cmd: int) -> None:
    for expected in (len(sent) - 1, len(sent) + 1):
        head = Head(head.one_message)
        head.command(0, cmd, sent)
        head.command(1, WORD, 9)
        worker = head.worker()
        worker.expect = expected
        slots: list[SequenceState | None] = [None] * 4
        message = failure(worker, slots)
        assert f"expected a token array of {expected} tokens, but the head sent a token array of {len(sent)}" in message
        assert worker.ep_worker_step(slots) is True
        assert slots == [None, SequenceState(1, [9]), None, None]


@pytest.mark.parametrize("cmd", [TOKENS, INTO])
def test_tokens_of_any_length_arrive(head: Head, cmd: int) -> None:
    payloads: tuple[list[int], ...] = ([], [5], list(range(13)), LONG)
    for seq_id, payload in enumerate(payloads):
        head.command(seq_id, cmd, payload)
    worker = head.worker()
    slots: list[SequenceState | None] = [None] * 4
    for payload in payloads:
        worker.expect = len(payload)
        assert worker.ep_worker_step(slots) is True
    assert [state.tokens if state else None for state in slots] == list(payloads)


def test_a_missing_follow_up_meets_the_next_header_which_still_runs(head: Head) -> None:
    head.command(0, WORD)  # the head forgets the word
    head.command(2, NOTHING)
    worker = head.worker()
    slots: list[SequenceState | None] = [None] * 4
    message = failure(worker, slots)
    if head.one_message:  # the worker knows at once that nothing more is coming
        assert (
            "worker rank 1 expected a follow-up word, but command 1 (seq_id=0, cmd=1) came whole, as one message, "
            "and this worker has read all of it"
        ) in message
    else:
        assert "expected a follow-up word, but the head sent the next command's header (cmd=3, seq_id=2)" in message
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, None, SequenceState(2), None]


def test_words_sent_outside_a_command_are_read_after_any_command(head: Head) -> None:
    """Only a step's reads stop at a whole command's end: a word read outside any step waits for it."""
    head.command(0, WORD, 7)
    head.recorder.ep_broadcast_cmd(11)  # a follow-up outside any command, as the benchmarks' bursts send
    worker = head.worker()
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True
    assert worker.ep_link.recv_word() == 11
    assert slots == [SequenceState(0, [7]), None, None, None]


def test_a_follow_up_of_another_kind_is_a_mismatch(head: Head) -> None:
    head.command(0, WORD, LONG)  # tokens where a word was expected
    head.command(1, TOKENS, 4)  # a word where tokens were expected
    head.command(2, NOTHING)
    worker = head.worker()
    slots: list[SequenceState | None] = [None] * 4
    assert f"expected a follow-up word, but the head sent a token array of {len(LONG)} tokens" in failure(worker, slots)
    assert "expected a token array, but the head sent a follow-up word (4)" in failure(worker, slots)
    assert worker.ep_worker_step(slots) is True
    assert slots == [None, None, SequenceState(2), None]


def test_follow_ups_left_unread_by_a_successful_command_fail_it_once(head: Head) -> None:
    head.command(0, NOTHING, 1, LONG)
    head.command(1, NOTHING, [5])
    head.recorder.ep_link.shutdown_workers()
    worker = head.worker()
    slots: list[SequenceState | None] = [None] * 4
    if not head.one_message:  # the worker sees what was left only when it looks for the next header
        assert worker.ep_worker_step(slots) is True
    message = failure(worker, slots)
    assert (
        "worker rank 1: command 1 (seq_id=0, cmd=3) left a follow-up word (1), a token array of 20 tokens unread; "
        "they were skipped"
    ) in message
    if not head.one_message:
        assert worker.ep_worker_step(slots) is True
    message = failure(worker, slots)
    assert "command 2 (seq_id=1, cmd=3) left a token array of 1 token unread; it was skipped" in message
    assert slots == [SequenceState(0), SequenceState(1), None, None]
    assert worker.ep_worker_step(slots) is False


def test_mismatch_outside_a_command_is_raised_untagged(head: Head) -> None:
    head.command(0, NOTHING)
    worker = head.worker()
    with pytest.raises(EpMismatchError, match="expected a follow-up word, but the head sent the next command's header"):
        worker.ep_link.recv_word()
    with pytest.raises(EpMismatchError):  # the header waits for the next step, whatever is asked
        worker.ep_link.recv_tokens()
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True and slots[0] == SequenceState(0)


@pytest.mark.parametrize(("count", "error"), [(-1, ValueError), (True, TypeError), (2.0, TypeError), ("2", TypeError)])
def test_recv_tokens_checks_count(count: object, error: type[Exception]) -> None:
    worker = Worker([])
    with pytest.raises(error, match=r"count must be None or an int >= 0, got"):
        worker.ep_link.recv_tokens(count)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ((0xDEAD,) * 16, r"a corrupt message from the head: word 0 of a 16-word message is 0xdead"),
        (header(NOTHING)[:2], r"the header item at word 0 runs past the end of its 2-word message"),
        ((0x4D45_0003, 5, 1), r"the tokens item at word 0 runs past the end of its 3-word message"),
    ],
)
def test_a_corrupt_message_is_a_receive_error(message: tuple[int, ...], fragment: str) -> None:
    worker = Worker([message])
    with pytest.raises(EpReceiveError, match=fragment):
        worker.ep_worker_step([None])


@pytest.mark.parametrize(("on_wire", "seen"), [(True, 2), (False, 0)])
def test_v1_carries_the_slot_unless_told_not_to(on_wire: bool, seen: int) -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=False, num_slots=4)
    recorder.ep_broadcast_cmd_for_seq(2, NOTHING)
    wire = recorder.wire
    if not on_wire:
        wire = [header(NOTHING, 0)]  # what a bare-v1 head sends
    worker = Worker(wire, protocol=ProtocolVersion.V1, seq_id_on_wire=on_wire)
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) is True
    assert slots[seen] == SequenceState(seen)


def test_bare_v1_head_leaves_the_slot_off() -> None:
    recording = RecordingTransport(world_size=2)
    bare = EpLink(recording, num_slots=4, protocol=ProtocolVersion.V1, seq_id_on_wire=False)
    bare.send_header(2, NOTHING)
    bare.send_command(3, NOTHING)
    assert recording.messages == [header(NOTHING, 0), whole(NOTHING, 0)]
    assert bare.seq_id_on_wire is False


u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


@settings(max_examples=60, deadline=None)
@given(st.lists(u32, max_size=40), st.sampled_from(list(ProtocolVersion)), st.booleans())
def test_any_token_array_arrives_as_sent(tokens: list[int], protocol: ProtocolVersion, one_message: bool) -> None:
    head = Head(one_message, protocol)
    head.command(1, TOKENS, tokens)
    head.command(2, INTO, array("I", tokens))
    worker = head.worker(protocol)
    worker.expect = len(tokens)
    slots: list[SequenceState | None] = [None] * 4
    assert worker.ep_worker_step(slots) and worker.ep_worker_step(slots)
    assert slots[1] == SequenceState(1, tokens) and slots[2] == SequenceState(2, tokens)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=0xFFFFFFFE), u32, st.sampled_from(list(ProtocolVersion)))
def test_any_header_arrives_as_sent(seq_id: int, cmd: int, protocol: ProtocolVersion) -> None:
    if cmd == 0xFFFFFFFF:
        cmd = 0  # the shutdown word is not a command
    recording = RecordingTransport(world_size=2)
    EpLink(recording, num_slots=0xFFFFFFFF, protocol=protocol).send_header(seq_id, cmd)
    seen: list[tuple[int, int]] = []

    class AnySlot(list[SequenceState | None]):
        def __len__(self) -> int:
            return 0xFFFFFFFF

    receiver = EpLink(ReplayTransport(recording.messages), num_slots=0xFFFFFFFF, protocol=protocol)
    assert receiver.step(lambda seq_id, cmd, slots: seen.append((seq_id, cmd)), AnySlot()) is True
    assert seen == [(seq_id, cmd)]


commands = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.sampled_from([WORD, TOKENS, NOTHING]),
        st.lists(st.one_of(u32, st.lists(u32, max_size=30)), max_size=3),
    ),
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(commands)
def test_both_forms_leave_a_worker_in_the_same_state(stream: list[tuple[int, int, list[int | list[int]]]]) -> None:
    """Whatever the head sends, right or wrong for the worker, the two forms give the same slots and failures.

    (The wording of a follow-up read past a command's end differs: a command sent whole says so.)
    """
    outcomes = []
    for one_message in (False, True):
        head = Head(one_message)
        for seq_id, cmd, follow_ups in stream:
            head.command(seq_id, cmd, *follow_ups)
        head.recorder.ep_link.shutdown_workers()
        worker = head.worker()
        slots: list[SequenceState | None] = [None] * 4
        failures = []
        while True:
            try:
                if not worker.ep_worker_step(slots):
                    break
            except EpCommandFailed as error:
                failures.append(type(error.cause).__name__)
        outcomes.append((slots, failures))
    assert outcomes[0] == outcomes[1]
