"""Rank programs for the shared-memory all-reduce of ``Collectives`` over a ring: sums of many shapes and dtypes.

Each runs in a process of ``torch.run_group`` over ``open_link("shm")``.  :class:`Sums` is a model with one
collective command (``FORWARD``) whose forward all-reduces, through ``Collectives``, the tensors of one case
(:data:`CASES`): each rank's part is drawn from a generator seeded with the case and the rank, so that the test
can compute every rank's part and the sum it expects.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import MutableSequence
from typing import NoReturn

import torch

from metrale_model_engine import EpLink, LinkedEp, RunStopped, SequenceState, run_worker
from metrale_model_engine._tensors import host_sum
from metrale_model_engine.torch import Collectives, open_link

from helpers.forward_sessions import QUIET
from helpers.rank_results import save

FORWARD = 7
CASES: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {
    "float32": ((4, 512), torch.float32, False),
    "bfloat16": ((4, 512), torch.bfloat16, False),
    "larger than a slot": ((3, 200_000), torch.float32, False),  # 2.4 MB: three pieces of 1 MiB
    "non-contiguous": ((64, 48), torch.float32, True),  # its transpose
    "int64": ((5,), torch.int64, False),
}
"""Each case's shape, dtype, and whether the tensor reduced is the transpose (not contiguous) of one that shape."""


def part(case: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor in ``case`` (the same wherever it is made)."""
    shape, dtype, transposed = CASES[case]
    generator = torch.Generator().manual_seed(list(CASES).index(case) * 1000 + rank)
    tensor = (torch.randn(shape, generator=generator) * 100).to(dtype)
    return tensor.t() if transposed else tensor


def expected(case: str, world_size: int) -> torch.Tensor:
    """The sum of every rank's part in ``case``, in rank order."""
    total = part(case, 0).clone()
    for rank in range(1, world_size):
        total += part(case, rank)
    return total


class Sums(LinkedEp[SequenceState]):
    """Each FORWARD command (its follow-up: the case's index) all-reduces that case's part; every rank keeps it."""

    __slots__ = ("collectives", "ep_link", "sums")
    ep_collective_commands = frozenset({FORWARD})

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link
        self.collectives = Collectives(link, timeout=30.0)
        self.sums: dict[str, torch.Tensor] = {}

    def forward(self, index: int) -> None:
        case = list(CASES)[index]
        tensor = part(case, self.ep_link.rank)
        self.collectives.all_reduce(tensor)
        self.sums[case] = tensor

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd != FORWARD:
            super().ep_run_command(seq_id, cmd, slots)
            return
        self.forward(self.ep_link.recv_word())


def sums(rank: int, world_size: int, out: str, no_room: bool = False) -> None:
    """Run every case of :data:`CASES` once; save this rank's sums, its pid, and this host's segments named for it
    once the all-reduces were formed (the ring's and the sum's files are both unlinked by then).

    ``no_room``: the sum's file cannot be created (as in a full ``/dev/shm``), so the backend sums.
    """
    torch.set_num_threads(1)
    if no_room:
        host_sum.create_file = _no_room  # type: ignore[attr-defined]  # this rank process alone
    model = Sums(open_link("shm", num_slots=1))
    try:
        if rank == 0:
            for index in range(len(CASES)):
                model.ep_link.send_command(0, FORWARD, index)
                with model.ep_link.collective():
                    model.forward(index)
            model.ep_link.shutdown_workers()
        else:
            slots: list[SequenceState | None] = [None]
            run_worker(model, slots)
        left = [name for name in os.listdir("/dev/shm") if name.startswith(f"metrale-ep-{os.getpid()}-")]
        through = type(model.collectives._host_sum).__name__  # which path the all-reduces took
        save(out, rank, sums=model.sums, pid=os.getpid(), left=left, through=through, at=time.time())
    finally:
        model.ep_link.close()


def _no_room(size: int, creator_pid: int) -> NoReturn:
    raise OSError(errno.ENOSPC, f"/dev/shm has too little for {size} bytes")


class _Mismatched(Sums):
    """A forward whose tensor has one more item on each rank than on the one before: a bug in a model."""

    def forward(self, index: int) -> None:
        self.collectives.all_reduce(torch.ones(2 + self.ep_link.rank))


def mismatched(rank: int, world_size: int, out: str) -> None:
    """One FORWARD of :class:`_Mismatched`: save what every rank raised (``kind`` and ``message``)."""
    torch.set_num_threads(1)
    model = _Mismatched(open_link("shm", num_slots=1))
    try:
        if rank == 0:
            model.ep_link.send_command(0, FORWARD, 0)
            with model.ep_link.collective():
                model.forward(0)
        else:
            slots: list[SequenceState | None] = [None]
            run_worker(model, slots, logger=QUIET)
        save(out, rank, kind="none", message="")
    except RunStopped as error:
        save(out, rank, kind=type(error).__name__, message=str(error))
    finally:
        model.ep_link.close()
