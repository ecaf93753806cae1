"""A tensor-parallel model that goes on when a worker dies: its link forms again over the ranks left.

Each rank holds its share of the hidden units of a small MLP (small integer weights:
every sum is exact, whatever the world size).  The model opts in to re-forms
(``ep_reforms``); in the middle of the run the last worker is killed (SIGKILL).  The
head's ``RunStopped`` names it and how; ``reform_link`` forms the link again over the
ranks left (a new epoch, the ranks renumbered, each taking up its new share in
``ep_reformed``); every survivor's ``run_worker`` goes on by itself.  The head checks
every output against the MLP computed alone, and each rank prints one line.

    python examples/reform_model.py [--transport auto|shm|torch] [--world-size N]

It starts its own ranks (4 local gloo ranks by default) and exits 0 when every
output was right and every rank but the killed one ended cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import MutableSequence

import torch

from metrale_model_engine import EpLink, LinkedEp, RunStopped, SequenceState, run_worker
from metrale_model_engine.reform import Reform, reform_link
from metrale_model_engine.torch import Collectives, open_link, run_group

FORWARD, HIDDEN, WIDTH, STEPS, KILLED_AT = 2, 12, 4, 6, 3
Slots = MutableSequence[SequenceState | None]


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole MLP, the same on every rank: small integers."""
    generator = torch.Generator().manual_seed(0)
    up = torch.randint(-2, 3, (HIDDEN, WIDTH), generator=generator).float()
    return up, torch.randint(-2, 3, (WIDTH, HIDDEN), generator=generator).float()


class ShardedMlp(LinkedEp[SequenceState]):
    ep_collective_commands = frozenset({FORWARD})
    ep_reforms = True  # a lost worker stops the run; reform_link forms the link again over the ranks left

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link
        self.collectives = Collectives(link)  # over the default group: it follows the link into each new epoch
        self.shard()

    def shard(self) -> None:
        rank, size = self.ep_link.rank, self.ep_link.world_size
        mine = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
        up, down = weights()
        self.up, self.down = up[mine], down[:, mine]

    def ep_reformed(self, reform: Reform, slots: Slots) -> None:
        self.shard()  # this rank's share at its new rank (reform.rank) of the new world size (reform.world_size)

    def mlp(self, step: int) -> torch.Tensor:
        out = torch.relu(torch.full((1, WIDTH), float(step)) @ self.up.T) @ self.down.T
        self.collectives.all_reduce(out)
        return out

    def forward(self, step: int) -> torch.Tensor:
        self.ep_link.send_command(0, FORWARD, step)
        with self.ep_link.collective():
            return self.mlp(step)

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        step = self.ep_link.recv_word()
        if step == KILLED_AT and self.ep_link.epoch == 0 and self.ep_link.rank == self.ep_link.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the fault: the last worker dies in its command
        self.mlp(step)


def alone(step: int) -> torch.Tensor:
    up, down = weights()
    return torch.relu(torch.full((1, WIDTH), float(step)) @ up.T) @ down.T


def serve(rank: int, world_size: int, transport: str) -> None:
    with ShardedMlp(open_link(transport, num_slots=1)) as model:
        slots: Slots = [None]
        if rank:
            summary = run_worker(model, slots)  # goes on through the re-form
            line = f"worker {rank} of {world_size}: now rank {model.ep_link.rank} of {model.ep_link.world_size}, "
            sys.stdout.write(line + f"{summary.commands_run} commands, {summary.reforms} re-form(s)\n")
            return
        right, step = 0, 1
        while step <= STEPS:
            try:
                right += bool(torch.equal(model.forward(step), alone(step)))
                step += 1
            except RunStopped as stopped:
                sys.stderr.write(f"{stopped}\n")  # names the lost rank, and how it ended
                reform = reform_link(model, slots)  # raises RunStopped, one line, where it cannot
                sys.stderr.write(f"head: {reform}\n")  # the one line of a recovery
        model.ep_link.shutdown_workers()
        sys.stdout.write(f"head: {right} of {STEPS} outputs as the MLP alone, {model.ep_link.world_size} rank(s) now\n")
        if right != STEPS:
            raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tensor-parallel model that goes on when a worker dies")
    parser.add_argument("--transport", choices=["auto", "shm", "torch"], default="auto")
    parser.add_argument("--world-size", type=int, default=4)
    options = parser.parse_args()
    codes = run_group(serve, options.world_size, options.transport)
    raise SystemExit(0 if codes == [0] * (options.world_size - 1) + [-signal.SIGKILL] else 1)
