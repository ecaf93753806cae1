"""EpLink over in-process fake transports: setup, argument checks, roles, sends, error mapping, close."""

import gc
import os
import re
import subprocess
import sys
import time
import weakref
from array import array
from collections.abc import Callable, MutableSequence

import pytest

from metrale_model_engine import (
    CMD_SHUTDOWN,
    EpCommandFailed,
    EpLink,
    EpLinkError,
    EpReceiveError,
    EpRoleError,
    EpSendError,
    EpSetupError,
    LinkedEp,
    ProtocolVersion,
    RunStopped,
    SequenceState,
    WorkerFailure,
)
from metrale_model_engine._engine.roles import WORKER_ONLY, HeadOnly
from metrale_model_engine._host.liveness import host_fingerprint
from metrale_model_engine.transport import PeerLost
from metrale_model_engine.wire import (
    WIRE_VERSION,
    ItemKind,
    Report,
    encode_close,
    encode_report,
)

from helpers.fakes import FakeTransport, ignore, link, no_slots
from helpers.messages import header, sync, tokens, whole, word, words
from helpers.pair import LinkPair


def test_world_size_and_protocol_come_through() -> None:
    assert EpLink(FakeTransport(0, 1), num_slots=2).world_size == 1
    assert EpLink(FakeTransport(0, 3), num_slots=2).world_size == 3


def test_protocol_from_constructor_else_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_EP_PROTOCOL", "v2")
    assert EpLink(FakeTransport(0, 2), num_slots=2).protocol is ProtocolVersion.V2
    assert EpLink(FakeTransport(0, 2), num_slots=2, protocol=ProtocolVersion.V1).protocol is ProtocolVersion.V1


def test_a_setup_of_another_length_is_refused() -> None:
    with pytest.raises(EpSetupError, match=r"rank 0: rank 1 sent a setup of 4 words, not 8: every rank must run"):
        EpLink(FakeTransport(0, 2, peers=[[3, 1, 1, 4]]), num_slots=4, protocol=ProtocolVersion.V1)


@pytest.mark.parametrize(
    ("peer", "fragment"),
    [
        ([WIRE_VERSION, 2, 1, 4], r"the ranks disagree on the protocol \(rank 0: v1, rank 1: v2\)"),
        ([WIRE_VERSION, 1, 0, 4], r"the ranks disagree on the seq_id_on_wire option \(rank 0: True, rank 1: False\)"),
        ([WIRE_VERSION, 1, 1, 8], r"the ranks disagree on the slot count \(rank 0: 4, rank 1: 8\)"),
        ([WIRE_VERSION + 1, 1, 1, 4], r"the ranks disagree on the wire version"),
    ],
)
def test_setup_mismatch_is_refused(peer: list[int], fragment: str) -> None:
    with pytest.raises(EpSetupError, match=fragment):
        EpLink(FakeTransport(0, 2, peers=[[*peer, 0, 0, 0, 0]]), num_slots=4, protocol=ProtocolVersion.V1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_setup_exchange_is_a_link_error_never_a_receive_or_send(rank: int) -> None:
    transport = FakeTransport(rank, 2)
    transport.fail_with = PeerLost("process(es) [42] of the ring died before every rank could answer the gather")
    with pytest.raises(EpLinkError, match=f"rank {rank}: the setup exchange failed: process") as info:
        EpLink(transport, num_slots=1)
    assert type(info.value) is EpLinkError  # not EpReceiveError, not EpSendError
    assert type(info.value.__cause__) is PeerLost and info.value.__cause__.__cause__ is None  # mapped once
    assert not transport.closed  # the caller's to close


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"num_slots": 0}, ValueError, r"num_slots must be an int in 1 \.\.= 4294967295, got int 0"),
        ({"num_slots": 2**32}, ValueError, r"num_slots must be an int in 1"),
        ({"num_slots": "8"}, TypeError, r"num_slots must be an int .* got str '8'"),
        ({"num_slots": True}, TypeError, r"num_slots must be an int .* got bool True"),
        ({"num_slots": 2, "protocol": "v2"}, TypeError, r"protocol must be a ProtocolVersion .* got str 'v2'"),
        ({"num_slots": 2, "protocol": 3}, TypeError, r"protocol must be a ProtocolVersion .* got int 3"),
        ({"num_slots": 2.0}, TypeError, r"num_slots must be an int .* got float 2\.0"),
        ({"num_slots": 2, "seq_id_on_wire": 1}, TypeError, r"seq_id_on_wire must be a bool, got int 1"),
        (
            {"num_slots": 2, "protocol": ProtocolVersion.V2, "seq_id_on_wire": False},
            ValueError,
            r"seq_id_on_wire=False needs protocol v1",
        ),
        ({"num_slots": 2, "command_timeout": 0}, ValueError, r"command_timeout must be a finite number of seconds > 0"),
        ({"num_slots": 2, "command_timeout": -1.5}, ValueError, r"command_timeout must be a finite number"),
        ({"num_slots": 2, "command_timeout": True}, TypeError, r"command_timeout must be a finite number"),
        ({"num_slots": 2, "command_timeout": float("inf")}, ValueError, r"command_timeout must be a finite number"),
        ({"num_slots": 2, "command_timeout": "5"}, TypeError, r"command_timeout must be a finite number"),
    ],
)
def test_constructor_arguments_are_checked(kwargs: dict[str, object], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        EpLink(FakeTransport(0, 2), **kwargs)  # type: ignore[arg-type]


def test_head_sends_headers_words_and_tokens_item_by_item() -> None:
    transport = FakeTransport(0, 2)
    head = link(transport)
    head.send_header(3, 10)
    head.send_word(2)
    assert memoryview(head.send_tokens((7, 8))).tolist() == [7, 8]
    head.shutdown_workers()
    head.shutdown_workers()
    assert transport.sent == [header(10, 3), word(2), tokens([7, 8]), sync(1), header(CMD_SHUTDOWN)]
    assert transport.timeouts == [60.0] * 5  # the command timeout bounds every send
    with pytest.raises(EpSendError, match="shut down"):
        head.send_word(1)


def test_a_command_is_one_message_whatever_it_carries() -> None:
    transport = FakeTransport(0, 2)
    head = link(transport)
    head.send_command(1, 0xFFFFFFE0, 2, array("I", [1, 3]), [50, 60])
    head.send_command(2, 7)
    head.send_command(0, 9, [], 5)
    assert transport.sent == [
        whole(0xFFFFFFE0, 1) + word(2) + tokens([1, 3]) + tokens([50, 60]),
        whole(7, 2),
        whole(9, 0) + tokens([]) + word(5),
    ]


def test_a_command_is_checked_whole_before_anything_is_sent() -> None:
    transport = FakeTransport(0, 2)
    head = link(transport)
    with pytest.raises(ValueError, match=r"follow_ups\[1\]\[0\]=-1 is outside"):
        head.send_command(0, 1, 5, [-1])
    with pytest.raises(TypeError, match=r"follow_ups\[0\] must be an int .* got bool True"):
        head.send_command(0, 1, True)
    with pytest.raises(TypeError, match=r"follow_ups\[1\]\[1\] must be an int .* got bool"):
        head.send_command(0, 1, 5, [1, False])
    with pytest.raises(ValueError, match=r"seq_id=4 is out of range for 4 slots"):
        head.send_command(4, 1)
    assert transport.sent == []


def test_send_tokens_returns_what_it_sent() -> None:
    head = link(FakeTransport(0, 2))
    tokens_ = array("I", [1, 2])
    assert head.send_tokens(tokens_) is tokens_  # a u32 array travels without a copy


def test_head_refuses_bad_input_before_sending() -> None:
    transport = FakeTransport(0, 2)
    head = link(transport)
    with pytest.raises(ValueError, match=r"seq_id=4 is out of range for 4 slots \(0 \.\.= 3\)"):
        head.send_header(4, 1)
    with pytest.raises(TypeError, match=r"cmd must be an int"):
        head.send_header(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tokens\[1\]=4294967296 is outside"):
        head.send_tokens([1, 2**32])
    with pytest.raises(TypeError, match=r"word must be an int"):
        head.send_word("1")  # type: ignore[arg-type]
    assert transport.sent == []


@pytest.mark.parametrize(("follow_up", "shown"), [(1.5, "float 1.5"), (None, "NoneType None"), (object, "type")])
def test_a_follow_up_that_is_neither_a_word_nor_a_token_array_is_named(follow_up: object, shown: str) -> None:
    transport = FakeTransport(0, 2)
    expected = r"follow_ups\[1\] must be a u32 word \(an int in 0 \.\.= 4294967295\) or a token array, got "
    with pytest.raises(TypeError, match=expected + shown):
        link(transport).send_command(0, 2, 7, follow_up)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"follow_ups\[0\]\[1\] must be an int in 0 \.\.= 4294967295 \(0xFFFFFFFF\), got str 'x'"
    ):
        link(transport).send_command(0, 2, [1, "x"])  # type: ignore[list-item]
    assert transport.sent == []


def test_the_shutdown_word_is_reserved_for_shutdown_workers() -> None:
    transport = FakeTransport(0, 2)
    with pytest.raises(
        ValueError, match=r"cmd=0xffffffff is the reserved shutdown word; call ep_link.shutdown_workers\(\) to stop"
    ):
        link(transport).send_command(0, CMD_SHUTDOWN)
    assert transport.sent == []


def test_one_rank_group_goes_through_its_transport_which_sends_nowhere() -> None:
    from metrale_model_engine.transport import SoloTransport

    solo = EpLink(SoloTransport(), num_slots=2)
    solo.send_header(1, 5)
    solo.send_command(1, 5, 3, [1])
    assert solo.world_size == 1 and solo.rank == 0


@pytest.mark.parametrize("cause", [RuntimeError("Connection reset by peer"), PeerLost("worker rank 1 died")])
def test_failed_head_send_is_a_send_error_mapped_once(cause: Exception) -> None:
    transport = FakeTransport(0, 2)
    head = link(transport)
    transport.fail_with = cause
    with pytest.raises(EpSendError, match=re.escape(f"broadcast to the workers failed: {cause}")) as info:
        head.send_word(1)
    assert info.value.__cause__ is cause and cause.__cause__ is None


def test_roles_are_enforced() -> None:
    pair = LinkPair()
    head, worker = pair.head, pair.worker
    for call in (
        lambda: worker.send_word(1),
        lambda: worker.send_header(0, 1),
        lambda: worker.send_tokens([1]),
        lambda: worker.send_command(0, 1),
        lambda: worker.send_command(99, 1),  # the role first: no argument is checked on the wrong rank
        lambda: worker.send_word(-1),
    ):
        with pytest.raises(EpRoleError, match=r"only the head \(rank 0\) sends; this is worker rank 1"):
            call()
    with pytest.raises(EpRoleError, match=r"ep_worker_step\) runs on worker ranks; this is the head"):
        head.step(ignore, no_slots())
    for receive in (head.recv_word, head.recv_tokens, lambda: head.recv_tokens_into(array("I", [0]))):
        with pytest.raises(EpRoleError, match=r"follow-ups are received on worker ranks; this is the head"):
            receive()


class FailingModel(LinkedEp[SequenceState]):
    __slots__ = ("_error", "ep_link")

    def __init__(self, link: EpLink, error: Exception) -> None:
        self.ep_link = link
        self._error = error

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        raise self._error


def test_worker_classifies_errors_after_the_header() -> None:
    pair = LinkPair()
    for _ in range(3):
        pair.head.send_header(0, 1)
    cause = KeyError("boom")
    with pytest.raises(EpCommandFailed) as info:
        FailingModel(pair.worker, cause).ep_worker_step([None, None])
    assert info.value.cause is cause
    lost = EpReceiveError("payload lost")
    with pytest.raises(EpReceiveError) as untagged:
        FailingModel(pair.worker, lost).ep_worker_step([None, None])
    assert untagged.value is lost
    tagged = EpCommandFailed(ValueError("model tagged it"))
    with pytest.raises(EpCommandFailed) as kept:
        FailingModel(pair.worker, tagged).ep_worker_step([None, None])
    assert kept.value is tagged


@pytest.mark.parametrize("cause", [RuntimeError("Connection closed by peer"), PeerLost("the head (pid 7) died")])
def test_failed_receive_is_a_receive_error_mapped_once(cause: Exception) -> None:
    transport = FakeTransport(1, 2)
    worker = link(transport)
    transport.fail_with = cause
    with pytest.raises(
        EpReceiveError, match=re.escape(f"worker rank 1: receive from the head failed: {cause}")
    ) as info:
        worker.step(ignore, no_slots())
    assert info.value.__cause__ is cause and type(info.value) is EpReceiveError


def test_tokens_into_buffers_check_their_buffer_before_receiving() -> None:
    worker = LinkPair().worker
    with pytest.raises(TypeError, match=r"buffer must hold u32 items, got a buffer of format 'q'"):
        worker.recv_tokens_into(array("q", [0]))
    with pytest.raises(ValueError, match=r"buffer must be a writable, 1-D, C-contiguous buffer"):
        worker.recv_tokens_into(memoryview(bytes(8)).cast("I"))
    with pytest.raises(TypeError, match=r"buffer must be a writable u32 buffer .* got list"):
        worker.recv_tokens_into([0, 0])  # type: ignore[arg-type]


def test_a_head_that_closes_before_shutdown_tells_its_workers_then_closes_its_transport() -> None:
    transport = FakeTransport(0, 2)
    with link(transport) as head:
        head.send_header(0, 1)
    assert head.closed and transport.closed
    assert transport.sent == [header(1), words(encode_close())]
    assert transport.timeouts[-1] == 1.0  # best effort, bounded
    head.close()  # idempotent
    assert len(transport.sent) == 2
    with pytest.raises(EpSendError, match="this link was closed"):
        head.send_word(1)


def test_a_head_that_shut_down_closes_quietly_and_a_failed_close_still_closes() -> None:
    quiet = FakeTransport(0, 2)
    head = link(quiet)
    head.shutdown_workers()
    head.close()
    assert quiet.sent == [sync(1), header(CMD_SHUTDOWN)] and quiet.closed
    broken = FakeTransport(0, 2)
    head = link(broken)
    broken.fail_with = PeerLost("worker rank 1 died")
    head.close()  # telling the workers failed: the transport is closed all the same
    assert broken.closed


def test_a_worker_meets_the_heads_close_as_a_receive_error() -> None:
    idle = LinkPair()
    idle.head.close()
    with pytest.raises(EpReceiveError, match="the head closed its link before shutting the workers down"):
        idle.step()

    def run(seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        reading.stepping.recv_word()

    reading = LinkPair(run)
    reading.head.send_header(0, 1)
    reading.head.close()  # before the follow-up the worker reads
    with pytest.raises(EpReceiveError, match="the head closed its link"):
        reading.step()


def test_the_links_repr_says_where_it_stands() -> None:
    head = link(FakeTransport(0, 3))
    assert repr(head) == "<EpLink rank 0 of 3, protocol v2, 4 slots, FakeTransport, open>"
    head.shutdown_workers()
    assert repr(head).endswith(", shut down>")
    head.close()
    assert repr(head).endswith(", closed>") and head.workers_shut_down  # closing keeps how the run ended
    assert ItemKind.CLOSE in set(ItemKind)


def test_a_worker_has_no_head_parts_and_the_head_no_worker_parts() -> None:
    pair = LinkPair()
    worker = pair.worker
    digests: list[object] = []

    def digest(slots: object) -> int:
        digests.append(slots)
        return 0

    worker.state_digest = digest
    calls: list[Callable[[], None]] = [
        lambda: worker.sync([None]),
        worker.check_workers,
        lambda: worker.shutdown_workers([None]),
    ]
    for call in calls:
        with pytest.raises(EpRoleError, match=r"^only the head \(rank 0\) runs sync points .*; this is worker rank 1$"):
            call()
    assert digests == [] and not worker.closed  # refused before the digest ran; the link is untouched
    assert not hasattr(HeadOnly(1), "__deepcopy__") and not hasattr(WORKER_ONLY, "__len__")  # Python's probes
    head = pair.head
    with pytest.raises(EpRoleError, match="follow-ups are received on worker ranks"):
        head.recv_tokens(3)
    assert head.stopped is None and not head.closed


def test_a_stopped_run_closes_the_link_once_when_the_call_that_stopped_it_returns() -> None:
    closes: list[str] = []

    class Counting(FakeTransport):
        def close(self) -> None:
            closes.append("closed")
            super().close()

    head = link(Counting(0, 2))
    head.send_command(0, 7)
    with pytest.raises(RunStopped, match=r"outside `with link.collective\(\):`"):
        head.check_collective()
    assert head.closed and head.stopped is not None and closes == ["closed"]
    with pytest.raises(RunStopped, match="the run stopped earlier"):
        head.send_command(0, 7)
    head.close()
    assert closes == ["closed"] and repr(head).endswith(", closed>")


# -- check_workers: why a model's own collective failed --------------------------


def a_dead_pid() -> int:
    """The pid of a process of this host that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def setup_words(pid: int, host: tuple[int, int]) -> list[int]:
    return [WIRE_VERSION, 1, 1, 4, 0, pid, *host]


def test_check_workers_names_the_workers_of_this_host_that_exited() -> None:
    here = host_fingerprint()
    peers = [setup_words(a_dead_pid(), here), setup_words(os.getppid(), here)]
    head = EpLink(FakeTransport(0, 3, peers=peers), num_slots=4, protocol=ProtocolVersion.V1)
    with pytest.raises(
        RunStopped, match=r"head: the run stopped: worker rank\(s\) \[1\] exited \(died or left the run\)"
    ):
        head.check_workers()
    assert head.closed and isinstance(head.stopped, RunStopped) and head.stopped.ranks == (1,)
    with pytest.raises(RunStopped, match="the run stopped earlier"):
        head.send_command(0, 1)


def test_check_workers_cannot_see_a_worker_of_another_host_and_waits_its_timeout() -> None:
    elsewhere = setup_words(a_dead_pid(), (1, 2))  # its pid means nothing here
    head = EpLink(FakeTransport(0, 2, peers=[elsewhere]), num_slots=4, protocol=ProtocolVersion.V1)
    started = time.monotonic()
    head.check_workers(0.05)
    assert time.monotonic() - started >= 0.05


def test_check_workers_raises_what_workers_reported_first() -> None:
    transport = FakeTransport(0, 2, peers=[setup_words(a_dead_pid(), host_fingerprint())])
    head = EpLink(transport, num_slots=4, protocol=ProtocolVersion.V1)
    transport.waiting = [(1, encode_report(Report(3, 0, 7, "KeyError: 'slot 0 is free'")))]
    with pytest.raises(RunStopped, match=r"KeyError: 'slot 0 is free'; worker rank\(s\) \[1\] exited") as info:
        head.check_workers()
    assert info.value.failures == (WorkerFailure(1, 3, 0, 7, "KeyError: 'slot 0 is free'"),)


def test_check_workers_is_for_the_head_and_takes_seconds() -> None:
    with pytest.raises(EpRoleError):
        EpLink(FakeTransport(1, 2), num_slots=4).check_workers()
    head = EpLink(FakeTransport(0, 2), num_slots=4)
    with pytest.raises(ValueError, match="timeout"):
        head.check_workers(-1.0)
    head.check_workers()  # every worker is this process: nothing exited, nothing reported
    EpLink(FakeTransport(0, 1), num_slots=4).check_workers(10.0)  # one rank: at once


@pytest.mark.parametrize("rank", [0, 1])
def test_a_link_dropped_without_close_lets_go_of_its_transport_at_once(rank: int) -> None:
    transport = FakeTransport(rank, 2)
    held = weakref.ref(transport)
    gc.disable()  # nothing but reference counts: no part of the link may refer back to it (its stop closes it)
    try:
        dropped = link(transport)
        del transport
        assert held() is not None
        del dropped
        assert held() is None
    finally:
        gc.enable()
