"""Rank programs for the tests across simulated hosts, run under torchrun in each host.

``python -m helpers.host_programs SCENARIO OUT [ARGS...]``: each rank joins the
group from torchrun's variables (gloo), runs its part of ``SCENARIO`` and writes
what it saw to ``OUT/rank<N>.pkl`` (:mod:`helpers.rank_results`); the files land
on this machine's disk, which every simulated host mounts.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from metrale_model_engine import EpLink, ProtocolVersion, SequenceState, run_worker
from metrale_model_engine.torch import DEFAULT_COLLECTIVE_TIMEOUT, init_group_from_env, open_transport
from metrale_model_engine.toy import ToyModel, ToyState, slots_digest

from helpers import way_back_sessions
from helpers.faulty_toy import CMD_DIE, FaultyToy
from helpers.forward_sessions import Summing
from helpers.rank_results import save
from helpers.shm_programs import SLOTS, drive_random, serve_until_error

COMMAND_TIMEOUT = 5.0
"""The link's bound on a stalled command in these programs (seconds)."""
HEAD_LOST_AFTER = 3.0
"""Seconds a worker of these programs goes on without reaching the head's host, and the head waits on one
whose heartbeat stopped."""
CUT_COMMAND_TIMEOUT = 30.0
"""The link's bound in the cut-cable scenarios: well past ``HEAD_LOST_AFTER``, which must end them."""


def soak(out: str, commands: str, seed: str, kind: str) -> None:
    """The random command stream of the soak tests over ``open_transport(kind)``; every rank saves its digest.

    First every rank asks for shared memory, and saves what that raised as ``refusal``.
    """
    try:
        open_transport("shm").close()
        refusal: str | None = None
    except Exception as error:  # noqa: BLE001  (what the refusal is, is the test's to check)
        refusal = f"{type(error).__name__}: {error}"
    transport = open_transport(kind)
    model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SLOTS
    if model.ep_link.rank == 0:
        drive_random(model, slots, int(commands), int(seed))
    else:
        run_worker(model, slots)
    save(
        out,
        model.ep_link.rank,
        digest=slots_digest(slots),
        transport=type(transport).__name__,
        host=socket.gethostname(),
        refusal=refusal,
    )
    model.ep_link.close()


def contract(out: str) -> None:
    """The way back's ordinary bugs (:func:`helpers.way_back_sessions.contract`) over ``auto``'s transport."""
    way_back_sessions.contract(dist.get_rank(), dist.get_world_size(), "auto", out)


def worker_dies(out: str, victim: str) -> None:
    """Rank ``victim`` kills itself inside a command; the head goes on sending until a send fails."""
    model = FaultyToy(open_link_v2())
    slots: list[ToyState | None] = [None] * SLOTS
    if model.ep_link.rank != 0:
        serve_until_error(model, slots, out)
        return
    model.alloc(slots, 0)
    model.ep_broadcast_cmd_for_seq(0, CMD_DIE)
    model.ep_broadcast_cmd(int(victim))
    send_until_it_fails(model, slots, out, sync_first=False, decodes=1_000)


def head_host_goes(out: str) -> None:
    """The head serves a few commands, says so in ``OUT/ready``, then waits to be killed with its host."""
    if ready_head(out) is not None:
        time.sleep(120)


def cable_cut(out: str, where: str) -> None:
    """The head serves, says so in ``OUT/ready``, waits for ``OUT/cut``, then goes on until it fails.

    ``where`` is ``command`` (decodes, then a sync point), ``sync`` (the sync point
    first) or ``forward`` (forwards whose all-reduce spans both hosts, through
    ``Collectives`` with its 5-minute bound).  The link's command timeout is
    :data:`CUT_COMMAND_TIMEOUT`: what ends the head's wait is that the other host's
    workers are lost, after ``head_lost_after``.
    """
    if where == "forward":
        cut_in_forward(out)
        return
    head = ready_head(out, CUT_COMMAND_TIMEOUT)
    if head is None:
        return
    model, slots = head
    wait_for_the_cut(out)
    send_until_it_fails(model, slots, out, sync_first=where == "sync", decodes=100)


def cut_in_forward(out: str) -> None:
    """:func:`cable_cut` inside forwards: ``forward_sessions.Summing`` over every rank of both hosts."""
    model = Summing(open_link_v2(CUT_COMMAND_TIMEOUT), "", 0, out, collective_timeout=DEFAULT_COLLECTIVE_TIMEOUT)
    if model.ep_link.rank != 0:
        slots: list[SequenceState | None] = [None, None]
        serve_until_error(model, slots, out)
        return
    model.run_step(1)
    Path(out, "ready").write_text(repr(time.time()))
    wait_for_the_cut(out)
    started = time.monotonic()
    try:
        for step in range(2, 1_000_000):
            model.run_step(step)
    except Exception as error:  # noqa: BLE001  (the test checks which error it was)
        save(out, 0, error_type=type(error).__name__, error=str(error), seconds=time.monotonic() - started)
        os._exit(3)


def wait_for_the_cut(out: str) -> None:
    while not Path(out, "cut").exists():
        time.sleep(0.01)


def ready_head(out: str, command_timeout: float = COMMAND_TIMEOUT) -> tuple[ToyModel, list[ToyState | None]] | None:
    """The head: a sequence prefilled, a sync point passed, ``OUT/ready`` written; its model and slots.

    A worker serves until its receive fails, and gets ``None``.
    """
    model = ToyModel(open_link_v2(command_timeout))
    slots: list[ToyState | None] = [None] * SLOTS
    if model.ep_link.rank != 0:
        serve_until_error(model, slots, out)
        return None
    model.alloc(slots, 0)
    model.prefill(slots, 0, [1, 2, 3])
    model.ep_link.sync(slots)
    Path(out, "ready").write_text(repr(time.time()))
    return model, slots


def send_until_it_fails(
    model: ToyModel, slots: list[ToyState | None], out: str, *, sync_first: bool, decodes: int
) -> None:
    """Head: [a sync point,] ``decodes`` decodes of slot 0, a sync point; saves the error and its time, exits 3.

    A send may be buffered by the kernels on the way before a loss shows, hence many decodes.
    """
    started = time.monotonic()
    try:
        if sync_first:
            model.ep_link.sync(slots)
        for _ in range(decodes):
            model.decode(slots, 0)
        model.ep_link.sync(slots)
    except Exception as error:  # noqa: BLE001  (the test checks which error it was)
        save(out, 0, error_type=type(error).__name__, error=str(error), seconds=time.monotonic() - started)
        os._exit(3)  # the group cannot be torn down with a rank gone
    save(out, 0, error_type=None, error=None, seconds=time.monotonic() - started)


def open_link_v2(command_timeout: float = COMMAND_TIMEOUT) -> EpLink:
    """The link of the fault scenarios: ``auto``'s transport, protocol v2, the bounds above."""
    transport = open_transport("auto", head_lost_after=HEAD_LOST_AFTER)
    return EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=command_timeout)


SCENARIOS: dict[str, Callable[..., None]] = {
    "soak": soak,
    "contract": contract,
    "worker_dies": worker_dies,
    "head_host_goes": head_host_goes,
    "cable_cut": cable_cut,
}


def main(argv: list[str]) -> None:
    init_group_from_env(backend="gloo")
    scenario, *args = argv
    SCENARIOS[scenario](*args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
