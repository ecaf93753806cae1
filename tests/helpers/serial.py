"""The room of a parallel run (pytest-xdist): a test marked ``serial`` runs alone in it, the others together.

Every worker of a run opens the same two files and takes ``flock`` locks on them:
the room, shared by ordinary tests and held alone by a serial one, and a turnstile
that each takes on its way in, so that a serial test waiting for the room keeps new
ordinary tests out instead of waiting for a moment when none runs.  A worker keeps
the room alone from one serial test to the next it runs, so that a run's serial
tests follow one another (``tests/conftest.py`` sends them all to one worker, last).
A test may also take the room alone for a block of its own (``Room.alone``: the
``alone`` fixture), the part a time bound measures, and run the rest beside the others.
A lock dies with its process: a worker that crashes holds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

Alone = Callable[[], AbstractContextManager[None]]
"""The ``alone`` fixture's type (``tests/conftest.py``): ``with alone():`` runs its block alone in a parallel run."""


class Room:
    """One worker's way into the run's room, whose lock files are in ``folder`` (made if missing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = os.open(folder / "turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self._room = os.open(folder / "room", os.O_RDWR | os.O_CREAT, 0o600)
        self._held: int | None = None

    def enter(self, *, alone: bool) -> None:
        """Wait until this worker's next test may run: alone, or beside other ordinary tests."""
        wanted = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        if self._held == wanted:
            return
        self.leave()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._room, wanted)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self._held = wanted

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The block alone (once every other test running has ended), then beside the others again; nothing
        more where this worker is alone already (a serial test)."""
        if self._held == fcntl.LOCK_EX:
            yield
            return
        self.enter(alone=True)
        try:
            yield
        finally:
            self.enter(alone=False)

    def leave(self) -> None:
        """Let the others in (nothing when this worker holds nothing)."""
        if self._held is not None:
            fcntl.flock(self._room, fcntl.LOCK_UN)
            self._held = None

    def close(self) -> None:
        self.leave()
        os.close(self._turnstile)
        os.close(self._room)
