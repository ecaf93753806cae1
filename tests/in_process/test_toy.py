"""The toy model's head and worker sides in one process, over the in-memory transports."""

from collections.abc import Sequence

import pytest

from metrale_model_engine import EpCommandFailed, EpLink, ProtocolVersion, WorkerSummary, run_worker
from metrale_model_engine.testing import RecordingTransport, ReplayTransport
from metrale_model_engine.toy import ToyCommand, ToyModel, ToyState, slots_digest

from helpers.messages import header, tokens, whole, word


def head_on(recording: RecordingTransport, num_slots: int, protocol: ProtocolVersion) -> ToyModel:
    return ToyModel(EpLink(recording, num_slots=num_slots, protocol=protocol))


def worker_on(messages: Sequence[Sequence[int]], num_slots: int, protocol: ProtocolVersion) -> ToyModel:
    return ToyModel(EpLink(ReplayTransport(messages), num_slots=num_slots, protocol=protocol))


def run_session(head: ToyModel, slots: list[ToyState | None]) -> None:
    head.alloc(slots, 0)
    head.alloc(slots, 2)
    head.prefill(slots, 0, [101, 102, 103])
    head.prefill(slots, 2, [7])
    for _ in range(3):
        head.decode(slots, 0)
        head.decode(slots, 2)
    head.free(slots, 0)
    head.ep_link.shutdown_workers()


@pytest.mark.parametrize("protocol", list(ProtocolVersion))
def test_worker_replays_to_the_same_state(protocol: ProtocolVersion) -> None:
    recording = RecordingTransport(world_size=2)
    head = head_on(recording, 4, protocol)
    head_slots: list[ToyState | None] = [None] * 4
    run_session(head, head_slots)
    worker = worker_on(recording.messages, 4, protocol)
    worker_slots: list[ToyState | None] = [None] * 4
    assert run_worker(worker, worker_slots) == WorkerSummary(commands_run=11, commands_failed=0)
    assert worker_slots == head_slots
    assert slots_digest(worker_slots) == slots_digest(head_slots)
    live = head_slots[2]
    assert live is not None and len(live.tokens) == 4 and head_slots[0] is None
    assert recording.messages[:2] == [whole(ToyCommand.ALLOC, 0), whole(ToyCommand.ALLOC, 2)]
    assert recording.messages[2] == whole(ToyCommand.PREFILL, 0) + tokens([101, 102, 103])
    after_prefill = ToyState(0)
    after_prefill.consume([101, 102, 103])
    assert recording.messages[4] == whole(ToyCommand.DECODE, 0) + word(after_prefill.next_token())
    # Under both versions, one message per command: 2 allocs, 2 prefills, 6 decodes, 1 free, a sync, shutdown.
    assert len(recording.messages) == 2 + 2 + 6 + 1 + 1 + 1


def test_head_refuses_before_sending() -> None:
    recording = RecordingTransport(world_size=2)
    head = head_on(recording, 2, ProtocolVersion.V2)
    slots: list[ToyState | None] = [None, None]
    with pytest.raises(KeyError, match="decode: slot 1 is free"):
        head.decode(slots, 1)
    head.alloc(slots, 1)
    with pytest.raises(ValueError, match="alloc: slot 1 is already in use"):
        head.alloc(slots, 1)
    with pytest.raises(ValueError, match=r"prompt\[1\]=4294967296 is outside the u32 range"):
        head.prefill(slots, 1, [1, 2**32])
    with pytest.raises(IndexError, match="seq_id=5 is out of range for 2 slots"):
        head.free(slots, 5)
    assert recording.messages == [whole(ToyCommand.ALLOC, 1)]


def test_worker_reads_the_whole_command_before_failing() -> None:
    # The worker's slot 0 is free while the head's is live: prefill fails on the
    # worker only, after its payload was read, and the next command still runs.
    recording = RecordingTransport(world_size=2)
    head = head_on(recording, 1, ProtocolVersion.V1)
    slots: list[ToyState | None] = [ToyState(0)]
    head.prefill(slots, 0, [4, 5])
    head.free(slots, 0)
    head.alloc(slots, 0)
    head.ep_link.shutdown_workers()
    worker = worker_on(recording.messages, 1, ProtocolVersion.V1)
    worker_slots: list[ToyState | None] = [None]
    with pytest.raises(EpCommandFailed, match="prefill: slot 0 is free"):
        worker.ep_worker_step(worker_slots)
    with pytest.raises(EpCommandFailed, match="free: slot 0 is free"):
        worker.ep_worker_step(worker_slots)
    assert worker.ep_worker_step(worker_slots) is True
    assert worker_slots == [ToyState(0)]
    assert worker.ep_worker_step(worker_slots) is False


def test_unknown_command_and_out_of_range_slot_fail_tagged() -> None:
    recording = RecordingTransport(world_size=2)
    head = head_on(recording, 4, ProtocolVersion.V2)
    head.ep_broadcast_cmd_for_seq(0, 77)
    head.ep_link.shutdown_workers()
    worker = worker_on(recording.messages, 4, ProtocolVersion.V2)
    with pytest.raises(EpCommandFailed, match="unknown command word 77 for ToyModel"):
        worker.ep_worker_step([None] * 4)
    with pytest.raises(EpCommandFailed, match=r"IndexError: seq_id=0 is out of range for 0 slots"):
        worker_on([header(1)], 4, ProtocolVersion.V2).ep_worker_step([])


def test_bare_v1_is_refused() -> None:
    link = EpLink(RecordingTransport(world_size=2), num_slots=2, protocol=ProtocolVersion.V1, seq_id_on_wire=False)
    with pytest.raises(ValueError, match="ToyModel serves several slots, so its headers must carry seq_id"):
        ToyModel(link)


def test_state_checksum_and_digest_follow_tokens() -> None:
    a, b = ToyState(0), ToyState(0)
    a.consume([1, 2])
    b.consume([2, 1])
    assert a.tokens != b.tokens and a.checksum != b.checksum and a != b
    assert slots_digest([a]) != slots_digest([b]) and slots_digest([a, None]) != slots_digest([a])
    assert 0 <= a.next_token() < 32_000
