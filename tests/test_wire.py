"""WireEp over in-process fake transports: setup, argument checks, roles, classification."""

from array import array
from collections.abc import MutableSequence, Sequence

import pytest
from typing_extensions import Buffer

from metrale_model_engine import (
    INLINE_TOKENS,
    WIRE_VERSION,
    Broadcast,
    EpCommandFailed,
    EpProtocol,
    EpReceiveError,
    EpRoleError,
    EpSendError,
    EpSetupError,
    SequenceState,
    WireEp,
)

from frames import header, tokens, word


class FakeTransport:
    """One rank of a pretend group; ``peers`` are the other ranks' setup words."""

    def __init__(self, rank: int, world_size: int, peers: Sequence[list[int]] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._peers = peers
        self.fail_with: Exception | None = None
        self.sent: list[tuple[int, ...]] = []
        self.incoming: list[tuple[int, ...]] = []
        """What a worker rank receives, one broadcast each, in order."""

    def bind(self, words: Buffer) -> Broadcast:
        view = memoryview(words)

        def broadcast(timeout: float | None) -> None:
            if self.fail_with is not None:
                raise self.fail_with
            if self.rank != 0:
                view[:] = memoryview(array("I", self.incoming.pop(0)))
            self.sent.append(tuple(view.tolist()))

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        if self._peers is None:
            return [list(words)] * self.world_size
        return [list(words), *self._peers] if self.rank == 0 else [*self._peers, list(words)]


def test_is_ep_follows_world_size() -> None:
    assert WireEp(FakeTransport(0, 1), num_slots=2).is_ep() is False
    assert WireEp(FakeTransport(0, 3), num_slots=2).is_ep() is True


def test_protocol_from_constructor_else_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_EP_PROTOCOL", "v2")
    assert WireEp(FakeTransport(0, 2), num_slots=2).ep_protocol_v2() is True
    assert WireEp(FakeTransport(0, 2), num_slots=2, protocol=EpProtocol.V1).ep_protocol_v2() is False


@pytest.mark.parametrize(
    ("peer", "fragment"),
    [
        ([WIRE_VERSION, 2, 1, 4], r"the ranks disagree on the protocol \(rank 0: v1, rank 1: v2\)"),
        ([WIRE_VERSION, 1, 0, 4], r"the ranks disagree on the v1_slot option \(rank 0: True, rank 1: False\)"),
        ([WIRE_VERSION, 1, 1, 8], r"the ranks disagree on the slot count \(rank 0: 4, rank 1: 8\)"),
        ([WIRE_VERSION + 1, 1, 1, 4], r"the ranks disagree on the wire version"),
    ],
)
def test_setup_mismatch_is_refused(peer: list[int], fragment: str) -> None:
    with pytest.raises(EpSetupError, match=fragment):
        WireEp(FakeTransport(0, 2, peers=[peer]), num_slots=4, protocol=EpProtocol.V1)


def test_setup_exchange_failure_is_a_receive_error() -> None:
    class Broken(FakeTransport):
        def gather(self, words: Sequence[int]) -> list[list[int]]:
            raise RuntimeError("connection refused")

    with pytest.raises(EpReceiveError, match="setup exchange failed: connection refused"):
        WireEp(Broken(1, 2), num_slots=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"num_slots": 0}, ValueError, r"num_slots must be an int in 1 \.\.= 4294967295, got int 0"),
        ({"num_slots": 2**32}, ValueError, r"num_slots must be an int in 1"),
        ({"num_slots": "8"}, TypeError, r"num_slots must be an int .* got str '8'"),
        ({"num_slots": True}, TypeError, r"num_slots must be an int .* got bool True"),
        ({"num_slots": 2, "protocol": "v2"}, TypeError, r"protocol must be an EpProtocol .* got str 'v2'"),
        ({"num_slots": 2, "protocol": 3}, TypeError, r"protocol must be an EpProtocol .* got int 3"),
        ({"num_slots": 2.0}, TypeError, r"num_slots must be an int .* got float 2\.0"),
        ({"num_slots": 2, "v1_slot": 1}, TypeError, r"v1_slot must be a bool, got int 1"),
        ({"num_slots": 2, "command_timeout": 0}, ValueError, r"command_timeout must be a positive, finite number"),
        ({"num_slots": 2, "command_timeout": -1.5}, ValueError, r"command_timeout must be a positive"),
        ({"num_slots": 2, "command_timeout": True}, TypeError, r"command_timeout must be a positive"),
        ({"num_slots": 2, "command_timeout": float("inf")}, ValueError, r"command_timeout must be a positive"),
        ({"num_slots": 2, "command_timeout": "5"}, TypeError, r"command_timeout must be a positive"),
    ],
)
def test_constructor_arguments_are_checked(kwargs: dict[str, object], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        WireEp(FakeTransport(0, 2), **kwargs)  # type: ignore[arg-type]


def test_head_sends_headers_words_and_tokens() -> None:
    transport = FakeTransport(0, 2)
    head: WireEp[SequenceState] = WireEp(transport, num_slots=4, protocol=EpProtocol.V2)
    head.ep_broadcast_cmd_for_seq(3, 10)
    head.ep_broadcast_cmd(2)
    assert head.ep_broadcast_tokens((7, 8)) == [7, 8]
    head.ep_shutdown_workers()
    head.ep_shutdown_workers()
    assert transport.sent == [header(10, 3), word(2), *tokens([7, 8]), header(0xFFFFFFFF)]
    with pytest.raises(EpSendError, match="shut down"):
        head.ep_broadcast_cmd(1)


def test_head_returns_its_own_list() -> None:
    head: WireEp[SequenceState] = WireEp(FakeTransport(0, 2), num_slots=1)
    tokens = [1, 2]
    assert head.ep_broadcast_tokens(tokens) is tokens


def test_head_refuses_bad_input_before_sending() -> None:
    transport = FakeTransport(0, 2)
    head: WireEp[SequenceState] = WireEp(transport, num_slots=4, protocol=EpProtocol.V2)
    with pytest.raises(ValueError, match=r"seq_id=4 is out of range for 4 slots \(0 \.\.= 3\)"):
        head.ep_broadcast_cmd_for_seq(4, 1)
    with pytest.raises(TypeError, match=r"cmd must be an int"):
        head.ep_broadcast_cmd_for_seq(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tokens\[1\]=4294967296 is outside"):
        head.ep_broadcast_tokens([1, 2**32])
    assert transport.sent == []


def test_one_rank_group_sends_nothing() -> None:
    transport = FakeTransport(0, 1)
    head: WireEp[SequenceState] = WireEp(transport, num_slots=2)
    head.ep_broadcast_cmd_for_seq(1, 5)
    head.ep_broadcast_cmd(5)
    assert head.ep_broadcast_tokens([3]) == [3]
    assert transport.sent == []


def test_failed_head_broadcast_is_a_send_error() -> None:
    transport = FakeTransport(0, 2)
    head: WireEp[SequenceState] = WireEp(transport, num_slots=2)
    transport.fail_with = RuntimeError("Connection reset by peer")
    with pytest.raises(EpSendError, match="broadcast to the workers failed: Connection reset by peer") as info:
        head.ep_broadcast_cmd(1)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_roles_are_enforced() -> None:
    head: WireEp[SequenceState] = WireEp(FakeTransport(0, 2), num_slots=2)
    worker: WireEp[SequenceState] = WireEp(FakeTransport(1, 2), num_slots=2)
    with pytest.raises(EpRoleError, match=r"ep_broadcast_cmd\(\) sends from the head; this is worker rank 1"):
        worker.ep_broadcast_cmd(1)
    with pytest.raises(EpRoleError, match=r"ep_broadcast_cmd_for_seq\(\) sends from the head"):
        worker.ep_broadcast_cmd_for_seq(0, 1)
    with pytest.raises(EpRoleError, match=r"ep_shutdown_workers\(\) sends from the head"):
        worker.ep_shutdown_workers()
    with pytest.raises(EpRoleError, match=r"ep_worker_step\(\) runs on worker ranks; this is the head"):
        head.ep_worker_step([None, None])
    with pytest.raises(EpRoleError, match=r"ep_recv_word\(\) receives on worker ranks"):
        head.ep_recv_cmd()
    with pytest.raises(EpRoleError, match=r"ep_recv_tokens\(\) receives on worker ranks"):
        head.ep_recv_tokens()
    with pytest.raises(EpRoleError, match=r"ep_recv_tokens_into\(\) receives on worker ranks"):
        head.ep_recv_tokens_into(array("I", [0]))


class FailingModel(WireEp[SequenceState]):
    def __init__(self, transport: FakeTransport, error: Exception) -> None:
        super().__init__(transport, num_slots=2, protocol=EpProtocol.V2)
        self._error = error

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        raise self._error


def test_worker_classifies_errors_after_the_header() -> None:
    transport = FakeTransport(1, 2)
    transport.incoming = [header(1)] * 3
    cause = KeyError("boom")
    worker = FailingModel(transport, cause)
    with pytest.raises(EpCommandFailed) as info:
        worker.ep_worker_step([None, None])
    assert info.value.cause is cause
    link = EpReceiveError("payload lost")
    with pytest.raises(EpReceiveError) as untagged:
        FailingModel(transport, link).ep_worker_step([None, None])
    assert untagged.value is link
    tagged = EpCommandFailed(ValueError("model tagged it"))
    with pytest.raises(EpCommandFailed) as kept:
        FailingModel(transport, tagged).ep_worker_step([None, None])
    assert kept.value is tagged


def test_failed_header_receive_is_untagged() -> None:
    transport = FakeTransport(1, 2)
    worker: WireEp[SequenceState] = WireEp(transport, num_slots=2)
    transport.fail_with = RuntimeError("Connection closed by peer")
    with pytest.raises(EpReceiveError, match="worker rank 1: receive from the head failed: Connection closed"):
        worker.ep_worker_step([None, None])


def test_tokens_into_buffers() -> None:
    from array import array

    head_transport = FakeTransport(0, 2)
    head: WireEp[SequenceState] = WireEp(head_transport, num_slots=1)
    head.ep_broadcast_tokens_into(array("I", [4, 5]))
    head.ep_broadcast_tokens_into([6])  # a sequence is a token array too
    head.ep_broadcast_tokens_into(array("I"))  # empty: the count still travels
    long = list(range(INLINE_TOKENS + 1))
    head.ep_broadcast_tokens_into(long)
    assert head_transport.sent == [*tokens([4, 5]), *tokens([6]), *tokens([]), *tokens(long)]
    with pytest.raises(ValueError, match=r"tokens\[0\]=-1 is outside"):
        head.ep_broadcast_tokens_into(array("q", [-1]))

    worker_transport = FakeTransport(1, 2)
    worker: WireEp[SequenceState] = WireEp(worker_transport, num_slots=1)
    with pytest.raises(TypeError, match=r"tokens must be a writable u32 buffer .* got list"):
        worker.ep_broadcast_tokens_into([0, 0])
    with pytest.raises(TypeError, match=r"buffer must hold u32 items, got a buffer of format 'q'"):
        worker.ep_recv_tokens_into(array("q", [0]))
    with pytest.raises(ValueError, match=r"buffer must be a writable, 1-D, C-contiguous buffer"):
        worker.ep_recv_tokens_into(memoryview(bytes(8)).cast("I"))
    assert worker_transport.sent == []  # nothing was received


def test_recording_records_tokens_into() -> None:
    from array import array

    from metrale_model_engine.testing import EpEvent, RecordingEp

    model: RecordingEp[SequenceState] = RecordingEp()
    model.ep_broadcast_tokens_into(array("I", [7, 8]))
    assert model.events == [EpEvent("tokens", (7, 8))] and model.wire == tokens([7, 8])


def test_the_librarys_models_stay_slotted() -> None:
    from metrale_model_engine.testing import RecordingEp, ReplayTransport
    from metrale_model_engine.toy import ToyModel

    class Slotted(WireEp[SequenceState]):
        __slots__ = ("extra",)

    models: list[object] = [
        WireEp(FakeTransport(0, 2), num_slots=1),
        Slotted(FakeTransport(0, 2), num_slots=1),
        ToyModel(ReplayTransport(()), num_slots=1),
        RecordingEp(),
    ]
    for model in models:
        assert not hasattr(model, "__dict__"), type(model).__name__
