"""The way back, in one process: reports raised on the head, sync points, what a worker answers, agreement checks."""

import zlib
from array import array
from collections.abc import Callable, MutableSequence, Sequence

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandFailed,
    EpDivergenceError,
    EpLink,
    EpLinkError,
    EpRoleError,
    EpWorkerFailed,
    ProtocolVersion,
    RunStopped,
    SequenceState,
    WorkerFailure,
)
from metrale_model_engine.testing import RecordingEp, ReplayTransport
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import Ack, Report, decode_answer, encode_ack, encode_report, fold_message

from helpers.fakes import FakeTransport, ignore, link, no_slots
from helpers.messages import header, sync, whole, word

Slots = MutableSequence[SequenceState | None]


def report(command: int, seq_id: int = 0, cmd: int = 7, error: str = "KeyError: 'slot 0 is free'") -> bytes:
    return encode_report(Report(command, seq_id, cmd, error))


def test_a_report_that_arrived_is_raised_before_the_next_command_and_only_once() -> None:
    transport = FakeTransport(0, 3)
    head = link(transport)
    head.send_command(0, 7)
    transport.waiting = [(2, report(1)), (1, report(1, error="ValueError: bad"))]
    with pytest.raises(EpWorkerFailed) as info:
        head.send_command(1, 8, 5)
    assert info.value.failures == (
        WorkerFailure(2, 1, 0, 7, "KeyError: 'slot 0 is free'"),
        WorkerFailure(1, 1, 0, 7, "ValueError: bad"),
    )
    message = str(info.value)
    assert message.startswith("worker rank 2 failed command 1 (seq_id=0, cmd=7): KeyError: 'slot 0 is free'; ")
    assert message.endswith("; nothing of the command being sent was sent")
    assert len(transport.sent) == 1 and head.commands == 1  # the new command was not sent
    head.send_command(1, 8, 5)  # raised once: the next send goes through
    assert transport.sent[-1] == whole(8, 1) + word(5)


def test_a_report_that_stopped_the_run_is_raised_as_such_and_the_link_stays_stopped() -> None:
    transport = FakeTransport(0, 3)
    head = link(transport)
    head.send_command(0, 7)
    transport.waiting = [(1, encode_report(Report(1, 0, 7, "KeyError: 'slot 0 is free'", stopped=True)))]
    with pytest.raises(RunStopped) as info:
        head.send_command(1, 8, 5)
    assert info.value.failures == (WorkerFailure(1, 1, 0, 7, "KeyError: 'slot 0 is free'", stopped=True),)
    assert info.value.ranks == (1,)
    assert str(info.value) == (
        "head: the run stopped: worker rank 1 failed command 1 (seq_id=0, cmd=7): KeyError: 'slot 0 is free'; "
        "nothing of the command being sent was sent"
    )
    assert head.stopped is not None and str(head.stopped) == str(info.value) and head.closed
    calls: list[Callable[[], None]] = [lambda: head.send_command(1, 8), head.sync, head.shutdown_workers]
    for call in calls:
        with pytest.raises(RunStopped, match=r"head: the run stopped earlier \(head: the run stopped: worker rank 1"):
            call()


def test_a_report_that_stopped_the_run_ends_a_sync_point_without_waiting_for_that_worker() -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [agreeing(transport)], 2: [encode_report(Report(2, 1, 7, "ValueError: x", True))]}
    with pytest.raises(RunStopped, match=r"worker rank 2 failed command 2 \(seq_id=1, cmd=7\): ValueError: x"):
        head.sync()


def sync_head(acks: Sequence[Sequence[bytes]], world_size: int = 3) -> tuple[EpLink, FakeTransport]:
    """A head that sent two commands; ``acks`` are what workers 1.. answer at its first sync point."""
    transport = FakeTransport(0, world_size)
    head = link(transport)
    head.send_command(0, 7)
    head.send_command(1, 7)
    for rank, answers in enumerate(acks, start=1):
        transport.answers_of[rank] = list(answers)
    return head, transport


def agreeing(transport: FakeTransport, compare_state: bool = False, **changes: int) -> bytes:
    """The acknowledgement of sync point 1 by a worker in step, with ``changes``."""
    from array import array

    crc = 0
    for message in [*transport.sent, sync(1, compare_state)]:
        crc = fold_message(crc, [array("I", message)])
    return encode_ack(Ack(1, crc, 2, 0, None)._replace(**changes))


def test_a_sync_point_where_every_worker_agrees_returns() -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [agreeing(transport)], 2: [agreeing(transport)]}
    head.sync()
    assert transport.sent[-1] == sync(1)


def test_failures_reported_at_a_sync_point_are_raised_there() -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [report(2, 1), agreeing(transport, reports=1)], 2: [agreeing(transport)]}
    with pytest.raises(EpWorkerFailed) as info:
        head.sync()
    assert info.value.failures == (WorkerFailure(1, 2, 1, 7, "KeyError: 'slot 0 is free'"),)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"commands": 1}, "worker rank 2: received 1 commands where the head sent 2"),
        ({"stream_crc": 7}, "worker rank 2: its command stream's CRC-32 is 0x00000007, the head's 0x"),
    ],
)
def test_a_worker_whose_stream_differs_is_a_divergence_naming_it_and_the_commands(
    changes: dict[str, int], fragment: str
) -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [agreeing(transport)], 2: [agreeing(transport, False, **changes)]}
    with pytest.raises(EpDivergenceError, match=fragment) as info:
        head.sync()
    assert info.value.ranks == (2,)
    assert "no sync point has seen every rank agree yet: they diverged within commands 1 ..= 2" in str(info.value)


def test_state_digests_are_compared_with_the_heads() -> None:
    head, transport = sync_head([])
    head.state_digest = lambda slots: len([s for s in slots if s is not None])
    transport.answers_of = {
        1: [agreeing(transport, True, state_digest=1)],
        2: [agreeing(transport, True, state_digest=0)],
    }
    slots: Slots = [SequenceState(0), None]
    with pytest.raises(EpDivergenceError, match=r"worker rank 2: its state digest is 0x0000000000000000, the head's"):
        head.sync(slots)
    # The stream digest counts the sync item, which asked for the state: it carries flag 1.
    assert transport.sent[-1] == sync(1, compare_state=True)


def test_reports_that_never_arrived_are_a_link_error() -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [agreeing(transport, reports=2)], 2: [agreeing(transport)]}
    with pytest.raises(EpLinkError, match=r"reports of worker rank\(s\) \[1\] were lost"):
        head.sync()


def test_a_sync_point_whose_worker_does_not_answer_is_a_link_error() -> None:
    head, transport = sync_head([])
    transport.answers_fail_with = TimeoutError("worker rank 1 sent no answer within 60.0 s")
    with pytest.raises(EpLinkError, match="head: sync point 1 failed waiting for worker rank 1: worker rank 1 sent no"):
        head.sync()


def test_shutdown_is_a_sync_point_and_shuts_down_even_when_the_sync_raises() -> None:
    head, transport = sync_head([])
    transport.answers_of = {1: [report(1), agreeing(transport, reports=1)], 2: [agreeing(transport)]}
    with pytest.raises(EpWorkerFailed, match="worker rank 1 failed command 1"):
        head.shutdown_workers()
    assert transport.sent[-2:] == [sync(1), header(CMD_SHUTDOWN)]
    assert head.workers_shut_down
    head.shutdown_workers()  # done: nothing more is sent
    assert len(transport.sent) == 4


def test_a_one_rank_group_has_nothing_to_sync() -> None:
    solo = EpLink(SoloTransport(), num_slots=2)
    solo.sync()
    solo.shutdown_workers()
    assert solo.gather_u32(5) == [5] and solo.min_u32(5) == 5
    solo.assert_ranks_agree(chunk=3)


def test_only_the_head_syncs() -> None:
    with pytest.raises(EpRoleError, match="only the head"):
        link(FakeTransport(1, 2)).sync()


def worker_on(messages: Sequence[Sequence[int]]) -> tuple[EpLink, ReplayTransport]:
    transport = ReplayTransport(messages)
    return EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2), transport


def test_a_worker_reports_each_failed_command_and_answers_a_sync_point() -> None:
    recorder: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=4)
    recorder.ep_link.send_command(0, 7)
    recorder.ep_link.send_command(1, 8, 9)  # the worker reads no word: the command fails
    recorder.ep_link.send_command(2, 7)
    recorder.ep_link.shutdown_workers()
    worker, transport = worker_on(recorder.wire)

    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd == 7 and seq_id == 0:
            raise KeyError("slot 0 is free")

    with pytest.raises(EpCommandFailed):
        worker.step(run, no_slots() + no_slots())
    with pytest.raises(EpCommandFailed, match=r"command 2 .* left a follow-up word"):  # at once: it came whole
        worker.step(run, no_slots() + no_slots())
    assert worker.step(run, no_slots() + no_slots()) is True
    assert worker.step(run, no_slots() + no_slots()) is False  # the sync point was answered on the way
    answers = [decode_answer(answer) for answer in transport.answers]
    assert answers[0] == Report(1, 0, 7, "KeyError: 'slot 0 is free'")
    assert (
        isinstance(answers[1], Report)
        and answers[1][:3] == (2, 1, 8)
        and "left a follow-up word (9)" in answers[1].error
    )
    ack = answers[2]
    assert isinstance(ack, Ack) and (ack.number, ack.commands, ack.reports, ack.state_digest) == (1, 3, 2, None)
    # The worker's stream digest is the head's: every message up to the sync point's, in order.
    crc = 0
    for message in recorder.wire[:-1]:
        crc = fold_message(crc, [array("I", message)])
    assert ack.stream_crc == crc


def test_a_worker_answers_its_state_digest_when_asked() -> None:
    worker, transport = worker_on([sync(4, compare_state=True), header(CMD_SHUTDOWN)])
    worker.state_digest = lambda slots: 99
    assert worker.step(ignore, no_slots()) is False
    ack = decode_answer(transport.answers[0])
    assert isinstance(ack, Ack) and (ack.number, ack.state_digest) == (4, 99)


def test_state_digest_must_be_a_function() -> None:
    with pytest.raises(TypeError, match="state_digest must be a function of the slots or None, got int"):
        link(FakeTransport(0, 2)).state_digest = 3  # type: ignore[assignment]


def after_setup(transport: FakeTransport, peers: list[list[int]]) -> EpLink:
    """A head whose setup saw every rank agree, and whose later gathers meet ``peers``."""
    head = link(transport)
    transport._peers = peers
    return head


def test_values_every_rank_must_agree_on() -> None:
    head = after_setup(FakeTransport(0, 3), [[4], [2]])
    assert head.gather_u32(9) == [9, 4, 2] and head.min_u32(9) == 2
    with pytest.raises(TypeError, match="value must be an int"):
        head.gather_u32(True)


def test_a_disagreement_lists_every_value_that_differs_with_each_ranks() -> None:

    names = zlib.crc32(b"chunk\0tokens")
    head = after_setup(FakeTransport(0, 3), [[names, 16, 40], [names, 32, 41]])
    with pytest.raises(EpDivergenceError) as info:
        head.assert_ranks_agree(tokens=40, chunk=16)
    assert str(info.value) == (
        "rank 0: the ranks disagree on chunk (rank 0: 16, rank 1: 16, rank 2: 32); "
        "tokens (rank 0: 40, rank 1: 40, rank 2: 41)"
    )
    assert info.value.ranks == (2,)
    other_names = after_setup(FakeTransport(0, 2), [[0, 16]])
    with pytest.raises(EpDivergenceError, match="the ranks disagree on the names of the values"):
        other_names.assert_ranks_agree(chunk=16)
    with pytest.raises(ValueError, match="at most 12 values"):
        head.assert_ranks_agree(**{f"v{i}": i for i in range(13)})
