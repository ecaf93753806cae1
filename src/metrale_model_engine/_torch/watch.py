"""The head's watch of its workers' heartbeats: which went silent, and when a wait must end because they are lost.

Every worker of a [`TorchTransport`][metrale_model_engine.torch.TorchTransport] bumps a counter
in the group's store (``heartbeat``).  On the head, ``HeadWatch`` reads
every counter once a beat, from a thread with its own connection, and keeps when
each last moved:

* ``HeadWatch.silent`` names the workers whose counter stopped (a failed send or
  sync point asks), at once for one silent for four beats already;
* while the head waits on its group (``HeadWatch.blocking``: a send, a sync
  point, an all-reduce of ``Collectives``), workers silent for ``lost_after`` seconds
  are *lost*: the same bound after which a worker cut off from the head ends its
  own process.  The watch then ends the head's wait, every later call of the link
  names them (``HeadWatch.lost``), and the workers still in touch end theirs
  (``RUN_OVER``).

How a wait of gloo's is ended from another thread: ``severing``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from torch._C._distributed_c10d import TCPStore

from .heartbeat import RUN_OVER, SILENT_AFTER_BEATS, beat_key
from .severing import connect_to, sever_group_connections

_LOGGER = logging.getLogger("metrale_model_engine.torch")
_TOLD_GRACE: Final = 0.5
"""Seconds past two beats the watch waits for the workers still here to read that the run is over."""


class HeadWatch:
    """The head's reading of its workers' beats, from a daemon thread of its own (see the module).

    Args:
        group_name: the group whose workers beat.
        store: a connection of the watch's own to the group's store.
        ranks: the worker ranks.
        period: seconds between two beats, and two readings.
        lost_after: seconds of silence, while the head waits, after which workers
            are lost (``None``: never); the first one past it names, with it, every
            worker silent for four beats by then.
    """

    __slots__ = (
        "_blocked",
        "_lost",
        "_lost_after",
        "_period",
        "_ranks",
        "_read_at",
        "_seen",
        "_stopped",
        "_store",
        "_thread",
        "_told",
    )

    def __init__(
        self, group_name: str, store: TCPStore, ranks: Sequence[int], period: float, lost_after: float | None
    ) -> None:
        self._store = store
        self._ranks = {rank: beat_key(group_name, rank) for rank in ranks}
        self._period = period
        self._lost_after = lost_after
        started = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {rank: (-1, started) for rank in ranks}  # counter, when it moved
        self._read_at = started  # the last reading of every counter
        self._blocked = 0  # waits of the head in progress
        self._lost: dict[int, float] = {}
        self._stopped = threading.Event()
        self._told = threading.Event()  # the workers still here were told that the run is over
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, group_name: str, store: TCPStore, ranks: Sequence[int], period: float, lost_after: float | None
    ) -> HeadWatch | None:
        """Watch ``ranks`` of group ``group_name`` in ``store``'s server; ``None`` when it takes no connection."""
        try:
            own = connect_to(store)
        except Exception as error:  # noqa: BLE001  (liveness is an aid: the link works without it)
            _LOGGER.warning("head: no watch of the workers' heartbeats, the store took no connection: %s", error)
            return None
        watch = cls(group_name, own, ranks, period, lost_after)
        watch._thread = threading.Thread(target=watch._run, name=f"heartbeat watch {group_name}", daemon=True)
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """End the thread; waits a reading for it, at most (a store that does not answer: it is left).  Idempotent.

        Once workers were found lost, it first waits (a couple of beats at most) for
        the workers still here to have read that the run is over.
        """
        if self._lost:
            self._told.wait(3 * self._period + _TOLD_GRACE)
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(2 * self._period)
            self._thread = None

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """The head waits on its group while the block runs: workers silent for ``lost_after`` are lost then."""
        self._blocked += 1
        try:
            yield
        finally:
            self._blocked -= 1

    def lost(self) -> dict[int, float]:
        """The workers found lost, each with the seconds it had been silent then; empty while none is."""
        return dict(self._lost)

    def silent(self, ranks: Sequence[int]) -> list[int]:
        """The ``ranks`` whose counter has not moved for ``SILENT_AFTER_BEATS`` beats, as the readings show.

        Waits only for a rank whose counter moved less than that long ago: until it
        moves again (it lives) or the readings show it still for that long (it went
        silent), so a few beats at most.  A worker that closed its transport (it
        left the run) is not silent; nor is one the readings cannot tell of (the
        store does not answer).
        """
        asked = time.monotonic()
        window = SILENT_AFTER_BEATS * self._period
        deadline = asked + window + 4 * self._period
        while True:
            read_at = self._read_at
            quiet, pending = [], False
            for rank in ranks:
                value, moved = self._seen.get(rank, (_LEFT, asked))
                if value == _LEFT or moved > asked:
                    continue
                if read_at - moved >= window:
                    quiet.append(rank)
                else:
                    pending = True
            if not pending or time.monotonic() >= deadline or self._stopped.is_set():
                return quiet
            time.sleep(self._period / 2)

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._read()
            except Exception as error:  # noqa: BLE001  (a store that does not answer: the next reading may)
                _LOGGER.debug("head: reading the heartbeats failed: %s", error)
                continue
            if self._blocked and self._lost_after is not None and not self._lost:
                now = time.monotonic()
                silence = {rank: now - moved for rank, (value, moved) in self._seen.items() if value != _LEFT}
                if any(seconds >= self._lost_after for seconds in silence.values()):
                    # with the first past the bound, every rank already silent (a host's ranks fall silent
                    # together, their last beats a reading apart): one stop names them all
                    window = min(SILENT_AFTER_BEATS * self._period, self._lost_after)
                    lost = {rank: seconds for rank, seconds in silence.items() if seconds >= window}
                    self._lost = lost
                    _LOGGER.warning("head: worker rank(s) %s are lost: their heartbeats stopped", sorted(lost))
                    self._end_the_run(lost)

    def _end_the_run(self, lost: dict[int, float]) -> None:
        """End every wait on the group: this process's, and, by their counters, those of the workers still here.

        Then wait, a couple of beats at most, for each told worker to beat once more
        (it has read it) or leave: the store may end with the head's process
        (``stop`` waits for this).
        """
        told: dict[str, int] = {}
        for rank, key in self._ranks.items():
            if rank not in lost and self._seen[rank][0] != _LEFT:
                try:
                    told[key] = self._store.add(key, RUN_OVER)
                except Exception as error:  # noqa: BLE001  (the worker ends with the head's process, later)
                    _LOGGER.debug("could not tell worker rank %d that the run is over: %s", rank, error)
        sever_group_connections(self._store)
        deadline = time.monotonic() + 2 * self._period + _TOLD_GRACE
        try:
            while told and time.monotonic() < deadline:
                told = {
                    key: mark
                    for key, mark in told.items()
                    if self._store.add(key, 0) == mark and not self._store.check([f"{key}/left"])
                }
                time.sleep(self._period / 4)
        finally:
            self._told.set()

    def _read(self) -> None:
        """Read every counter; a worker that left is marked so."""
        now = time.monotonic()
        store = self._store
        for rank, key in self._ranks.items():
            value = self._seen[rank][0]
            if value == _LEFT:
                continue
            if store.check([f"{key}/left"]):
                self._seen[rank] = (_LEFT, now)
                continue
            counter = store.add(key, 0)
            if counter != value:  # the first reading dates a counter from the watch's start
                self._seen[rank] = (counter, self._seen[rank][1] if value == -1 else time.monotonic())
        self._read_at = now


_LEFT: Final = -2
"""The counter a worker that closed its transport is kept at: it left, it is not silent."""
