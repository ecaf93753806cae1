"""A multi-rank model on torch.distributed: the head serves, every worker runs commands.

Run it on 2 local gloo ranks (it starts them itself), or under torchrun:

    python examples/ep_model.py
    torchrun --nproc-per-node 3 examples/ep_model.py

Each rank prints its slot states; they agree under protocol v1 and v2
(``METRALE_EP_PROTOCOL``).  Exit code 0; 2 with one ``error: ...`` line when the
ranks could not set up their link.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableSequence

import torch.distributed as dist

from metrale_model_engine import EpLink, EpSetupError, LinkedEp, SequenceState, TokenArray, as_u32_buffer, run_worker
from metrale_model_engine.torch import init_group_from_env, open_link, run_group

PREFILL, DECODE = 1, 2


class MyModel(LinkedEp[SequenceState]):
    __slots__ = ("ep_link",)

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link  # the engine: setup agreement, sends, receives

    # head side of each command: check everything, then send it (one message), then apply it locally
    def prefill(self, slots: list[SequenceState | None], seq_id: int, prompt: TokenArray) -> None:
        tokens = as_u32_buffer("prompt", prompt)  # bad tokens raise here; nothing is sent
        self.ep_link.send_command(seq_id, PREFILL, tokens)
        slots[seq_id] = SequenceState(seq_id, memoryview(tokens).tolist())

    def decode(self, slots: list[SequenceState | None], seq_id: int, token: int) -> None:
        state = slots[seq_id]
        if state is None:
            raise KeyError(f"decode: slot {seq_id} is free")
        self.ep_link.send_command(seq_id, DECODE, token)
        state.append(token)

    # worker side: read the whole command, then apply it
    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd == PREFILL:
            slots[seq_id] = SequenceState(seq_id, self.ep_link.recv_tokens())
        elif cmd == DECODE:
            token = self.ep_link.recv_word()
            state = slots[seq_id]
            if state is None:
                raise KeyError(f"decode: slot {seq_id} is free")
            state.append(token)
        else:
            super().ep_run_command(seq_id, cmd, slots)  # "unknown command word"


def serve(rank: int, world_size: int) -> None:
    """One rank's part; opening the link is collective over the group."""
    with MyModel(open_link(num_slots=8)) as model:  # leaving the block closes the link
        slots: list[SequenceState | None] = [None] * 8
        if rank == 0:
            model.prefill(slots, 5, [11, 12, 13])
            model.prefill(slots, 2, list(range(100, 140)))
            for step in range(3):
                model.decode(slots, 5, 20 + step)
                model.decode(slots, 2, 30 + step)
            model.ep_link.shutdown_workers()  # a sync point: raises if a worker failed a command or diverged
        else:
            summary = run_worker(model, slots)  # until the shutdown header
            say(f"rank {rank}: {summary.commands_run} commands run, {summary.commands_failed} failed")
            if summary.commands_failed:  # the head heard of each at its shutdown's sync point, and raised
                raise SystemExit(1)
    live = {state.seq_id: list(state.tokens) for state in slots if state is not None}
    say(f"rank {rank} of {world_size}: slots {live}")


def say(line: str) -> None:
    """Print ``line`` in one write, so that the ranks' lines never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    if "RANK" in os.environ:  # torchrun, or any launcher that sets the env:// variables
        init_group_from_env()
        serve(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()  # leave the group before the interpreter exits
    else:
        codes = run_group(serve, 2)  # a failed setup (EpSetupError) of the ranks is raised here, once
        if any(codes):
            raise SystemExit(f"rank exit codes {codes}")


if __name__ == "__main__":
    try:
        main()
    except EpSetupError as error:  # the ranks could not set up their link: one line, from rank 0
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
