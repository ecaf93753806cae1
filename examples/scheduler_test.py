"""A scheduler's unit test without processes: record the head's broadcasts, replay them into a worker.

python examples/scheduler_test.py            # METRALE_EP_PROTOCOL=v1 (default) or v2
"""

from collections.abc import MutableSequence

from metrale_model_engine import EpLink, LinkedEp, ModelEp, ProtocolVersion, SequenceState
from metrale_model_engine.testing import EpEvent, RecordingEp, ReplayTransport

PREFILL = 1


def schedule(model: ModelEp[SequenceState], slots: list[SequenceState | None], prompts: dict[int, list[int]]) -> None:
    """One scheduler step: a prefill for each new sequence."""
    for seq_id, prompt in prompts.items():
        if model.is_ep():
            model.ep_broadcast_cmd_for_seq(seq_id, PREFILL)  # the header
            model.ep_broadcast_tokens(prompt)  # its follow-up
        slots[seq_id] = SequenceState(seq_id, prompt)


class PrefillWorker(LinkedEp[SequenceState]):
    __slots__ = ("ep_link",)

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd != PREFILL:
            return super().ep_run_command(seq_id, cmd, slots)
        slots[seq_id] = SequenceState(seq_id, self.ep_link.recv_tokens())


protocol = ProtocolVersion.from_env()
head: RecordingEp[SequenceState] = RecordingEp(protocol_v2=protocol is ProtocolVersion.V2, num_slots=8)
head_slots: list[SequenceState | None] = [None] * 8
schedule(head, head_slots, {3: [5, 6, 7], 6: list(range(40))})
assert head.events[0] == EpEvent("cmd_for_seq", (3, PREFILL))

# The worker side, built without a process group: a link over a replay transport with nothing in it.
worker = PrefillWorker(EpLink(ReplayTransport(()), num_slots=8, protocol=protocol))
worker_slots: list[SequenceState | None] = [None] * 8
summary = head.replay(worker, worker_slots)  # agrees on setup with the recording, then runs
assert summary.commands_run == 2 and worker_slots == head_slots
print(f"protocol {protocol.value}: the worker's slots equal the head's")
