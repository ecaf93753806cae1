"""Rank programs for the reference model served over the protocol; each runs in a process of ``torch.run_group``.

Every program writes what it saw with :func:`rank_results.save`.  :func:`serve_workload`
serves :data:`WORKLOAD` (requests that arrive while others run) and records the
head's logits; the fault programs make one rank die or refuse inside a forward.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence

import torch

from metrale_model_engine import EpDivergenceError, EpLink, ProtocolVersion, run_worker
from metrale_model_engine.reference import (
    CMD_ALLOC,
    LmSlots,
    LmState,
    ReferenceLm,
    Request,
    Server,
    kv_digest,
)
from metrale_model_engine.reference.network.model import ShardedBlock
from metrale_model_engine.torch import Collectives, open_link

from helpers.greedy import byte_ids
from helpers.rank_results import save

SLOTS = 3
PREFILL_CHUNK = 8
NEW_TOKENS = 10
LATE_AFTER_STEP = 3
TEXTS = ("Licensed under the", "Permission is hereby granted", "THE SOFTWARE IS", "you may not use this file")
WORKLOAD = tuple(Request(i, tuple(byte_ids(text)), NEW_TOKENS) for i, text in enumerate(TEXTS))
"""Requests 0 and 1 come first; 2 and 3 arrive after step :data:`LATE_AFTER_STEP`, while 0 and 1 run."""
TAIL = Request(99, tuple(byte_ids("Copyright")), 1)
"""Left in its slot at the end, so the final digests compare a held slot."""
QUIET = logging.getLogger("tests.serving.quiet")
QUIET.setLevel(logging.CRITICAL)


class LoggedLm(ReferenceLm):
    """The head's model, keeping a copy of the logits of every prefill and decode (in order)."""

    logits: list[torch.Tensor]

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        logits = super().prefill(slots, seq_id, prompt, start, length)
        self.logits.append(logits.clone())
        return logits

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        logits = super().decode(slots, seq_ids, tokens)
        self.logits.append(logits.clone())
        return logits


def drive(model: LoggedLm) -> tuple[dict[int, list[int]], Server]:
    """Serve :data:`WORKLOAD` with a sync point every step, then leave :data:`TAIL` prefilled in a slot."""
    model.logits = []
    server = Server(model, prefill_chunk=PREFILL_CHUNK, sync_every=1, fuse=False)  # one rank steps as several do
    for request in WORKLOAD[:2]:
        server.submit(request)
    while server.busy or server.steps <= LATE_AFTER_STEP:
        if server.steps == LATE_AFTER_STEP:
            for request in WORKLOAD[2:]:
                server.submit(request)
        server.step()
    model.alloc(server.slots, 0)
    model.prefill(server.slots, 0, TAIL.prompt, 0, len(TAIL.prompt))
    return {i: c.tokens for i, c in server.completions.items()}, server


Served = tuple[dict[int, list[int]], list[torch.Tensor], int]
"""What a served workload gives: each request's tokens, the logits of every step, the final KV digest."""


def one_rank_reference() -> Served:
    """The workload on one rank, in this process: the tokens, the logits, the final digest."""
    from metrale_model_engine.transport import SoloTransport

    model = LoggedLm(EpLink(SoloTransport(), num_slots=SLOTS))
    tokens, server = drive(model)
    return tokens, model.logits, kv_digest(server.slots)


def _link(kind: str, protocol: str) -> EpLink:
    torch.set_num_threads(1)
    return open_link(kind, num_slots=SLOTS, protocol=ProtocolVersion(protocol), command_timeout=30.0)


def serve_workload(rank: int, world_size: int, kind: str, protocol: str, out: str) -> None:
    with LoggedLm(_link(kind, protocol)) as model:
        if rank == 0:
            tokens, server = drive(model)
            server.shutdown()  # a sync point comparing every rank's slots
            save(out, rank, tokens=tokens, logits=model.logits, digest=kv_digest(server.slots))
        else:
            slots: list[LmState | None] = [None] * SLOTS
            summary = run_worker(model, slots, logger=QUIET)
            save(out, rank, digest=kv_digest(slots), failed=summary.commands_failed)


class DiesInDecode(ReferenceLm):
    """A rank that kills itself (SIGKILL) inside the second all-reduce of its first decode step: its all-reduce is
    ``Collectives``' behind a wrapper that counts the calls of a decode."""

    out = ""
    _reduces_in_decode = -1

    def __init__(self, link: EpLink) -> None:
        collectives = Collectives(link)

        def all_reduce(tensor: torch.Tensor) -> None:
            if self._reduces_in_decode >= 0:
                self._reduces_in_decode += 1
                if self._reduces_in_decode == 2:
                    save(self.out, link.rank, killed_at=time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
            collectives.all_reduce(tensor)

        super().__init__(link, all_reduce=all_reduce)

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        self._reduces_in_decode = 0
        return super().forward_decode(states, tokens)


class ForgetsAllocs(ReferenceLm):
    """A worker whose allocs leave the slot free (a bug): its next prefill there must be refused, not run."""

    def ep_run_command(self, seq_id: int, cmd: int, slots: LmSlots) -> None:
        super().ep_run_command(seq_id, cmd, slots)
        if cmd == CMD_ALLOC:
            slots[seq_id] = None


def fault(rank: int, world_size: int, kind: str, victim: int, how: str, out: str) -> None:
    """Serve :data:`WORKLOAD` while rank ``victim`` dies inside a decode (``how="die"``) or forgets
    its allocs (``how="forget"``); every surviving rank saves the error that stopped it, and when."""
    link = _link(kind, "v2")
    DiesInDecode.out = out
    cls = {"die": DiesInDecode, "forget": ForgetsAllocs}[how] if rank == victim else ReferenceLm
    model = cls(link)
    try:
        if rank == 0:
            Server(model, prefill_chunk=PREFILL_CHUNK, on_lost_rank="stop").run(WORKLOAD)
            model.ep_link.shutdown_workers()
        else:
            slots: list[LmState | None] = [None] * SLOTS
            run_worker(model, slots, logger=QUIET)
        save(out, rank, error=None, at=time.time())
    except Exception as error:  # noqa: BLE001  (the error under test)
        save(out, rank, error=error, kind=type(error).__name__, message=str(error), at=time.time())
    finally:
        model.ep_link.close()


class AltersItsCache(ReferenceLm):
    """A worker that, after its third decode, adds 1 to a value its cache holds (memory corruption, say)."""

    decodes = 0

    def forward_decode(self, states: Sequence[LmState], tokens: Sequence[int]) -> torch.Tensor:
        logits = super().forward_decode(states, tokens)
        self.decodes += 1
        if self.decodes == 3:
            block = self.lm.layers[0]
            assert isinstance(block, ShardedBlock)
            block.attn.k_cache[states[0].blocks[0], 0, 0, 0] += 1.0  # the sequence's first position
        return logits


def tampered_cache(rank: int, world_size: int, kind: str, out: str) -> None:
    """Serve with deep sync points (``check_kv_values``) while worker 1 alters its cache; the head saves the error."""
    link = _link(kind, "v2")
    model = (AltersItsCache if rank == 1 else ReferenceLm)(link, check_kv_values=True)
    try:
        if rank:
            slots: LmSlots = [None] * SLOTS
            run_worker(model, slots, logger=QUIET)
            return
        server = Server(model, prefill_chunk=PREFILL_CHUNK)
        server.submit(WORKLOAD[0])
        clean = 0
        try:
            while server.busy:
                server.step()
                if server.decode_steps:
                    link.sync(server.slots)
                    clean += 1
        except EpDivergenceError as error:
            save(out, rank, kind=type(error).__name__, message=str(error), ranks=error.ranks, clean_syncs=clean)
        link.shutdown_workers()
    finally:
        link.close()
