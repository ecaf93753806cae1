"""A tensor-parallel model on torch.distributed, written the safe way: a failure on any rank stops every rank.

Each rank holds its share of the hidden units of a small MLP; a forward sums the
shares with one all-reduce.  The head serves; every worker runs the same commands.
Run it on 2 local gloo ranks (it starts them itself), or under torchrun:

    python examples/ep_model.py [--transport auto|shm|torch] [--bug]
    torchrun --nproc-per-node 4 examples/ep_model.py

Each rank prints its slots and a checksum of its last output: they agree, under
protocol v1 and v2 (``METRALE_EP_PROTOCOL``).  ``--bug`` plants the bug every model
has once: worker rank 1 loses a slot and its hook raises a plain ``KeyError``
before the all-reduce.  The run then stops on every rank within seconds, each rank
prints one ``error:`` line (the head's names the worker, the command and the error)
and exits 1.  Exit 2 with one ``error:`` line when the ranks could not set up their link;
130 with the line ``interrupted`` on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import MutableSequence, Sequence

import torch

from metrale_model_engine import EpLink, EpSetupError, LinkedEp, RunStopped, SequenceState, check_slot, run_worker
from metrale_model_engine.torch import Collectives, init_group_from_env, open_link, run_group

OPEN, FORWARD = 1, 2
Slots = MutableSequence[SequenceState | None]


def held(slots: Slots, seq_id: int) -> SequenceState:
    state = slots[seq_id]
    if state is None:
        raise KeyError(f"slot {seq_id} is free")
    return state


class TensorParallelMlp(torch.nn.Module, LinkedEp[SequenceState]):
    ep_collective_commands = frozenset({FORWARD})  # its forward has an all-reduce: a failure stops the run

    def __init__(self, link: EpLink, width: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.ep_link = link  # the engine: setup agreement, sends, receives, the run's state
        self.collectives = Collectives(link)  # all-reduces that are bounded and stop the run when they fail
        weights = torch.Generator().manual_seed(0)  # every rank makes the same full weights, keeps its share
        self.embed = torch.randn(256, width, generator=weights)
        mine = slice(link.rank * hidden // link.world_size, (link.rank + 1) * hidden // link.world_size)
        self.up = torch.randn(hidden, width, generator=weights)[mine]
        self.down = torch.randn(width, hidden, generator=weights)[:, mine]
        self.checksum = 0.0  # of the last output: the same on every rank

    def mlp(self, tokens: Sequence[int]) -> torch.Tensor:
        x = self.embed[torch.tensor(tokens)]
        out = torch.relu(x @ self.up.T) @ self.down.T  # this rank's share of the hidden units
        self.collectives.all_reduce(out)  # the sum over the ranks: every rank has the whole output
        self.checksum = float(out.sum())
        return out

    # head side of each command: check everything, send it as one message, then run the same forward
    def open(self, slots: Slots, seq_id: int) -> None:
        check_slot(seq_id, slots)
        self.ep_link.send_command(seq_id, OPEN)
        slots[seq_id] = SequenceState(seq_id)

    def forward_tokens(self, slots: Slots, seq_id: int, tokens: Sequence[int]) -> torch.Tensor:
        state = held(slots, seq_id)
        self.ep_link.send_command(seq_id, FORWARD, tokens)
        with self.ep_link.collective():  # if the head's own forward fails, the run stops on every rank
            out = self.mlp(tokens)
        state.extend(tokens)
        return out

    # worker side: read the whole command, then run it; any failure of FORWARD stops the run
    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd == OPEN:
            slots[seq_id] = SequenceState(seq_id)
        elif cmd == FORWARD:
            tokens = self.ep_link.recv_tokens()
            state = held(slots, seq_id)
            self.mlp(tokens)
            state.extend(tokens)
        else:
            super().ep_run_command(seq_id, cmd, slots)  # "unknown command word": an ordinary failure


class WithABug(TensorParallelMlp):
    """``--bug``: worker rank 1 loses slot 0 before its first forward there, as a model bug would."""

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd == FORWARD and seq_id == 0 and self.ep_link.rank == 1:
            slots[seq_id] = None
        super().ep_run_command(seq_id, cmd, slots)


def serve(rank: int, world_size: int, transport: str, model_class: type[TensorParallelMlp]) -> None:
    with model_class(open_link(transport, num_slots=4)) as model:
        slots: Slots = [None] * 4
        try:
            if rank == 0:
                for seq_id in (0, 2):
                    model.open(slots, seq_id)
                for step in range(3):
                    for seq_id in (0, 2):
                        model.forward_tokens(slots, seq_id, [65 + step, 97 + seq_id])
                model.ep_link.shutdown_workers()  # a sync point: raises if a worker failed a command or diverged
            else:
                run_worker(model, slots)  # until the shutdown header
        except RunStopped as stopped:  # the run is over on every rank; the head's line says the most
            sys.stderr.write(f"error: {stopped}\n")  # one write, as below
            raise SystemExit(1) from None
        live = {state.seq_id: list(state.tokens) for state in slots if state is not None}
        line = f"rank {rank} of {world_size}: slots {live}, last output {model.checksum:.4f}"
        sys.stdout.write(line + "\n")  # one write, so that the ranks' lines never interleave


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=["auto", "shm", "torch"], default="auto")
    parser.add_argument("--bug", action="store_true", help="worker rank 1 raises in its hook before the all-reduce")
    args = parser.parse_args()
    model_class = WithABug if args.bug else TensorParallelMlp
    if "RANK" in os.environ:  # torchrun, or any launcher that sets the env:// variables
        init_group_from_env()
        try:
            serve(torch.distributed.get_rank(), torch.distributed.get_world_size(), args.transport, model_class)
        finally:
            torch.distributed.destroy_process_group()  # leave the group before the interpreter exits
        return 0
    codes = run_group(serve, 2, args.transport, model_class)  # a failed setup (EpSetupError) is raised here, once
    return 1 if any(codes) else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except EpSetupError as error:  # the ranks could not set up their link: one line, from rank 0
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C: the ranks left quietly (run_group ended any that lingered)
        if int(os.environ.get("RANK", "0")) == 0:
            print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
