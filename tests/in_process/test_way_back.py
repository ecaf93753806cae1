"""The way back, a real worker's reader and way back against a real head, stepped in one thread (``LinkPair``).

What a worker answers (its reports, refusals, witness and leaving, its acknowledgements
of sync points) is decoded by the head's reports and sync points as it is over a
transport; only the wire is in memory.
"""

import os
from array import array
from collections.abc import Callable

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandFailed,
    EpCommandRefused,
    EpDivergenceError,
    EpLink,
    EpLinkError,
    EpReceiveError,
    EpWorkerFailed,
    RunStopped,
    SequenceState,
    WorkerFailure,
)
from metrale_model_engine.wire import ANSWER_BYTES

from helpers.messages import header, sync, whole, word, words
from helpers.pair import LinkPair, Slots

FREE = "KeyError: 'slot 0 is free'"
NOT_SENT = "; nothing of the command being sent was sent"


def fails_on(*failing: int) -> Callable[[int, int, Slots], None]:
    """A worker hook that fails each command word of ``failing`` as a slot that is free, and runs the rest."""

    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd in failing:
            raise KeyError(f"slot {seq_id} is free")

    return run


def fails_with(error: Exception) -> Callable[[int, int, Slots], None]:
    """A worker hook whose every command raises ``error``."""

    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        raise error

    return run


def test_an_ordinary_failure_is_raised_on_the_head_at_its_next_send_and_only_once() -> None:
    pair = LinkPair(fails_on(7), world_size=3)
    pair.head.send_command(0, 7)
    for rank in (1, 2):
        with pytest.raises(EpCommandFailed, match="KeyError"):
            pair.step(rank)
    with pytest.raises(EpWorkerFailed) as info:
        pair.head.send_command(1, 8, 5)
    assert info.value.failures == (WorkerFailure(1, 1, 0, 7, FREE), WorkerFailure(2, 1, 0, 7, FREE))
    assert str(info.value) == (
        f"worker rank 1 failed command 1 (seq_id=0, cmd=7): {FREE}; "
        f"worker rank 2 failed command 1 (seq_id=0, cmd=7): {FREE}{NOT_SENT}"
    )
    assert len(pair.head_end.sent) == 1 and pair.head.commands == 1  # the new command was not sent
    pair.head.send_command(1, 8, 5)  # raised once: the next send goes through, and the workers stayed in step
    assert words(pair.head_end.sent[-1]) == whole(8, 1) + word(5)
    pair.run = lambda seq_id, cmd, slots: slots.__setitem__(seq_id, SequenceState(seq_id, [pair.stepping.recv_word()]))
    assert pair.step(1) is True and pair.slots[1][1] == SequenceState(1, [5])
    pair.head.sync()  # the reports were counted: worker rank 2 catches up, and both agree
    assert pair.raised == {1: [], 2: []}


def test_failures_held_until_a_sync_point_are_raised_there() -> None:
    pair = LinkPair(fails_on(7), held=True)
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandFailed):
        pair.step()
    pair.head.send_command(1, 8)  # the report waits for the worker's flush: nothing is raised yet
    with pytest.raises(EpWorkerFailed) as info:
        pair.head.sync()
    assert info.value.failures == (WorkerFailure(1, 1, 0, 7, FREE),)
    assert pair.worker_ends[1].flushes == 1
    pair.head.sync()  # the acknowledgement counted the report the head read: they agree


def test_a_refused_collective_command_stops_the_run_on_the_worker_and_then_on_the_head() -> None:
    pair = LinkPair(fails_on(7), collective={7})
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandRefused) as refused:
        pair.step()
    assert str(refused.value) == (
        "worker rank 1: command 1 (seq_id=0, cmd=7), which runs collectives, failed here, "
        f"so the run stops on every rank: {FREE}"
    )
    assert refused.value.failures == (WorkerFailure(1, 1, 0, 7, FREE, stopped=True),)
    assert pair.worker.closed and str(pair.worker.stopped) == str(refused.value)
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(1, 8, 5)
    assert info.value.failures == (WorkerFailure(1, 1, 0, 7, FREE, stopped=True),)
    assert info.value.ranks == (1,)
    assert (
        str(info.value) == f"head: the run stopped: worker rank 1 failed command 1 (seq_id=0, cmd=7): {FREE}{NOT_SENT}"
    )
    assert pair.head.closed and str(pair.head.stopped) == str(info.value)
    calls: list[Callable[[], None]] = [lambda: pair.head.send_command(1, 8), pair.head.sync, pair.head.shutdown_workers]
    for call in calls:
        with pytest.raises(RunStopped, match=r"head: the run stopped earlier \(head: the run stopped: worker rank 1"):
            call()


def test_a_refusal_ends_a_sync_point_without_waiting_for_that_worker() -> None:
    pair = LinkPair(fails_on(9), world_size=3, collective={9})
    pair.head.send_command(0, 7)
    pair.head.send_command(1, 9)  # both workers catch up at the sync point; the second is refused on both
    with pytest.raises(RunStopped, match=r"worker rank 1 failed command 2 \(seq_id=1, cmd=9\): KeyError") as info:
        pair.head.sync()
    assert info.value.ranks == (1,)
    assert [type(error) for error in pair.raised[1]] == [EpCommandRefused]
    assert pair.raised[2] == []  # the head stopped at rank 1's refusal: rank 2 was never waited for


def test_a_command_that_runs_an_undeclared_collective_is_refused_naming_what_to_declare() -> None:
    pair = LinkPair(lambda seq_id, cmd, slots: pair.stepping.check_collective("an all-reduce"))
    pair.head.send_command(0, 9)
    with pytest.raises(EpCommandRefused, match="cmd=9") as refused:
        pair.step()
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(0, 9)
    (failure,) = info.value.failures
    assert failure.stopped and not failure.witness and failure.error in str(refused.value)
    assert "an all-reduce" in failure.error


def test_a_collective_command_that_ran_none_is_refused() -> None:
    pair = LinkPair(collective={7})
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandRefused, match="ran no collective"):
        pair.step()
    with pytest.raises(RunStopped, match="worker rank 1 failed command 1"):
        pair.head.send_command(0, 7)


def test_a_worker_whose_collective_failed_reports_as_a_witness() -> None:
    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        pair.stepping.check_collective("an all-reduce")
        raise pair.stepping.collective_failed(RuntimeError("Connection closed by peer"), what="an all-reduce")

    pair = LinkPair(run, collective={7})
    pair.head.send_command(0, 7)
    with pytest.raises(RunStopped) as stopped:
        pair.step()
    assert str(stopped.value) == (
        "worker rank 1: the run stopped in command 1 (seq_id=0, cmd=7): an all-reduce failed, so a rank died, "
        "left the run or stalls: RuntimeError: Connection closed by peer"
    )
    assert pair.worker.closed
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(1, 7)
    text = "an all-reduce failed here: RuntimeError: Connection closed by peer"
    assert info.value.failures == (WorkerFailure(1, 1, 0, 7, text, stopped=True, witness=True),)


def test_a_hook_that_stops_the_run_itself_tells_the_head_why_before_it_leaves() -> None:
    pair = LinkPair(fails_with(RunStopped("the model's own reason")))
    pair.head.send_command(2, 7)
    with pytest.raises(RunStopped, match="the model's own reason"):
        pair.step()
    assert pair.worker.closed and str(pair.worker.stopped) == "the model's own reason"
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(0, 7)
    assert info.value.failures == (WorkerFailure(1, 1, 2, 7, "RunStopped: the model's own reason", stopped=True),)


def test_check_workers_raises_a_report_ordinary_or_stopping() -> None:
    pair = LinkPair(fails_on(7, 9), collective={9})
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandFailed):
        pair.step()
    with pytest.raises(EpWorkerFailed, match=r"worker rank 1 failed command 1 \(seq_id=0, cmd=7\)"):
        pair.head.check_workers()
    assert pair.head.stopped is None and not pair.head.closed
    pair.head.send_command(1, 9)
    with pytest.raises(EpCommandRefused):
        pair.step()
    with pytest.raises(RunStopped, match=r"the run stopped: worker rank 1 failed command 2 .*: KeyError: 'slot 1"):
        pair.head.check_workers()
    assert pair.head.closed


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (ValueError("no such file: " + os.fsdecode(b"/data/\xff.bin")), "ValueError: no such file: /data/\\udcff.bin"),
        (ValueError("two\nlines\0and a NUL"), "ValueError: two\nlines\0and a NUL"),
        (_Unprintable(), "_Unprintable: <its str() raised RuntimeError>"),
        (KeyError(), "KeyError"),
    ],
)
def test_a_reports_text_reaches_the_head_readable(error: Exception, shown: str) -> None:
    pair = LinkPair(fails_with(error))
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandFailed):
        pair.step()
    with pytest.raises(EpWorkerFailed) as info:
        pair.head.send_command(0, 7)
    assert info.value.failures[0].error == shown
    str(info.value).encode()  # UTF-8 takes it


def test_a_report_of_megabytes_reaches_the_head_cut_to_one_answer() -> None:
    pair = LinkPair(fails_with(ValueError("x" * (8 << 20))))
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandFailed):
        pair.step()
    with pytest.raises(EpWorkerFailed) as info:
        pair.head.send_command(0, 7)
    error = info.value.failures[0].error
    assert error.startswith("ValueError: xxx") and error.endswith("...")
    assert len(error.encode()) == ANSWER_BYTES - 24


# -- sync points ---------------------------------------------------------------


def test_a_sync_point_where_every_worker_agrees_returns_and_shutdown_ends_the_workers() -> None:
    pair = LinkPair(world_size=3)
    pair.head.send_command(0, 7)
    pair.head.send_command(1, 7)
    pair.head.sync()
    assert words(pair.head_end.sent[-1]) == sync(1)
    assert all(link.commands == 2 for link in pair.workers.values())
    pair.head.shutdown_workers()
    assert [words(message) for message in pair.head_end.sent[-2:]] == [sync(2), header(CMD_SHUTDOWN)]
    assert pair.step(1) is False and pair.step(2) is False
    assert pair.raised == {1: [], 2: []}


def digest(slots: Slots) -> int:
    return sum(1 << seq_id for seq_id, state in enumerate(slots) if state is not None)


def test_state_digests_are_compared_with_the_heads() -> None:
    pair = LinkPair(world_size=3)
    for link in (pair.head, *pair.workers.values()):
        link.state_digest = digest
    head_slots: Slots = [SequenceState(0), None, None, None]
    pair.slots[1][0] = SequenceState(0)
    pair.slots[2][1] = SequenceState(1)  # worker rank 2 holds another slot
    pair.head.send_command(0, 7)
    with pytest.raises(
        EpDivergenceError, match=r"worker rank 2: its state digest is 0x0000000000000002, the head's"
    ) as info:
        pair.head.sync(head_slots)
    assert info.value.ranks == (2,)
    # The stream digest counts the sync item, which asked for the state: it carries flag 1.
    assert words(pair.head_end.sent[-1]) == sync(1, compare_state=True)
    pair.slots[2][1], pair.slots[2][0] = None, SequenceState(0)
    pair.head.sync(head_slots)  # in step again: they agree


def test_a_worker_without_a_state_digest_is_named() -> None:
    pair = LinkPair()
    pair.head.state_digest = digest
    pair.head.send_command(0, 7)
    with pytest.raises(EpDivergenceError, match="worker rank 1: it computed no state digest"):
        pair.head.sync([None] * 4)


def test_a_worker_that_missed_a_command_is_a_divergence_naming_it() -> None:
    pair = LinkPair(world_size=3)
    pair.head.send_command(0, 7)
    pair.head.send_command(1, 7)
    pair.wire.inbox[2].pop()  # the wire lost the second command on its way to worker rank 2
    with pytest.raises(EpDivergenceError, match="worker rank 2: received 1 commands where the head sent 2") as info:
        pair.head.sync()
    assert info.value.ranks == (2,)
    assert "no sync point has seen every rank agree yet: they diverged within commands 1 ..= 2" in str(info.value)


def test_a_worker_that_read_another_word_is_a_divergence_of_the_streams_crc() -> None:
    def run(seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd == 8:
            pair.stepping.recv_word()

    pair = LinkPair(run, world_size=3)
    pair.head.send_command(0, 7)
    pair.head.sync()
    pair.head.send_command(1, 8, 5)
    assert words(pair.wire.inbox[2][-1]) == whole(8, 1) + word(5)
    pair.wire.inbox[2][-1] = array("I", whole(8, 1) + word(6)).tobytes()  # the wire changed a word for worker rank 2
    with pytest.raises(EpDivergenceError, match="worker rank 2: its command stream's CRC-32 is 0x") as info:
        pair.head.sync()
    assert "they agreed at the last sync point, after command 1: they diverged within commands 2 ..= 2" in str(
        info.value
    )


def test_reports_that_never_arrived_are_a_link_error() -> None:
    pair = LinkPair(fails_on(7))
    pair.head.send_command(0, 7)
    with pytest.raises(EpCommandFailed):
        pair.step()
    pair.wire.outbox[1].clear()  # the wire lost the report
    with pytest.raises(EpLinkError, match=r"reports of worker rank\(s\) \[1\] were lost"):
        pair.head.sync()


def test_a_sync_point_whose_worker_does_not_answer_stops_the_run_naming_it() -> None:
    pair = LinkPair(world_size=3)
    pair.head.send_command(0, 7)
    pair.step(1)
    pair.worker_ends[1].closed = True  # its receive fails: the worker leaves its loop without an answer
    with pytest.raises(RunStopped) as info:
        pair.head.sync()
    assert str(info.value) == (
        "head: the run stopped at sync point 1: worker rank 1 did not answer: worker rank 1 sent no answer"
    )
    assert isinstance(info.value, EpLinkError) and info.value.ranks == (1,)  # what `except EpLinkError` caught
    assert [type(error) for error in pair.raised[1]] == [EpReceiveError]
    assert pair.head.closed and pair.head_end.closed and str(pair.head.stopped) == str(info.value)
    with pytest.raises(RunStopped, match=r"the run stopped earlier \(head: the run stopped at sync point 1"):
        pair.head.send_command(0, 7)


def test_a_shutdown_whose_sync_point_found_a_worker_silent_still_shuts_down_and_stops_the_run() -> None:
    pair = LinkPair()
    pair.head.send_command(0, 7)
    pair.step()
    pair.worker_ends[1].closed = True
    with pytest.raises(RunStopped, match="at sync point 1: worker rank 1 did not answer"):
        pair.head.shutdown_workers()
    assert pair.head.workers_shut_down and pair.head.closed
    pair.head.shutdown_workers()  # done: nothing more is sent, nothing raised


def test_shutdown_is_a_sync_point_and_shuts_down_even_when_the_sync_raises() -> None:
    pair = LinkPair(fails_on(7), held=True)
    pair.head.send_command(0, 7)
    pair.head.send_command(1, 8)
    with pytest.raises(EpWorkerFailed, match="worker rank 1 failed command 1"):
        pair.head.shutdown_workers()
    assert [type(error) for error in pair.raised[1]] == [EpCommandFailed]
    assert [words(message) for message in pair.head_end.sent[-2:]] == [sync(1), header(CMD_SHUTDOWN)]
    assert pair.head.workers_shut_down
    pair.head.shutdown_workers()  # done: nothing more is sent
    assert len(pair.head_end.sent) == 4
    assert pair.step() is False


def test_the_heads_failed_forward_names_a_worker_that_stopped_the_run_before_its_own_error() -> None:
    pair = LinkPair(fails_on(5), collective={5})
    pair.head.send_command(0, 5)
    with pytest.raises(EpCommandRefused):
        pair.step()  # the worker leaves the run: the head's all-reduce fails for it
    with pytest.raises(RunStopped) as info, pair.head.collective():
        raise RuntimeError("Connection closed by peer")
    assert str(info.value) == (
        "head: the run stopped in command 1 (seq_id=0, cmd=5): worker rank 1 failed command 1 (seq_id=0, cmd=5): "
        "KeyError: 'slot 0 is free'"
    )
    assert info.value.ranks == (1,) and pair.head.closed


@pytest.mark.parametrize(
    ("call", "after"),
    [
        (lambda link: link.send_command(0, 5), 0),
        (lambda link: link.send_header(0, 5), 0),
        (lambda link: (link.send_header(0, 5), link.send_word(1)), 1),
        (lambda link: (link.send_header(0, 5), link.send_tokens([1, 2])), 1),
        (lambda link: link.sync(), 0),
        (lambda link: link.shutdown_workers(), 0),  # the sync point's send fails
        (lambda link: link.shutdown_workers(), 1),  # the sync point passes, the shutdown header fails
    ],
    ids=["send_command", "send_header", "send_word", "send_tokens", "sync", "shutdown-sync", "shutdown-header"],
)
def test_a_send_that_finds_workers_lost_stops_the_run_and_closes_the_link(
    call: Callable[[EpLink], object], after: int
) -> None:
    pair = LinkPair()
    pair.head.send_command(0, 5)
    pair.step()
    pair.head_end.cut(after=after, lost={1: 9.0})
    with pytest.raises(RunStopped, match=r"worker rank\(s\) \[1\]"):
        call(pair.head)
    assert pair.head.stopped is not None
    assert pair.head.closed and pair.head_end.closed  # the link closed itself, and its transport


def test_a_heads_failed_collective_names_the_worker_that_stopped_the_run_and_then_says_it_stopped_earlier() -> None:
    pair = LinkPair(fails_on(5), collective={5})
    pair.head.send_command(0, 5)
    with pytest.raises(EpCommandRefused):
        pair.step()  # the worker leaves: the head's all-reduce fails for it
    stopped = pair.head.collective_failed(RuntimeError("Connection closed by peer"), what="an all-reduce", grace=0.0)
    assert str(stopped) == (
        "head: the run stopped in command 1 (seq_id=0, cmd=5): worker rank 1 failed command 1 (seq_id=0, cmd=5): "
        f"{FREE}"
    )
    assert stopped.ranks == (1,) and pair.head.closed and pair.head_end.closed
    again = pair.head.collective_failed(RuntimeError("timed out"), what="an all-reduce")
    assert str(again).startswith("head: the run stopped earlier (head: the run stopped in command 1")
