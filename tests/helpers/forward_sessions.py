"""Rank programs for failures inside a forward: a plain model with one all-reduce per command, and its bugs.

Each runs in a process of ``torch.run_group``.  :class:`Summing` is the smallest
model a user writes from the README: a collective command (``FORWARD``) whose
forward sums one tensor over the ranks through ``Collectives``, the head's forward
inside ``link.collective()``.  :func:`forward_fault` plants one fault on one rank
and saves, on every rank, the error that ended it and when (``time.time()``), so
the test can bound the time from the fault to every rank's error.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import MutableSequence
from typing import cast

import torch
import torch.distributed as dist

from metrale_model_engine import EpLink, LinkedEp, RunStopped, SequenceState, run_worker
from metrale_model_engine.torch import DEFAULT_HEAD_LOST_AFTER, Collectives, open_link

from helpers.rank_results import note, save

FORWARD = 7
STEPS = 4
"""Commands the head sends; the fault strikes in the second."""
FAULTY_STEP = 2
COLLECTIVE_TIMEOUT = 2.0
"""Seconds an all-reduce waits in these programs (5 minutes by default)."""
QUIET = logging.getLogger("tests.forward.quiet")
QUIET.setLevel(logging.CRITICAL)

Slots = MutableSequence[SequenceState | None]


class Summing(LinkedEp[SequenceState]):
    """Each FORWARD command sums ``rank + 1`` over the ranks, with one all-reduce; the head checks the sum.

    The pattern slightly wrong, on every rank: ``forgot`` leaves ``ep_collective_commands``
    empty; ``direct`` calls ``torch.distributed.all_reduce`` instead of ``Collectives``;
    ``closed-socket`` runs a collective of the model's own (counted with
    ``check_collective``, then ``torch.distributed``), which a worker that leaves fails
    with "Connection closed by peer".  The head's own (victim 0): ``head-skip`` returns
    early from its forward of the faulty step (a cache hit), before its ``collective()``
    block; ``head-skip-last`` does so in the last step, before the shutdown's sync point.
    """

    __slots__ = ("collectives", "ep_link", "fault", "out", "reduce", "victim")
    ep_collective_commands = frozenset({FORWARD})

    def __init__(
        self, link: EpLink, fault: str, victim: int, out: str, collective_timeout: float = COLLECTIVE_TIMEOUT
    ) -> None:
        self.ep_link = link
        self.collectives = Collectives(link, timeout=collective_timeout)
        self.fault = fault if link.rank == victim else ""
        self.victim = victim
        self.out = out
        self.reduce = {"direct": self._direct, "closed-socket": self._own}.get(fault, self.collectives.all_reduce)

    def _direct(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def _own(self, tensor: torch.Tensor) -> None:
        self.ep_link.check_collective("an all-reduce")
        dist.all_reduce(tensor)

    def forward(self, step: int) -> float:
        mine = self.ep_link.rank == self.victim and step == FAULTY_STEP
        if mine and self.fault in ("before", "closed-socket"):
            self._struck()
            raise KeyError("slot 0 is free on this worker")
        if mine and self.fault in ("stop", "kill", "lost", "pause"):
            self._struck()
            os.kill(os.getpid(), signal.SIGKILL if self.fault == "kill" else signal.SIGSTOP)
        if mine and self.fault == "skip":
            self._struck()
            return 0.0  # a bug that skips the forward, and its all-reduce with it
        if mine and self.fault == "hang":
            self._struck()
            time.sleep(COLLECTIVE_TIMEOUT + 5.0)  # hung in its forward, running: no signal shows it
        if self.fault in ("forgot", "direct") and step == 1:
            self._struck()  # the first forward of the run: the mistake shows there, on every rank
        tensor = torch.full((4, 4), float(self.ep_link.rank + 1))
        if mine and self.fault == "inside":
            self._struck()  # a list where a tensor belongs: the backend's call refuses it, inside the all-reduce
            self.collectives.all_reduce(cast(torch.Tensor, tensor.tolist()))
        self.reduce(tensor)
        if mine and self.fault == "after":
            self._struck()
            raise ValueError("a bug after the all-reduce")
        return float(tensor[0, 0])

    def _struck(self) -> None:
        """Note when the fault struck, and where."""
        note(self.out, "struck", rank=self.ep_link.rank, at=time.time())

    def run_step(self, step: int) -> float:
        """Head: one FORWARD command, then its forward."""
        self.ep_link.send_command(0, FORWARD, step)
        if (self.fault, step) in (("head-skip", FAULTY_STEP), ("head-skip-last", STEPS)):
            self._struck()
            return 3.0  # a cache hit: the head returns what it computed before, and skips its forward
        with self.ep_link.collective():
            return self.forward(step)

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        if cmd != FORWARD:
            super().ep_run_command(seq_id, cmd, slots)
            return
        step = self.ep_link.recv_word()
        if self.fault == "over-read" and step == FAULTY_STEP:
            self._struck()
            self.ep_link.recv_word()  # one follow-up more than the head sent
        self.forward(step)


class Forgot(Summing):
    """The README's model without its declaration: ``ep_collective_commands`` forgotten."""

    __slots__ = ()
    ep_collective_commands = frozenset()


HEAD_LOST_AFTER = 3.0
"""Seconds without a heartbeat after which a stopped worker is lost, in the faults ``lost`` and ``pause``."""
PAUSE = 1.5
"""Seconds the worker of the fault ``pause`` stays stopped inside its forward: less than :data:`HEAD_LOST_AFTER`."""


def forward_fault(rank: int, world_size: int, kind: str, fault: str, victim: int, out: str) -> None:
    """Run :data:`STEPS` commands with ``fault`` planted on rank ``victim``; save how each rank ended.

    ``lost`` and ``pause`` stop the victim inside its forward under a collective
    timeout of 30 s and ``head_lost_after`` of :data:`HEAD_LOST_AFTER`; the head
    resumes the one of ``pause`` after :data:`PAUSE` seconds.
    """
    torch.set_num_threads(1)
    watched = fault in ("lost", "pause")
    lost_after = HEAD_LOST_AFTER if watched else DEFAULT_HEAD_LOST_AFTER
    model = (Forgot if fault == "forgot" else Summing)(
        open_link(kind, num_slots=2, command_timeout=30.0, head_lost_after=lost_after),
        fault,
        victim,
        out,
        30.0 if watched else COLLECTIVE_TIMEOUT,
    )
    pids = model.ep_link.gather_u32(os.getpid())
    if fault == "pause" and rank == 0:  # as a debugger would, or a machine that swapped: back before the bound
        resume = threading.Timer(PAUSE, os.kill, (pids[victim], signal.SIGCONT))
        resume.daemon = True
        resume.start()
    try:
        if rank == 0:
            sums = [model.run_step(step) for step in range(1, STEPS + 1)]
            model.ep_link.shutdown_workers()
            save(out, rank, error=None, sums=sums, at=time.time())
        else:
            slots: Slots = [None, None]
            summary = run_worker(model, slots, logger=QUIET)
            save(out, rank, error=None, summary=summary, at=time.time())
    except RunStopped as error:
        save(out, rank, kind=type(error).__name__, message=str(error), failures=error.failures, at=time.time())
        if (
            fault in ("stop", "hang", "lost") and rank == 0
        ):  # it cannot end by itself (soon): end it, as an operator would
            os.kill(pids[victim], signal.SIGKILL)
        raise SystemExit(1) from None
    except Exception as error:  # noqa: BLE001  (the error under test, whatever it is)
        save(out, rank, kind=type(error).__name__, message=str(error), at=time.time())
        raise SystemExit(1) from None
    finally:
        model.ep_link.close()


def check_the_killed_rank_is_named(message: str, rank: int, how: str = "") -> None:
    """``message``, the head's ``RunStopped`` once ``rank`` was killed at :data:`FAULTY_STEP`, names that rank (and
    ``how`` it ended, where given), blames no witness and says of no rank that it said nothing."""
    named = (
        f"head: the run stopped in command {FAULTY_STEP} (seq_id=0, cmd={FORWARD}): worker rank(s) [{rank}] exited "
        f"(died or left the run) after command {FAULTY_STEP}"
    )
    assert message.startswith(named + (f" ({how})" if how else "")), message
    assert " failed command" not in message and "said nothing" not in message, message
