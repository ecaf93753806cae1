"""The all-reduce a served model's forward calls: ``ServedAllReduce``, bounded and counted, and a failure of it
stopping the run on every rank (docs/errors.md, 'Failures inside a forward'); and the device a rank's group wants."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ... import EpLink, RunStopped
from ...torch import EXIT_GRACE, Collectives
from ..network.layers import AllReduce
from .timing import TimeSpent


class ServedAllReduce:
    """The in-place sum over the ranks that rank ``link.rank``'s forward calls, its time added to
    ``spent.collectives_s``.

    By default [`Collectives.all_reduce`][metrale_model_engine.torch.Collectives.all_reduce] over ``group``, with
    ``timeout`` (built at one rank too: it checks its arguments, and does nothing).  An ``all_reduce`` passed in
    (tests pass their own to run ranks without a group) is checked and counted as ``Collectives``' are, and a
    failure of it stops the run as a failed collective does.

    Raises:
        ValueError: ``group`` is not the link's group (see ``Collectives``).
        RuntimeError: several ranks, no ``all_reduce``, and torch.distributed is not initialised.
    """

    def __init__(
        self,
        link: EpLink,
        spent: TimeSpent,
        *,
        group: dist.ProcessGroup | None,
        all_reduce: AllReduce | None,
        timeout: float | None,
    ) -> None:
        self._link = link
        self._spent = spent
        self._passed = all_reduce is not None  # Collectives checks and counts its own
        if all_reduce is None:
            all_reduce = Collectives(link, group, timeout=timeout).all_reduce
        self._reduce: AllReduce = all_reduce

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the ranks.

        Raises:
            RunStopped: the all-reduce failed, here or on another rank: the run is over.
        """
        started = time.perf_counter()
        if self._passed:
            self._link.check_collective("an all-reduce")
        try:
            self._reduce(tensor)
        except RunStopped:
            raise
        except Exception as error:  # an all_reduce passed in that failed: a collective's failure all the same
            raise self._link.collective_failed(error, what="an all-reduce", grace=EXIT_GRACE) from error
        self._spent.collectives_s += time.perf_counter() - started


def group_device(world_size: int, group: dist.ProcessGroup | None) -> torch.device | None:
    """Where a rank's tensors go when no device is asked for: its current CUDA device when several ranks reduce over
    NCCL (``group``, default the world group), else ``None`` (torch's default)."""
    if world_size > 1 and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None
