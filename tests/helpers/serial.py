"""The room of a parallel run (pytest-xdist): a test marked ``serial`` runs apart from the others, or alone.

A test that starts processes (the ``ranks`` and ``programs`` tiers) loads both cores
of this project's machine; an in-process test (``in_process/``: one thread, torch's
included) loads one at most.  So a serial test of the first two tiers runs **apart**:
no other test that starts processes runs meanwhile, but in-process tests may, on the
other worker; a serial in-process test, whose bounds are the tightest (a wake-up
within 10 ms), runs **alone**.

Every worker of a run opens the same three files and takes ``flock`` locks on them:
the quiet room, which every test shares and a test alone holds by itself; the busy
room, which the tests that start processes share and a test apart or alone holds by
itself; and a turnstile that each takes on its way in, so that a test waiting for a
room by itself keeps new tests out instead of waiting for a moment when none runs.
A worker keeps what it holds from one serial test to the next it runs, so that a
run's serial tests follow one another (``tests/conftest.py`` sends them all to one
worker, first, while the other runs the in-process tests).  A test may also take the
busy room by itself for a block of its own (``Room.alone``: the ``alone`` fixture), the
part a time bound measures, and run the rest beside the others.  A lock dies with its
process: a worker that crashes holds nothing.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

Alone = Callable[[], AbstractContextManager[None]]
"""The ``alone`` fixture's type (``tests/conftest.py``): ``with alone():`` runs its block apart in a parallel run."""


class Need(enum.Enum):
    """What a test needs of the room, as the ``flock`` operations it takes on (the quiet room, the busy room)."""

    QUIET = (fcntl.LOCK_SH, None)
    """An in-process test: beside any test but one alone."""
    BUSY = (fcntl.LOCK_SH, fcntl.LOCK_SH)
    """A test that starts processes: beside any test but one apart or alone."""
    APART = (fcntl.LOCK_SH, fcntl.LOCK_EX)
    """No other test that starts processes meanwhile; in-process tests may run."""
    ALONE = (fcntl.LOCK_EX, fcntl.LOCK_EX)
    """No other test meanwhile."""


class Room:
    """One worker's way into the run's room, whose lock files are in ``folder`` (made if missing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile, self._quiet, self._busy = (
            os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600) for name in ("turnstile", "quiet", "busy")
        )
        self._held: Need | None = None

    def enter(self, need: Need) -> None:
        """Wait until this worker's next test may run as ``need`` says; nothing to wait for where this worker holds
        that already (a serial test after a serial test)."""
        if self._held == need:
            return
        self.leave()  # nothing held while waiting at the turnstile: its holder may be waiting for this worker's locks
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            for lock, wanted in zip((self._quiet, self._busy), need.value, strict=True):
                if wanted is not None:
                    fcntl.flock(lock, wanted)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self._held = need

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The block apart (once every other test that starts processes has ended), then as before; nothing more
        where this worker holds the busy room already (a serial test)."""
        before = self._held
        if before in (Need.APART, Need.ALONE):
            yield
            return
        self.enter(Need.APART)
        try:
            yield
        finally:
            if before is None:
                self.leave()
            else:
                self.enter(before)

    def leave(self) -> None:
        """Let the others in (nothing when this worker holds nothing)."""
        if self._held is not None:
            fcntl.flock(self._busy, fcntl.LOCK_UN)
            fcntl.flock(self._quiet, fcntl.LOCK_UN)
            self._held = None

    def close(self) -> None:
        self.leave()
        for lock in (self._turnstile, self._quiet, self._busy):
            os.close(lock)
