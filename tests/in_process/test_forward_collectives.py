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
from metrale_model_engine.wire import Report, decode_answer

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
