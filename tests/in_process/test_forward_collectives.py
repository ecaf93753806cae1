"""The safe pattern holds itself: a forward's collectives must be declared, and a declared forward must run one.

``EpLink.check_collective`` is what ``Collectives`` calls before each all-reduce; here
a model calls it directly (torch-free), and the link's parts are real over the
in-memory transports.  Worker: a command of ``ep_collective_commands`` that ran no
collective, and a collective in a command not declared, are refused (reported to the
head as stopping the run).  Head: a collective between sending a command and the end
of its forward outside ``collective()``, and a ``collective()`` block that ran none,
stop the run.  Outside any command, a collective is allowed.
"""

from collections.abc import MutableSequence

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandRefused,
    EpLink,
    LinkedEp,
    ProtocolVersion,
    RunStopped,
    SequenceState,
    run_worker,
)
from metrale_model_engine.testing import RecordingEp, RecordingTransport, ReplayTransport
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import Report, decode_answer, encode_close

from helpers.messages import header, words
from helpers.pair import LinkPair

FORWARD, EMPTY, OPEN = 7, 8, 9
Slots = MutableSequence[SequenceState | None]


class Model(LinkedEp[SequenceState]):
    """FORWARD runs one collective unless told to skip it; EMPTY says its forward is empty; OPEN runs one too."""

    __slots__ = ("ep_link", "in_block", "skip")
    ep_collective_commands = frozenset({FORWARD, EMPTY})

    def __init__(self, link: EpLink, *, skip: bool = False, in_block: bool = False) -> None:
        self.ep_link = link
        self.skip = skip
        self.in_block = in_block

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        link = self.ep_link
        if cmd == FORWARD and not self.skip:
            link.check_collective("an all-reduce")
        elif cmd == EMPTY:
            link.empty_forward()
        elif cmd == OPEN:
            slots[seq_id] = SequenceState(seq_id)
            if self.in_block:
                with link.collective():  # the part of an undeclared command that runs collectives
                    link.check_collective("an all-reduce")
            else:
                link.check_collective("an all-reduce")
        elif cmd != FORWARD:
            super().ep_run_command(seq_id, cmd, slots)


def replayed(*commands: int, **options: bool) -> tuple[Model, ReplayTransport, BaseException | None]:
    """A worker that runs ``commands`` (slot 0) from a recording; what it raised, if anything."""
    head: RecordingEp[SequenceState] = RecordingEp(protocol_v2=True, num_slots=2)
    for cmd in commands:
        head.ep_link.send_command(0, cmd)
    head.ep_link.shutdown_workers()
    transport = ReplayTransport(head.wire)
    worker = Model(EpLink(transport, num_slots=2, protocol=ProtocolVersion.V2), **options)
    try:
        slots: Slots = [None, None]
        run_worker(worker, slots)
    except RunStopped as error:
        return worker, transport, error
    return worker, transport, None


def stop_report(transport: ReplayTransport) -> Report:
    (answer,) = [decode_answer(answer) for answer in transport.answers if isinstance(decode_answer(answer), Report)]
    assert isinstance(answer, Report) and answer.stopped
    return answer


def test_a_worker_runs_declared_collectives_and_collectives_outside_any_command() -> None:
    worker, _, error = replayed(FORWARD, EMPTY, FORWARD)
    assert error is None
    worker.ep_link.check_collective("an all-reduce")  # after the run, outside any command: the program's own


def test_a_declared_command_whose_forward_ran_no_collective_is_refused_at_once() -> None:
    _, transport, error = replayed(FORWARD, FORWARD, skip=True)
    assert isinstance(error, EpCommandRefused)
    assert "worker rank 1: command 1 (seq_id=0, cmd=7), which runs collectives, failed here" in str(error)
    report = stop_report(transport)
    assert report.command == 1 and report.error.startswith("it ran no collective: cmd 7 is in ep_collective_commands")
    assert "torch.distributed called directly" in report.error and report.error.endswith("link.empty_forward()")


def test_a_collective_in_a_command_not_declared_is_refused_naming_what_to_declare() -> None:
    _, transport, error = replayed(OPEN)
    assert isinstance(error, EpCommandRefused)
    assert stop_report(transport).error == (
        "an all-reduce ran in cmd 9, which ep_collective_commands does not declare: add 9 to the model's "
        "ep_collective_commands (a failure there must stop every rank, not leave them in the collective)"
    )


@pytest.mark.parametrize("cmd", [0, 0xFFFF, 0x10000, 0xFFFFFFFE])
@pytest.mark.parametrize("declared", [True, False], ids=["ran-none", "undeclared"])
def test_a_workers_refusal_fits_one_answer_whole_whatever_the_word(cmd: int, declared: bool) -> None:
    pair = LinkPair(
        (lambda seq_id, cmd, slots: None) if declared else lambda seq_id, cmd, slots: pair.stepping.check_collective(),
        collective={cmd} if declared else frozenset(),
    )
    pair.head.send_command(0, cmd)
    with pytest.raises(EpCommandRefused):
        pair.step()
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(0, cmd)
    (failure,) = info.value.failures
    end = "link.empty_forward()" if declared else "not leave them in the collective)"
    assert failure.error.endswith(end), failure.error  # not cut: what to declare reaches the head whole


def test_a_workers_collective_block_declares_the_part_of_its_hook_that_runs_collectives() -> None:
    _, transport, error = replayed(OPEN, FORWARD, in_block=True)
    assert error is None and not transport.answers[:-1]  # nothing but the shutdown's acknowledgement


def head() -> EpLink:
    return EpLink(RecordingTransport(2), num_slots=2, protocol=ProtocolVersion.V2)


def test_the_heads_forward_inside_its_collective_block_runs_and_the_block_ends_it() -> None:
    link = head()
    link.check_collective()  # at setup, before any command
    link.send_command(0, FORWARD)
    with link.collective():
        link.check_collective()
    link.check_collective()  # its forward has ended: outside any forward, the program's own
    link.send_command(0, EMPTY)
    link.empty_forward()
    with link.collective():
        pass
    link.shutdown_workers()
    link.check_collective()  # after the shutdown
    assert link.stopped is None


def test_a_heads_collective_outside_its_collective_block_stops_the_run_the_first_time() -> None:
    link = head()
    link.send_command(0, FORWARD)
    with pytest.raises(RunStopped) as info:
        link.check_collective("an all-reduce")
    assert str(info.value) == (
        "head: the run stopped in command 1 (seq_id=0, cmd=7): an all-reduce ran after the head sent cmd 7, outside "
        "`with link.collective():`: run the head's forward of cmd 7 inside that block (and declare 7 in "
        "ep_collective_commands), so that a failure of it stops every rank"
    )
    assert link.closed
    with pytest.raises(RunStopped, match="the run stopped earlier"):
        link.check_collective()


def test_a_heads_collective_block_that_ran_no_collective_stops_the_run() -> None:
    link = head()
    link.send_command(0, FORWARD)
    with pytest.raises(RunStopped, match=r"in command 1 \(seq_id=0, cmd=7\): it ran no collective"), link.collective():
        pass
    assert link.closed


def test_a_value_gathered_by_the_link_is_a_collective_of_the_forward() -> None:
    link = head()
    link.send_command(0, FORWARD)
    with link.collective():
        assert link.gather_u32(5) == [5, 5]


def test_an_empty_forward_is_said_of_a_command_in_flight_only() -> None:
    link = head()
    with pytest.raises(RuntimeError, match=r"empty_forward\(\) speaks of the forward of a command in flight"):
        link.empty_forward()


def test_one_rank_enforces_nothing() -> None:
    link = EpLink(SoloTransport(), num_slots=2)
    link.send_command(0, FORWARD)
    link.check_collective()
    with link.collective():
        pass
    link.empty_forward()
    assert link.stopped is None


# -- the head owes the forward of every command whose word runs collectives ------------------------------------


def forward(pair: LinkPair, cmd: int = FORWARD) -> None:
    """The head sends ``cmd`` and runs its forward, one collective, as the README's model does; worker rank 1 too."""
    pair.head.send_command(0, cmd)
    with pair.head.collective():
        pair.head.check_collective("an all-reduce")
    assert pair.step() is True


SKIPPED = (
    "head: the run stopped in command 2 (seq_id=0, cmd=7): the head {doing} without running its forward: the "
    "forward of cmd 7 runs collectives ({why}), which the workers wait in; run the head's forward of every cmd 7 "
    "inside `with link.collective():` (an empty one says link.empty_forward())"
)


def test_a_head_that_skips_a_forward_it_ran_before_is_stopped_at_its_next_command_naming_it() -> None:
    pair = LinkPair(lambda seq_id, cmd, slots: pair.stepping.check_collective(), collective={FORWARD})
    forward(pair)
    pair.head.send_command(0, FORWARD)  # a cache hit's early return: the head's forward never runs
    with pytest.raises(RunStopped) as info:
        pair.head.send_command(0, OPEN)
    assert str(info.value) == SKIPPED.format(doing="sent the next command", why="its earlier forwards ran them")
    # Nothing of the next command was sent: the head closed its link, which tells the workers so.
    assert [words(message) for message in pair.head_end.sent[2:]] == [words(encode_close())]
    assert pair.head.commands == 2 and pair.head.closed and pair.head_end.closed
    with pytest.raises(RunStopped, match="the run stopped earlier"):
        pair.head.send_command(0, OPEN)


@pytest.mark.parametrize("point", ["sync", "shutdown_workers"])
def test_a_head_that_skips_its_last_forward_is_stopped_at_its_sync_point(point: str) -> None:
    pair = LinkPair(lambda seq_id, cmd, slots: pair.stepping.check_collective(), collective={FORWARD})
    forward(pair)
    pair.head.send_command(0, FORWARD)
    with pytest.raises(RunStopped) as info:
        getattr(pair.head, point)()
    assert str(info.value) == SKIPPED.format(doing="reached a sync point", why="its earlier forwards ran them")
    # No sync item went out (no wait on workers that are in a collective): the close, and a shutdown's header.
    after = [words(message) for message in pair.head_end.sent[2:]]
    assert after == [words(encode_close())] + ([header(CMD_SHUTDOWN)] if point == "shutdown_workers" else [])
    assert pair.head.closed


class Declared(LinkedEp[SequenceState]):
    """A head model that declares FORWARD: its link is handed the declaration as the model takes it."""

    __slots__ = ("ep_link",)
    ep_collective_commands = frozenset({FORWARD})

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link


def test_a_declared_command_whose_first_forward_the_head_skipped_is_stopped_at_its_next_command() -> None:
    pair = LinkPair(lambda seq_id, cmd, slots: pair.stepping.check_collective(), collective={FORWARD})
    model = Declared(pair.head)
    model.ep_link.send_command(0, OPEN)  # not declared: nothing is owed
    model.ep_link.send_command(0, FORWARD)  # the very first forward of FORWARD, skipped
    with pytest.raises(RunStopped) as info:
        model.ep_link.send_command(0, FORWARD)
    assert str(info.value) == SKIPPED.format(doing="sent the next command", why="ep_collective_commands declares it")


def test_a_forward_entered_or_said_empty_is_what_the_head_owes() -> None:
    pair = LinkPair(collective=frozenset())
    Declared(pair.head)
    pair.head.send_command(0, FORWARD)
    with pair.head.collective():
        pair.head.gather_u32(0)  # a collective of the forward: the workers take no part here, in one thread
    pair.head.send_command(0, FORWARD)
    pair.head.empty_forward()  # empty on every rank: entered, with nothing to run
    pair.head.send_command(0, OPEN)
    pair.head.send_command(0, OPEN)  # OPEN runs no collective: no forward is owed
    pair.head.sync()
    assert pair.head.stopped is None and pair.head.commands == 4


def test_a_word_the_head_has_not_learned_is_not_checked_and_a_model_that_declares_none_is_not_either() -> None:
    pair = LinkPair(collective=frozenset())
    pair.head.send_command(0, FORWARD)  # no model declared it, and no forward of it ran here: nothing is owed
    pair.head.send_command(0, FORWARD)
    recorder: RecordingEp[SequenceState] = RecordingEp(num_slots=2)  # a scheduler's double: it declares nothing
    recorder.ep_link.send_command(0, FORWARD)
    with recorder.ep_link.collective():
        recorder.ep_link.check_collective()
    recorder.ep_link.send_command(0, FORWARD)
    recorder.ep_link.send_command(0, FORWARD)
    assert pair.head.stopped is None and recorder.ep_link.stopped is None


def test_one_rank_owes_no_forward() -> None:
    model = Declared(EpLink(SoloTransport(), num_slots=2))
    model.ep_link.send_command(0, FORWARD)
    model.ep_link.send_command(0, FORWARD)
    model.ep_link.shutdown_workers()
    assert model.ep_link.stopped is None
