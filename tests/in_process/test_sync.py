"""Sync points and agreement checks: a one-rank group, roles, a worker's answers, values every rank must agree on.

A real head and real workers over the in-memory wire (``LinkPair``); the head against
workers' reports, refusals and sync points that agree or differ is ``test_way_back.py``.
"""

import contextlib
import zlib
from collections.abc import Callable, MutableSequence

import pytest

from metrale_model_engine import (
    EpDivergenceError,
    EpLink,
    EpRoleError,
    EpWorkerFailed,
    SequenceState,
    WorkerFailure,
)
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import Ack, decode_answer, fold_message

from helpers.messages import sync, words
from helpers.pair import LinkPair

Slots = MutableSequence[SequenceState | None]


def test_a_one_rank_group_has_nothing_to_sync() -> None:
    solo = EpLink(SoloTransport(), num_slots=2)
    solo.sync()
    solo.shutdown_workers()
    assert solo.gather_u32(5) == [5] and solo.min_u32(5) == 5
    solo.assert_ranks_agree(chunk=3)


def test_only_the_head_syncs() -> None:
    with pytest.raises(EpRoleError, match="only the head"):
        LinkPair().worker.sync()


def acks_read_by(pair: LinkPair) -> list[Ack]:
    """The acknowledgements the head reads from now on, as it reads them (the answers pass on unchanged)."""
    acks: list[Ack] = []
    receive = pair.head_end.receive_answers

    def reading(rank: int, timeout: float | None) -> list[bytes]:
        answers = receive(rank, timeout)
        acks.extend(ack for ack in map(decode_answer, answers) if isinstance(ack, Ack))
        return answers

    pair.head_end.receive_answers = reading  # type: ignore[method-assign]
    return acks


def test_a_worker_reports_each_failed_command_and_answers_a_sync_point() -> None:
    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd == 7 and seq_id == 0:
            raise KeyError("slot 0 is free")

    pair = LinkPair(run, held=True)  # the reports wait for the sync point, as over a group
    acks = acks_read_by(pair)
    pair.head.send_command(0, 7)
    pair.head.send_command(1, 8, 9)  # the worker reads no word: the command fails, at once (it came whole)
    pair.head.send_command(2, 7)
    with pytest.raises(EpWorkerFailed) as info:
        pair.head.sync()  # the worker catches up: two failures, then its acknowledgement
    first, second = info.value.failures
    assert first == WorkerFailure(1, 1, 0, 7, "KeyError: 'slot 0 is free'")
    assert (second.rank, second.command, second.seq_id, second.cmd) == (1, 2, 1, 8)
    assert "command 2 (seq_id=1, cmd=8) left a follow-up word (9) unread" in second.error
    assert [type(error).__name__ for error in pair.raised[1]] == ["EpCommandFailed", "EpCommandFailed"]
    (ack,) = acks
    assert (ack.number, ack.commands, ack.reports, ack.state_digest) == (1, 3, 2, None)
    # The worker's stream digest is the head's: every message up to the sync point's, in order.
    crc = 0
    for message in pair.head_end.sent:
        crc = fold_message(crc, [message])
    assert ack.stream_crc == crc and words(pair.head_end.sent[-1]) == sync(1)


def test_a_worker_answers_its_state_digest_when_asked() -> None:
    pair = LinkPair()
    acks = acks_read_by(pair)
    pair.head.state_digest = pair.worker.state_digest = lambda slots: 99
    pair.head.sync([None] * 4)
    assert words(pair.head_end.sent[-1]) == sync(1, compare_state=True)
    assert [(ack.number, ack.state_digest) for ack in acks] == [(1, 99)]


def test_state_digest_must_be_a_function() -> None:
    pair = LinkPair()
    for link in (pair.head, pair.worker):
        with pytest.raises(TypeError, match="state_digest must be a function of the slots or None, got int"):
            link.state_digest = 3  # type: ignore[assignment]


def workers_first(pair: LinkPair, call: Callable[[EpLink], object]) -> None:
    """Each worker takes part before the head, as in one thread it must: it sees only the ranks before it, so
    what it gets is not what a group gives it, and is not checked; the head's is."""
    for link in pair.workers.values():
        with contextlib.suppress(EpDivergenceError):
            call(link)


def test_values_every_rank_must_agree_on() -> None:
    pair = LinkPair(world_size=3)
    pair.workers[1].gather_u32(4)
    pair.workers[2].gather_u32(2)
    assert pair.head.gather_u32(9) == [9, 4, 2]
    pair.workers[1].gather_u32(4)
    pair.workers[2].gather_u32(2)
    assert pair.head.min_u32(9) == 2
    with pytest.raises(TypeError, match="value must be an int"):
        pair.head.gather_u32(True)


def test_a_disagreement_lists_every_value_that_differs_with_each_ranks() -> None:
    pair = LinkPair(world_size=3)
    values = {1: {"tokens": 40, "chunk": 16}, 2: {"tokens": 41, "chunk": 32}}
    workers_first(pair, lambda link: link.assert_ranks_agree(**values[link.rank]))
    with pytest.raises(EpDivergenceError) as info:
        pair.head.assert_ranks_agree(tokens=40, chunk=16)
    assert str(info.value) == (
        "rank 0: the ranks disagree on chunk (rank 0: 16, rank 1: 16, rank 2: 32); "
        "tokens (rank 0: 40, rank 1: 40, rank 2: 41)"
    )
    assert info.value.ranks == (2,)
    other_names = LinkPair()
    workers_first(other_names, lambda link: link.assert_ranks_agree(chunks=16))
    with pytest.raises(EpDivergenceError, match="the ranks disagree on the names of the values") as named:
        other_names.head.assert_ranks_agree(chunk=16)
    assert f"rank 0: {zlib.crc32(b'chunk')}" in str(named.value)
    with pytest.raises(ValueError, match="at most 12 values"):
        pair.head.assert_ranks_agree(**{f"v{i}": i for i in range(13)})
