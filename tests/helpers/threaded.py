"""The ranks of a sharded model run in threads of this process, their all-reduce a sum through a barrier: a group
without processes, for the in-process tier (needs torch).

Every rank adds the partials in rank order, so each gets the same sums bit for bit, as
over a real group.  A rank that fails breaks the barrier: the others stop waiting, and
``ThreadGroup.run`` raises its failure (not theirs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from metrale_model_engine.reference import AllReduce

T = TypeVar("T")


class ThreadGroup:
    """``size`` ranks in threads: ``all_reduce(rank)`` is rank ``rank``'s sum over the group, ``run`` runs them."""

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._parts: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, rank: int) -> AllReduce:
        """Rank ``rank``'s in-place sum over the group."""

        def reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._barrier.wait()  # every partial is in
            total = self._parts[0]
            assert total is not None
            for part in self._parts[1:]:
                assert part is not None
                total = total + part
            self._barrier.wait()  # every rank has read them: the next call may replace them
            tensor.copy_(total)

        return reduce

    def run(self, work: Callable[[int], T]) -> list[T]:
        """``work(rank)`` for every rank, each in its own thread; the results in rank order."""

        def guarded(rank: int) -> T:
            try:
                return work(rank)
            except BaseException:
                self._barrier.abort()
                raise

        with ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(guarded, rank) for rank in range(self.size)]
        failures = [future.exception() for future in futures]
        causes = [
            error for error in failures if error is not None and not isinstance(error, threading.BrokenBarrierError)
        ]
        if causes:
            raise causes[0]
        return [future.result() for future in futures]
