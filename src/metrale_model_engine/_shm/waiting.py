"""Waiting on shared memory: spin for a while, then sleep in the kernel, with a deadline and peer checks.

The rule: shared memory is the only source of truth, a wake-up is only a hint, and
every wait has a deadline.  A waiting rank spins first (yielding the core between
short bursts of looking), because a kernel wake-up costs a quarter to half a
millisecond; then it sets its parked flag, looks once more, and sleeps on a futex
word with the value it saw, capped at [`CHECK_INTERVAL`][metrale_model_engine.shm.CHECK_INTERVAL].  The other side
publishes, passes a full barrier, and wakes the word only when a parked flag is
set: either it sees the flag, or the sleeper's kernel call sees the new value and
returns at once.  No wake-up is lost.

How long to spin is learned (``SpinBudget``): a worker that sees a message
every few milliseconds (a server's step cadence) keeps spinning across the gap, so
the first message of a step costs what a back-to-back one does; a worker that has
had nothing for longer than the ceiling sleeps after the floor, at a fraction of a
percent of a core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final

from . import futex
from .segment import Segment

CHECK_INTERVAL: Final[float] = 0.05
"""Seconds between a waiting rank's checks of its peers, and the cap on every sleep."""
DEFAULT_SPIN_TIME: Final[float] = 0.001
"""Seconds a waiting rank spins, at least, before it sleeps in the kernel."""
DEFAULT_MAX_SPIN_TIME: Final[float] = 0.05
"""Seconds a waiting worker spins at most: when the gaps between its messages call for it."""

_SPIN_BURST: Final[range] = range(16)
"""Looks between two yields of the core while spinning."""
_DECAY: Final[float] = 0.9
"""How much of the longest recent gap a message with no wait keeps (per message)."""


class SpinBudget:
    """How long a waiting worker spins before sleeping: twice the longest recent gap, within bounds.

    ``observe`` takes how long each receive waited.  A gap longer than the
    ceiling means the head went idle: the budget falls back to the floor (a cold
    worker costs almost nothing).  Shorter gaps raise it to twice the longest
    recent one, capped at the ceiling, so that a cadence of up to half the ceiling
    is met spinning; the memory of a gap decays by ``_DECAY`` per message.
    """

    __slots__ = ("_ceiling", "_floor", "_peak")

    def __init__(self, floor: float, ceiling: float) -> None:
        self._floor = floor
        self._ceiling = max(floor, ceiling)
        self._peak = 0.0

    def spin_time(self) -> float:
        """Seconds to spin in the next wait."""
        return min(self._ceiling, max(self._floor, 2.0 * self._peak))

    def observe(self, waited: float) -> None:
        """Learn from one receive that waited ``waited`` seconds for its message (0: it was there)."""
        self._peak = 0.0 if waited > self._ceiling else max(waited, self._peak * _DECAY)


def wait_until(
    ready: Callable[[], bool],
    *,
    segment: Segment,
    park_word: Callable[[], int],
    parked_flag: int | None,
    deadline: float | None,
    check: Callable[[], None],
    spin: float,
) -> None:
    """Return once ``ready()``; spin for ``spin`` seconds, then sleep on the u32 at ``park_word()``.

    ``parked_flag`` is the byte of ``segment`` that tells the other side to wake this
    rank (``None``: the other side always wakes).  ``check()`` runs at least every
    [`CHECK_INTERVAL`][metrale_model_engine.shm.CHECK_INTERVAL] and raises for a dead or gone peer.

    Raises:
        TimeoutError: ``deadline`` (a ``time.monotonic()`` value; ``None``: none) passed.
    """
    started = time.monotonic()
    spin_until, next_check = started + spin, started + CHECK_INTERVAL
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + CHECK_INTERVAL
        if deadline is not None and now >= deadline:
            if ready():
                return
            raise TimeoutError
        if now < spin_until:
            for _ in _SPIN_BURST:  # a few microseconds of looking, then the core for others
                if ready():
                    return
            os.sched_yield()
            continue
        word = park_word()
        if parked_flag is not None:
            segment.bytes[parked_flag] = 1
        seen = segment.u32[word // 4]
        try:
            if not ready():
                nap = CHECK_INTERVAL if deadline is None else min(CHECK_INTERVAL, deadline - now)
                futex.futex_wait(segment.address + word, seen, max(nap, 1e-6))
        finally:
            if parked_flag is not None:
                segment.bytes[parked_flag] = 0


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic deadline of a wait of ``timeout`` seconds; 0, negative and NaN mean "now"."""
    if timeout is None:
        return None
    return time.monotonic() + (timeout if timeout > 0 else 0.0)
