"""Rank programs that kill workers of the reference model while ``Server`` serves; each runs in a process of
``run_group``.

The head serves :data:`WORKLOAD` (greedy requests and a seeded sampled one, more than
the slots: one waits) with the default ``on_lost_rank="recover"``.  A *plan* says which
ranks (by their rank at the start) die, and where, each at the ``n``-th time its point
comes on that rank:

* ``prefill``: the victim kills itself in a prefill's forward, before its all-reduces;
* ``decode``: the victim kills itself in a decode's forward, before its all-reduces;
* ``all-reduce``: the victim kills itself as it enters the second all-reduce of a decode
  (the other ranks wait inside it);
* ``sync``: the head kills the victim as it begins a sync point (the server syncs every step);
* ``idle``: the head kills the victim between two steps;
* ``refuses``: the victim's ``n``-th alloc leaves its slot free (a bug), so it refuses the prefill that follows
  and leaves the run: that request fails, named, and the others go on;
* ``forming``: the head kills the victim as the first re-form forms its epoch, before the
  ranks' setup agreement over it (a loss during the recovery);
* ``late``: not a victim: the rank checks in :data:`LATE` seconds late for the ``n``-th re-form
  epoch it joins (past the four heartbeats after which the head names a worker silent), alive.

Every rank saves what it saw (``rank_results``): the head each request's tokens, finish
reason and error, each recovery's line and fields; each worker its summary and place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Sequence

import torch

from metrale_model_engine import EpLink, run_worker
from metrale_model_engine._engine.link import side_of
from metrale_model_engine.reference import CMD_ALLOC, LmSlots, LmState, ReferenceLm, Request, Sampling, Server
from metrale_model_engine.torch import Collectives, open_link

from helpers.greedy import byte_ids
from helpers.rank_results import note, save
from helpers.reform_sessions import join_late, kill_as_it_forms

SLOTS = 3
PREFILL_CHUNK = 8
NEW_TOKENS = 8
TIMEOUT = 30.0
"""Seconds a command, an all-reduce and a re-form may take in these programs."""
LATE = 2.0
"""Seconds a ``late`` rank waits before it checks in for a re-form's epoch: eight beats of the heartbeat (0.25 s)."""
TEXTS = ("Licensed under the", "Permission is hereby granted", "THE SOFTWARE IS", "you may not use this file")
WORKLOAD = (
    *(Request(i, tuple(byte_ids(text)), NEW_TOKENS) for i, text in enumerate(TEXTS)),
    Request(9, tuple(byte_ids("Copyright")), NEW_TOKENS, Sampling(temperature=0.8, seed=7)),
)
"""Four greedy requests and a seeded sampled one, for three slots."""
QUIET = logging.getLogger("tests.recovery.quiet")
QUIET.setLevel(logging.CRITICAL)

Plan = dict[int, tuple[str, int]]
"""By victim (its rank at the start): its point and at which time it comes (1: the first)."""


def unfailed(new_tokens: int = NEW_TOKENS, checkpoint: str | None = None) -> dict[int, list[int]]:
    """The workload's tokens (``new_tokens`` each) on one rank in this process, nothing lost; the shipped model, or
    ``checkpoint``'s."""
    from metrale_model_engine.transport import SoloTransport

    model = ReferenceLm(EpLink(SoloTransport(), num_slots=SLOTS), checkpoint=checkpoint)
    server = Server(model, prefill_chunk=PREFILL_CHUNK, fuse=False)
    workload = [dataclasses.replace(request, max_new_tokens=new_tokens) for request in WORKLOAD]
    return {i: c.tokens for i, c in server.run(workload).items()}


def strike(out: str, origin: int) -> None:
    """Die now (SIGKILL), noting when (``time.monotonic()``: one clock for the host)."""
    note(out, f"struck{origin}", at=time.monotonic())
    os.kill(os.getpid(), signal.SIGKILL)


class Victim(ReferenceLm):
    """A worker that kills itself at its plan's point (``prefill``, ``decode``, ``all-reduce``)."""

    def __init__(self, link: EpLink, point: str, at: int, out: str, checkpoint: str | None = None) -> None:
        self.point, self.at, self.out, self.origin = point, at, out, link.rank
        self.seen = {"prefill": 0, "decode": 0, "alloc": 0}
        self.reduces = -1  # all-reduces in the decode now; -1: in none
        collectives = Collectives(link, timeout=TIMEOUT)

        def all_reduce(tensor: torch.Tensor) -> None:
            if self.reduces >= 0:
                self.reduces += 1
                if self.point == "all-reduce" and self.seen["decode"] == self.at and self.reduces == 2:
                    strike(self.out, self.origin)
            collectives.all_reduce(tensor)

        super().__init__(link, checkpoint=checkpoint, all_reduce=all_reduce)

    def ep_run_command(self, seq_id: int, cmd: int, slots: LmSlots) -> None:
        super().ep_run_command(seq_id, cmd, slots)
        if cmd == CMD_ALLOC and slots[seq_id] is not None:
            self.seen["alloc"] += 1
            if self.point == "refuses" and self.seen["alloc"] == self.at:
                slots[seq_id] = None

    def forward_prefill(self, state: LmState, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        self.seen["prefill"] += 1
        if self.point == "prefill" and self.seen["prefill"] == self.at:
            strike(self.out, self.origin)
        return super().forward_prefill(state, prompt, start, length)

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        self.seen["decode"] += 1
        if self.point == "decode" and self.seen["decode"] == self.at:
            strike(self.out, self.origin)
        self.reduces = 0
        try:
            return super().forward_decode(states, tokens)
        finally:
            self.reduces = -1


def head_kills(server: Server, plan: Plan, pids: list[int], out: str) -> None:
    """Head: kill the victims of ``idle`` before the plan's step, those of ``sync`` as its sync point begins (the
    link's class's ``sync`` wrapped, in this process alone), those of ``forming`` as the first re-form forms."""
    link = server.model.ep_link
    syncs = {victim: at for victim, (point, at) in plan.items() if point == "sync"}
    if syncs:
        kind = type(link)
        sync = kind.sync
        count = [0]

        def syncing(self: EpLink, slots: object = None) -> None:
            count[0] += 1
            for victim, at in syncs.items():
                if count[0] == at:
                    note(out, f"struck{victim}", at=time.monotonic())
                    os.kill(pids[victim], signal.SIGKILL)
            sync(self, slots)  # type: ignore[arg-type]

        kind.sync = syncing  # type: ignore[method-assign]  # this process's head alone
    for victim, (point, _) in plan.items():
        regroup = side_of(link).regroup
        if point == "forming" and regroup is not None:
            kill_as_it_forms(regroup, pids[victim], out, victim)


def served(server: Server) -> dict[str, object]:
    """What the head saw of its run, to save: each request's tokens, finish reason and error, each recovery's line,
    world size, ranks lost and recompute time, and all its fields (``times``), the world size at the end."""
    return {
        "tokens": {i: c.tokens for i, c in server.completions.items()},
        "reasons": {i: c.finish_reason for i, c in server.completions.items()},
        "errors": {i: c.error for i, c in server.completions.items()},
        "recoveries": [(str(r), r.world_size, [x.rank for x in r.lost], r.recompute_s) for r in server.recoveries],
        "times": [dataclasses.asdict(recovery) for recovery in server.recoveries],
        "world_size": server.model.ep_link.world_size,
    }


def serve(
    rank: int, world_size: int, kind: str, plan: Plan, out: str, new_tokens: int = NEW_TOKENS,
    checkpoint: str | None = None,
) -> None:  # fmt: skip
    """Serve :data:`WORKLOAD` (each request's ``max_new_tokens`` made ``new_tokens``) over ``world_size`` ranks of
    ``open_link(kind)`` while ``plan``'s victims die; the shipped model, or ``checkpoint``'s.  The head also notes
    when each token came (``time.monotonic()``)."""
    torch.set_num_threads(1)
    link = open_link(kind, num_slots=SLOTS, command_timeout=TIMEOUT, head_lost_after=5.0)
    point, at = plan.get(rank, ("", 0))
    dies_itself = point in ("prefill", "decode", "all-reduce", "refuses")
    model = Victim(link, point, at, out, checkpoint) if dies_itself else ReferenceLm(link, checkpoint=checkpoint)
    pids = model.ep_link.gather_u32(os.getpid())
    try:
        if rank:
            regroup = side_of(link).regroup
            if point == "late" and regroup is not None:
                join_late(regroup, at, LATE)
            slots: LmSlots = [None] * SLOTS
            summary = run_worker(model, slots, logger=QUIET, reform_timeout=TIMEOUT)
            save(out, rank, reforms=summary.reforms, rank_now=link.rank, world_size=link.world_size, pid=os.getpid())
            return
        came: list[float] = []
        server = Server(
            model, prefill_chunk=PREFILL_CHUNK, sync_every=1, on_token=lambda *_: came.append(time.monotonic())
        )
        head_kills(server, plan, pids, out)
        idle = {victim: at for victim, (point, at) in plan.items() if point == "idle"}
        for request in WORKLOAD:
            server.submit(dataclasses.replace(request, max_new_tokens=new_tokens))
        while server.busy:
            for victim, at in idle.items():
                if server.steps + 1 == at:
                    note(out, f"struck{victim}", at=time.monotonic())
                    os.kill(pids[victim], signal.SIGKILL)
                    time.sleep(0.05)  # dead by the next command: the step finds it there
            server.step()
        server.shutdown()
        save(out, 0, **served(server), reloaded=model.reloaded_bytes, came=came, pid=os.getpid())
    except Exception as error:  # noqa: BLE001  (whatever ended this rank, for the test to read)
        save(out, rank, error=type(error).__name__, message=str(error), pid=os.getpid())
        raise SystemExit(1) from None
    finally:
        model.ep_link.close()
