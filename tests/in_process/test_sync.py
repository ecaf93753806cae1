"""Sync points and agreement checks in one process: a one-rank group, roles, a worker's answers to a recorded head.

The head against real workers' answers (reports, refusals, sync points that agree or
differ) is ``test_way_back.py``.
"""

import zlib
from array import array
from collections.abc import MutableSequence, Sequence

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandFailed,
    EpDivergenceError,
    EpLink,
    EpRoleError,
    ProtocolVersion,
    SequenceState,
)
from metrale_model_engine.testing import RecordingEp, ReplayTransport
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import Ack, Report, decode_answer, fold_message

from helpers.fakes import FakeTransport, ignore, link, no_slots
from helpers.messages import header, sync

Slots = MutableSequence[SequenceState | None]


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
