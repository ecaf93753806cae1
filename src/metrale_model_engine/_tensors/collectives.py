"""``Collectives``: a model's all-reduces over its process group, inside the run's contract."""

from __future__ import annotations

import datetime
from typing import Final

import torch
import torch.distributed as dist

from .._core.checks import check_seconds
from .._core.transport import PretendGroup
from .._engine.link import EpLink
from .._engine.way_back.reports import EXIT_GRACE
from .._shm.transport import ShmTransport
from .._shm.waiting import deadline_after
from .._torch.hosts import waits_of
from .host_sum import HostSum

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "EXIT_GRACE", "Collectives"]


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None  # a link of several ranks: torch.distributed is initialised
    return world


DEFAULT_COLLECTIVE_TIMEOUT: Final[float] = 300.0
"""Seconds one collective of a forward may wait for the other ranks before the run stops (5 minutes)."""


class Collectives:
    """The all-reduces of a model's forward, bounded, and mapped to [`RunStopped`][metrale_model_engine.RunStopped].

    Call [`all_reduce`][metrale_model_engine.torch.Collectives.all_reduce] where the forward would call
    ``torch.distributed.all_reduce``.  Every rank of the link runs the same
    commands, so the ranks meet in the same all-reduces; when one cannot (it died,
    refused the command, stalls or skipped its forward), the others must not wait
    for ever.  Two things make sure of it:

    * each all-reduce waits at most ``timeout`` seconds for the other ranks (the
      backend's own bound, passed to the collective, so nothing is left pending);
    * across hosts, workers whose heartbeat stopped for ``head_lost_after`` while
      the head waits in one are lost, and its wait ends then (see
      [`TorchTransport`][metrale_model_engine.torch.TorchTransport]);
    * a failed or timed-out all-reduce stops the run
      ([`EpLink.collective_failed`][metrale_model_engine.EpLink.collective_failed]):
      the head names the worker ranks that reported a failure or exited, with their
      command and error where their reports arrived; every later call of the link
      raises [`RunStopped`][metrale_model_engine.RunStopped].

    Over gloo a rank's failure reaches its peers when its process exits (its
    sockets close): within milliseconds when the failing rank leaves as
    ``run_worker`` does, else at ``timeout``.  Under NCCL a collective runs on the
    GPU stream and its failure or timeout surfaces through the communicator's
    watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), which ends the process; the
    ``timeout`` is the watchdog's bound for this collective.

    Over a [`ShmTransport`][metrale_model_engine.shm.ShmTransport] (every rank on one host) and the default group,
    an all-reduce of a CPU tensor goes through a shared-memory file instead of the backend (``host_sum``: tens of
    microseconds where gloo takes hundreds), formed at the first one of each epoch; it sums in rank order, so every
    rank holds the same bits.  Its waits are bounded by ``timeout`` (``None``: none), and a rank that exits fails
    the others' within milliseconds.  Anything else (a CUDA tensor, a group of its own, another transport, or no
    room in ``/dev/shm``) goes through the backend.

    The safe pattern holds itself: each all-reduce first passes the link's check
    ([`EpLink.check_collective`][metrale_model_engine.EpLink.check_collective]),
    which refuses one that nothing declared (a worker's command not in
    ``ep_collective_commands``; the head's forward outside ``link.collective()``)
    and counts it, so that a declared forward that ran none is refused as well.

    It follows its link through a re-form ([`reform_link`][metrale_model_engine.reform.reform_link]): over the default
    group (``group=None``), its first all-reduce of a new epoch runs over the ranks left
    (a one-rank epoch: nothing); one built over a group of its own is refused there (build
    a new one in ``ep_reformed``).

    With one rank it does nothing and needs no process group.  Over a link on a
    pretend group ([`PretendGroup`][metrale_model_engine.transport.PretendGroup]: the
    doubles of [`metrale_model_engine.testing`][metrale_model_engine.testing], a scheduler's tests) it has one
    participant, this process: it needs no process group, and an all-reduce leaves
    the tensor as it is, after the link's checks.

    Args:
        link: this rank's link; the group's ranks must be the link's.
        group: the process group of the all-reduces; default the world group.
        timeout: seconds one all-reduce may wait (default
            [`DEFAULT_COLLECTIVE_TIMEOUT`][metrale_model_engine.torch.DEFAULT_COLLECTIVE_TIMEOUT], 5 minutes: far above
            any forward's skew, far below the group's idle timeout); ``None``: the group's own.

    Raises:
        TypeError, ValueError: ``timeout`` is not a positive number of seconds or
            ``None``; the group's rank or size is not the link's.
        RuntimeError: several ranks, and torch.distributed is not initialised.
    """

    __slots__ = ("_blocking", "_epoch", "_group", "_host_sum", "_link", "_options", "_seconds", "_solo", "_untried")

    def __init__(
        self,
        link: EpLink,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        seconds = check_seconds("timeout", timeout, allow_none=True)
        self._link = link
        self._seconds = seconds
        self._host_sum: HostSum | None = None
        self._options = dist.AllreduceOptions()  # a sum
        if seconds is not None:
            self._options.timeout = datetime.timedelta(seconds=seconds)
        # The world group is looked up at each call, not held: a gloo group still referenced when
        # the interpreter tears down can abort the process (see metrale_model_engine.torch).
        self._group = group
        self._follow()

    def _follow(self) -> None:
        """Take the link's epoch: its transport's waits, and whether its ranks are one (checked against the group)."""
        link, group = self._link, self._group
        if group is not None and getattr(self, "_epoch", link.epoch) != link.epoch:
            raise ValueError(
                f"this Collectives runs over a group of its own, which the link's re-form (epoch {link.epoch}) does "
                "not carry over: build a new Collectives(link, group) over the ranks left, in ep_reformed"
            )
        self._epoch = link.epoch
        self._solo = link.world_size == 1 or isinstance(link.transport, PretendGroup)
        self._blocking = waits_of(link.transport)
        if self._host_sum is not None:  # the last epoch's ranks
            self._host_sum.close()
            self._host_sum = None
        # Every rank of a ring is on its host: its CPU all-reduces go through shared memory, once formed over the
        # default group at the first of the epoch (every rank at the same call).
        self._untried = group is None and not self._solo and isinstance(link.transport, ShmTransport)
        if self._solo:
            return
        if not dist.is_initialized():
            raise RuntimeError(f"{link.world_size} ranks share the model, but torch.distributed is not initialised")
        ranks = (dist.get_rank(group), dist.get_world_size(group))
        if ranks != (link.rank, link.world_size):
            raise ValueError(
                f"group: this process is rank {ranks[0]} of {ranks[1]} there, but rank {link.rank} of "
                f"{link.world_size} on the link; the all-reduces must run over the link's ranks"
            )

    @property
    def link(self) -> EpLink:
        """The link whose run a failed collective stops."""
        return self._link

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place, on every rank (nothing with one participant).

        Raises:
            EpCommandRefused: on a worker, in a command that ``ep_collective_commands``
                does not declare (see the class).
            RunStopped: the all-reduce failed or timed out: a rank died, refused its
                command, stalls or skipped its forward (the message says what the
                link knows); on the head, it ran outside ``link.collective()`` after a
                command was sent; or the run had stopped already.
        """
        self._link.check_collective("an all-reduce")
        if self._epoch != self._link.epoch:  # the link re-formed over the ranks left
            self._follow()
        if self._solo:
            return
        try:  # the group in no local variable: a traceback kept by the caller must not keep it alive
            on_cpu = isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.layout == torch.strided
            if self._untried and on_cpu:
                self._untried = False
                self._host_sum = HostSum.form()
            if self._host_sum is not None and on_cpu:
                self._host_sum.all_reduce(tensor, deadline_after(self._seconds))
                return
            with self._blocking():
                (self._group if self._group is not None else _world()).allreduce([tensor], self._options).wait()
        except Exception as error:  # the backend's own (RuntimeError from gloo): a rank is gone or late
            raise self._link.collective_failed(error, what="an all-reduce") from error
