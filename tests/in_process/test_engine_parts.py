"""The link's parts, each alone: the command stream, the run's state, the settings, the head's reports, the ends.

``EpLink`` is built from these by composition; here each is driven without a link,
so that a change to one shows in its own test first.
"""

import zlib

import pytest

from metrale_model_engine import EpLinkError, ProtocolVersion, RunStopped, WorkerFailure
from metrale_model_engine._core.transport import EpTransport, HeadEnd, SoloTransport, TransportClosed, WorkerEnd
from metrale_model_engine._engine.forward import CollectiveBlock
from metrale_model_engine._engine.roles import HeadRole, WorkerRole, role_for
from metrale_model_engine._engine.run_state import CommandStream, ForwardScope, LinkParts, LinkState, Phase
from metrale_model_engine._engine.settings import LinkSettings
from metrale_model_engine._engine.way_back.reports import WorkerReports
from metrale_model_engine.testing import RecordingTransport, ReplayTransport


def test_the_stream_counts_commands_and_folds_every_part_into_one_crc() -> None:
    stream = CommandStream()
    stream.begin(2, 7)
    stream.add([b"ab", memoryview(b"cd")])
    stream.begin(0, 9)
    stream.add([b"e"])
    assert (stream.commands, stream.command) == (2, (0, 9))
    assert stream.crc == zlib.crc32(b"abcde")


def test_the_state_keeps_the_first_reason_and_a_shut_down_link_stays_shut_down() -> None:
    closes: list[str] = []
    state = LinkState("head", lambda: closes.append("closed"))
    state.raise_if_stopped()  # nothing yet
    assert (state.phase, state.stopped, state.closed, closes) == (Phase.OPEN, None, False, [])
    first = RunStopped("worker rank 1 refused")
    assert state.stop(first) is first
    state.stop(RunStopped("a later reason"))
    assert str(state.stopped) == "worker rank 1 refused" and state.stopped is not first
    assert state.phase is Phase.STOPPED and closes == ["closed"]  # the stop closes the link, once
    with pytest.raises(RunStopped, match=r"^head: the run stopped earlier \(worker rank 1 refused\); this link runs"):
        state.raise_if_stopped()
    shut = LinkState("head")
    shut.phase = Phase.SHUT_DOWN
    shut.stop(RunStopped("a sync point before the shutdown failed"))
    assert shut.phase is Phase.SHUT_DOWN and shut.stopped is not None


def parts_of(transport: EpTransport) -> LinkParts:
    """The parts of a link of ``transport``'s rank (four slots, v2, a command timeout of 1 s), built by hand."""
    settings = LinkSettings.checked(
        transport.rank, transport.world_size, num_slots=4, protocol=ProtocolVersion.V2, seq_id_on_wire=True,
        command_timeout=1.0,
    )  # fmt: skip
    return LinkParts(transport, settings, CommandStream(), LinkState(settings.who), ForwardScope(True))


class Failing(HeadRole):
    """A head's role whose every failure inside a block is ``stopped``: what a block makes of an error, alone."""

    __slots__ = ("_stopped",)

    def __init__(self, parts: LinkParts, stopped: RunStopped) -> None:
        super().__init__(parts, {})
        self._stopped = stopped

    def failed_inside(self, error: BaseException) -> RunStopped:
        return self._stopped


def test_an_error_in_a_collective_block_stops_the_run_with_what_the_rank_makes_of_it() -> None:
    parts = parts_of(RecordingTransport(2))
    stopped = RunStopped("what the head's reports say")
    with pytest.raises(RunStopped) as info, CollectiveBlock(parts, Failing(parts, stopped)):
        raise KeyError("slot 3")
    assert info.value is stopped and isinstance(info.value.__cause__, KeyError) and parts.scope.blocks == 0
    with pytest.raises(RunStopped) as passed, CollectiveBlock(parts, Failing(parts, stopped)):
        raise RunStopped("the model's own")  # a stop raised inside passes as it is
    assert str(passed.value) == "the model's own" and parts.state.stopped is None


def test_the_heads_collective_block_ends_its_forward_which_must_have_run_a_collective() -> None:
    parts = parts_of(RecordingTransport(2))
    block = CollectiveBlock(parts, HeadRole(parts, {}))
    stream, scope, run = parts.stream, parts.scope, parts.state
    stream.begin(3, 0xE0)
    scope.begin(False, True)
    with block:
        assert not scope.due  # entered: the forward owed runs
        scope.ran += 1  # what check_collective counts
    assert not scope.open and run.stopped is None
    scope.begin(False, False)
    with pytest.raises(RunStopped) as info, block:
        pass  # a forward that skipped its all-reduce, or called torch.distributed directly
    assert str(info.value).startswith("head: the run stopped in command 1 (seq_id=3, cmd=224): it ran no collective")
    assert "link.empty_forward()" in str(info.value) and run.stopped is not None


def test_a_forward_declared_empty_runs_no_collective_and_a_workers_block_leaves_the_count_to_its_step() -> None:
    parts = parts_of(RecordingTransport(2))
    scope = parts.scope
    scope.begin(False, False)
    scope.empty = True  # what empty_forward() says
    with CollectiveBlock(parts, HeadRole(parts, {})):
        pass
    worker = parts_of(ReplayTransport([]))
    worker.scope.begin(False, False)
    with CollectiveBlock(worker, WorkerRole(worker)):
        assert worker.scope.allows()  # inside a block, a collective of a command not declared is allowed
    assert worker.scope.open and not worker.scope.allows()
    assert worker.state.stopped is None and parts.state.stopped is None


def test_one_rank_keeps_no_scope() -> None:
    scope = ForwardScope(False)
    scope.begin(False, True)
    assert not scope.open and scope.allows() and not scope.due  # nothing was sent: nothing is owed


def test_an_interrupt_in_a_collective_block_passes_and_ends_the_run() -> None:
    parts = parts_of(RecordingTransport(2))
    with pytest.raises(KeyboardInterrupt), CollectiveBlock(parts, Failing(parts, RunStopped("never"))):
        raise KeyboardInterrupt
    stopped = str(parts.state.stopped)
    assert stopped == "head: the run stopped in command 0 (seq_id=0, cmd=0): KeyboardInterrupt"


def test_the_role_is_chosen_once_by_rank_and_holds_its_sides_parts() -> None:
    head, worker = role_for(parts_of(RecordingTransport(2)), {}), role_for(parts_of(ReplayTransport([])), {})
    assert type(head) is HeadRole and type(worker) is WorkerRole
    assert type(head.sender).__name__ == "HeadSender" and type(head.reader).__name__ == "WorkerOnly"
    assert type(worker.reader).__name__ == "CommandReader" and type(worker.sync_points).__name__ == "HeadOnly"


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"num_slots": 0}, ValueError, "num_slots"),
        ({"num_slots": 2**32}, ValueError, "num_slots"),
        ({"protocol": "v2"}, TypeError, "protocol must be a ProtocolVersion"),
        ({"seq_id_on_wire": 1}, TypeError, "seq_id_on_wire"),
        ({"seq_id_on_wire": False}, ValueError, "seq_id_on_wire=False needs protocol v1"),
        ({"command_timeout": -1.0}, ValueError, "command_timeout"),
    ],
)
def test_settings_name_the_argument_they_refuse(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = {
        "num_slots": 4,
        "protocol": ProtocolVersion.V2,
        "seq_id_on_wire": True,
        "command_timeout": 5.0,
    }
    with pytest.raises(error, match=message):
        LinkSettings.checked(0, 2, **{**arguments, **changes})


def test_settings_default_to_the_environments_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_EP_PROTOCOL", "v2")
    settings = LinkSettings.checked(2, 3, num_slots=8, protocol=None, seq_id_on_wire=True, command_timeout=None)
    assert (settings.protocol, settings.command_timeout, settings.who) == (ProtocolVersion.V2, None, "worker rank 2")


def _reports(world_size: int, transport: RecordingTransport | None = None) -> WorkerReports:
    settings = LinkSettings.checked(
        0, world_size, num_slots=4, protocol=ProtocolVersion.V2, seq_id_on_wire=True, command_timeout=1.0
    )
    stream = CommandStream()
    stream.begin(0, 5)
    head = RecordingTransport(world_size) if transport is None else transport
    return WorkerReports(LinkParts(head, settings, stream, LinkState("head"), ForwardScope(True)), {})


def test_the_head_puts_first_hand_reports_before_witnesses() -> None:
    reports = _reports(3)
    first = WorkerFailure(2, 1, 0, 5, "ValueError: bad", stopped=True)
    witness = WorkerFailure(1, 1, 0, 5, "RuntimeError: Connection closed by peer", stopped=True, witness=True)
    why = reports.why([witness, first], [])
    assert why.index("ValueError") < why.index("Connection closed")
    assert "said nothing" not in why


def test_the_heads_failed_forward_names_its_own_error_when_no_worker_stopped() -> None:
    stopped = _reports(2).forward_failed(ValueError("a bug of the head"))
    assert str(stopped) == (
        "head: the run stopped: its own forward of command 1 (seq_id=0, cmd=5) failed: ValueError: a bug of the head"
    )


def test_the_head_names_the_silent_ranks_when_only_witnesses_spoke() -> None:
    witness = WorkerFailure(1, 1, 0, 5, "RuntimeError: timed out", stopped=True, witness=True)
    assert "rank(s) [2] said nothing" in _reports(3).why([witness], [])
    assert "worker rank(s) [2] exited (died or left the run) after command 1" in _reports(3).why([], [2])
    # a witness leaves after it reports: its leaving says nothing of the others, who are named all the same
    why = _reports(3).why([witness], [1])
    assert "worker rank(s) [1] exited" in why and why.endswith("rank(s) [2] said nothing (they stall, skipped their "
                                                               "forward, or left)")  # fmt: skip
    assert "said nothing" not in _reports(3).why([witness], [2])  # rank 2 left without a report: it is the cause


def test_the_head_counts_each_report_it_reads() -> None:
    reports = _reports(3)
    reports.seen([WorkerFailure(2, 1, 0, 5, "x"), WorkerFailure(2, 2, 0, 5, "y")])
    assert (reports.seen_count(1), reports.seen_count(2)) == (0, 2)
    assert reports.stopped_workers(0.0) == ([], [])
    reports.close()
    reports.close()  # idempotent


class _Head(HeadEnd):
    world_size = 2

    def send(self, parts: object, timeout: float | None) -> None:
        pass


def test_each_end_refuses_the_other_ends_calls_by_name() -> None:
    head = _Head()
    with pytest.raises(TransportClosed, match="_Head is a head: it receives no commands"):
        head.receive(None)
    with pytest.raises(TransportClosed, match="it answers no one"):
        head.answer(b"", None)
    assert (head.answers_ready(), head.poll_answers()) == (False, [])
    worker = ReplayTransport([])
    assert isinstance(worker, WorkerEnd)
    with pytest.raises(TransportClosed, match="ReplayTransport is a worker: it sends no commands"):
        worker.send([b""], None)
    with pytest.raises(TransportClosed, match="it reads no answers"):
        worker.poll_answers()
    with pytest.raises(TransportClosed, match="it reads no answers"):
        worker.receive_answers(1, None)
    assert worker.answers_ready() is False


def test_the_solo_transport_has_no_workers() -> None:
    solo = SoloTransport()
    solo.send([b"anything"], None)  # nobody to send to: a no-op
    assert solo.gather([1, 2]) == [[1, 2]]
    with pytest.raises(TransportClosed, match="the one-rank group has no worker rank 1"):
        solo.receive_answers(1, None)


def test_a_corrupt_answer_is_a_link_error() -> None:
    class Garbled(RecordingTransport):
        def poll_answers(self) -> list[tuple[int, bytes]]:
            return [(1, b"\x01\x02")]

    settings = LinkSettings.checked(
        0, 2, num_slots=4, protocol=ProtocolVersion.V2, seq_id_on_wire=True, command_timeout=1.0
    )
    parts = LinkParts(Garbled(2), settings, CommandStream(), LinkState("head"), ForwardScope(True))
    reports = WorkerReports(parts, {})
    with pytest.raises(EpLinkError, match="head: a corrupt answer"):
        reports.poll()
