"""The room of a parallel run (pytest-xdist): a test marked ``serial`` runs apart from the others, or alone, and a
test marked ``light`` rides beside the others.

A test that starts processes (the ``ranks`` and ``programs`` tiers) loads both cores
of this project's machine; an in-process test (``in_process/``: one thread, torch's
included) loads one at most.  However many workers a run has, at most :data:`LOADS`
tests that load the machine run at once (a ``-n 2`` run's worst case: two that start
processes), as a test takes one of the run's load slots.  A ``light`` test starts
processes but mostly waits (a timeout, a bound of seconds): it takes no slot, so a
run's third worker runs it beside two loads.  A serial test of the first two tiers
runs **apart**: no other test that starts processes runs meanwhile, but one in-process
test may, and light tests may; a serial in-process test, whose bounds are the
tightest (a wake-up within 10 ms), runs **alone**.

Every worker of a run opens the same files and takes ``flock`` locks on them: the
quiet room, which every test shares and a test alone holds by itself; the busy room,
which the tests that start processes share and a test apart or alone holds by
itself; the load slots, each held by one test; and a turnstile that each takes on its
way in, so that a test waiting for a room by itself keeps new tests out instead of
waiting for a moment when none runs.  Any other test takes its rooms at the turnstile
only if they are free, and otherwise waits outside, holding nothing, so that it keeps
out none of the tests behind it (a light test, while a test apart runs).  A
worker keeps what it holds from one serial test to the next it runs (the busy room
from a test apart to a test alone), so that a run's serial tests follow one another
(``tests/conftest.py`` sends them all to one worker, first, while the others run the
light and the in-process tests).  A test may also take the busy room by itself for a
block of its own (``Room.alone``: the ``alone`` fixture), the part a time bound
measures, and run the rest beside the others.  A lock dies with its process: a worker
that crashes holds nothing.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

Alone = Callable[[], AbstractContextManager[None]]
"""The ``alone`` fixture's type (``tests/conftest.py``): ``with alone():`` runs its block apart in a parallel run."""

LOADS = 2
"""Tests that load the machine at once, at most: the cores of this project's machine, and a 2-worker run's worst
case."""
SLOT_POLL_S = 0.005
"""Seconds between two looks for a free load slot, while every one is held."""


class Need(enum.Enum):
    """What a test needs of the room: the ``flock`` operations it takes on the quiet and the busy room, and whether
    it takes a load slot."""

    QUIET = (fcntl.LOCK_SH, None, True)
    """An in-process test: beside any test but one alone, a load."""
    LIGHT = (fcntl.LOCK_SH, None, False)
    """A test that starts processes but mostly waits: beside any test but one alone, no load."""
    BUSY = (fcntl.LOCK_SH, fcntl.LOCK_SH, True)
    """A test that starts processes: beside any test but one apart or alone, a load."""
    APART = (fcntl.LOCK_SH, fcntl.LOCK_EX, True)
    """No other test that starts processes meanwhile, but for light ones; an in-process test may run, in the other
    load slot."""
    ALONE = (fcntl.LOCK_EX, fcntl.LOCK_EX, False)
    """No other test meanwhile (no slot to take: nobody else is in)."""


class Room:
    """One worker's way into the run's room, whose lock files are in ``folder`` (made if missing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile, self._quiet, self._busy, *self._slots = (
            os.open(folder / name, os.O_RDWR | os.O_CREAT, 0o600)
            for name in ("turnstile", "quiet", "busy", *(f"load-{slot}" for slot in range(LOADS)))
        )
        self._held: Need | None = None
        self._slot: int | None = None

    def enter(self, need: Need) -> None:
        """Wait until this worker's next test may run as ``need`` says; nothing to wait for where this worker holds
        that already (a serial test after a serial test).

        A test apart or alone waits at the turnstile, keeping newcomers out; any other takes its rooms there only
        if they are free, and otherwise waits outside, holding nothing, so that the tests behind it that need
        neither (a light test beside a test apart) go in meanwhile.  A load slot is waited for at the turnstile.
        A test apart that becomes a test alone keeps the busy room throughout.
        """
        if self._held == need:
            return
        if self._held == Need.APART and need == Need.ALONE:
            self._alone_from_apart()
            return
        self.leave()  # nothing held while waiting at the turnstile: its holder may be waiting for this worker's locks
        quiet, busy, loads = need.value
        exclusive = fcntl.LOCK_EX in (quiet, busy)
        while True:
            fcntl.flock(self._turnstile, fcntl.LOCK_EX)
            try:
                blocked = self._take(quiet, busy, loads, wait=exclusive)
            finally:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            if blocked is None:
                self._held = need
                return
            fcntl.flock(blocked, fcntl.LOCK_SH)  # until the test apart or alone that holds that room leaves
            fcntl.flock(blocked, fcntl.LOCK_UN)

    def _take(self, quiet: int, busy: int | None, loads: bool, *, wait: bool) -> int | None:
        """At the turnstile: the quiet room and the busy room as ``need`` says, waiting for each where ``wait``,
        else each only if it is free; then a load slot, waited for (the first freed goes to the test at the
        turnstile, not to the one that freed it).  ``None`` once all are held; else, nothing held, the room that
        was not free."""
        nowait = 0 if wait else fcntl.LOCK_NB
        for lock, operation in ((self._quiet, quiet), (self._busy, busy)):
            if operation is None:
                continue
            try:
                fcntl.flock(lock, operation | nowait)
            except BlockingIOError:
                self._release()
                return lock
        if loads:
            self._slot = self._take_a_slot()
        return None

    def _take_a_slot(self) -> int:
        """A free load slot, taken: looked for again every ``SLOT_POLL_S`` while the others hold every one."""
        while True:
            for slot, lock in enumerate(self._slots):
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                return slot
            time.sleep(SLOT_POLL_S)

    def _alone_from_apart(self) -> None:
        """From a test apart to a test alone, the busy room kept, so that no test that starts processes slips in
        between: once the tests in the quiet room (in-process and light ones) have ended.  Not at the turnstile,
        where a test that waits to run apart may stand, waiting for this worker's busy room."""
        self._release_slot()
        fcntl.flock(self._quiet, fcntl.LOCK_EX)
        self._held = Need.ALONE

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
            self._release()
            self._held = None

    def _release(self) -> None:
        self._release_slot()
        fcntl.flock(self._busy, fcntl.LOCK_UN)
        fcntl.flock(self._quiet, fcntl.LOCK_UN)

    def _release_slot(self) -> None:
        if self._slot is not None:
            fcntl.flock(self._slots[self._slot], fcntl.LOCK_UN)
            self._slot = None

    def close(self) -> None:
        self.leave()
        for lock in (self._turnstile, self._quiet, self._busy, *self._slots):
            os.close(lock)
