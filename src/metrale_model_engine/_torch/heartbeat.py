"""Liveness across hosts through the group's store: workers beat, the head reads who went silent.

The pidfds of the head's host cannot see a rank on another machine, and a cut
cable tells nobody: gloo's idle receive waits its whole timeout (days).  So every
worker of a [`TorchTransport`][metrale_model_engine.torch.TorchTransport] bumps a counter
in the group's ``TCPStore`` (torch's rendezvous store, served on the head's host
under ``torchrun`` and [`init_group_from_env`][metrale_model_engine.torch.init_group_from_env])
every ``period`` seconds, from a thread of its own with its own connection:

* the head (``watch``) names the workers whose counter stopped moving once a
  send or a sync point has failed without another explanation, and ends a wait
  on workers silent for ``lost_after`` seconds: they are lost;
* a worker that could not beat for ``lost_after`` seconds has lost the head's host
  (its cable, or the whole machine): it logs why and ends its process with
  [`HEAD_LOST_EXIT_CODE`][metrale_model_engine.torch.HEAD_LOST_EXIT_CODE], since its main thread sits in a receive that
  nothing can interrupt (NCCL's watchdog ends a process the same way).

One bound for both directions: ``lost_after``, the ``head_lost_after`` of
``open_link``.

The store must be a ``TCPStore`` (a file or hash store: no heartbeat).  Where the
rendezvous store runs elsewhere than the head's host (``--rdzv-endpoint``), the
workers watch that host instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Final

from torch._C._distributed_c10d import Store, TCPStore

from .._core.checks import check_seconds
from .severing import connect_to, sever_group_connections

DEFAULT_HEARTBEAT: Final[float] = 0.25
"""Seconds between two beats of a worker (a store round trip each: microseconds of the store's time)."""
DEFAULT_HEAD_LOST_AFTER: Final[float] = 60.0
"""Seconds a worker goes on without reaching the head's host before it ends its process, and the head waits on
workers whose heartbeat stopped before it stops the run: one bound, both ways."""
HEAD_LOST_EXIT_CODE: Final[int] = 75
"""The exit status of a worker that lost the head's host (``EX_TEMPFAIL``: try again)."""
RUN_OVER: Final[int] = 1 << 48
"""What the head adds to a worker's counter once it found other workers lost: the worker's next beat sees
it, and ends this process's waits on the group (the run is over; its own collectives then fail at once).
A later transport of the rank over a group of the same name (the next epoch of a re-formed link) counts
afresh: the earlier epoch's word is not taken for its own."""
SILENT_AFTER_BEATS: Final[int] = 4
"""Beats the head waits for, at most, before it calls a worker silent."""
_LOGGER = logging.getLogger("metrale_model_engine.torch")


def tcp_store(store: Store | None) -> TCPStore | None:
    """The ``TCPStore`` under ``store``'s prefixes, or ``None`` when it is another kind."""
    while store is not None and not isinstance(store, TCPStore):
        store = getattr(store, "underlying_store", None)
    return store


def beat_key(group_name: str, rank: int) -> str:
    """The counter of worker ``rank`` of the group named ``group_name``; ``<key>/left``: it closed its transport."""
    return f"metrale_model_engine/heartbeat/{group_name}/{rank}"


class Heartbeat:
    """A worker's beat: two daemon threads, one that bumps its counter, one that watches the beats succeed.

    Start it with ``start``; ``stop`` ends both threads (idempotent).
    """

    __slots__ = ("_beating", "_last", "_period", "_stopped")

    def __init__(self, period: float) -> None:
        self._period = period
        self._stopped = threading.Event()
        self._last = time.monotonic()  # the last beat that reached the store
        self._beating: threading.Thread | None = None

    @classmethod
    def start(
        cls, group_name: str, store: Store | None, rank: int, period: float, lost_after: float | None
    ) -> Heartbeat | None:
        """Beat for worker ``rank`` of group ``group_name`` every ``period`` seconds; ``None`` without a ``TCPStore``.

        ``lost_after``: seconds without a beat before the process ends (``None``: never).
        """
        tcp = tcp_store(store)
        if tcp is None:
            return None
        key = beat_key(group_name, rank)
        try:  # a connection of its own: a beat that hangs on a cut cable holds nobody else's
            own = connect_to(tcp)
        except Exception as error:  # noqa: BLE001  (liveness is an aid: the link works without it)
            _LOGGER.warning("worker rank %d: no heartbeat, the store did not take a connection: %s", rank, error)
            try:  # the head must not take a rank that never beats for a silent one
                tcp.set(f"{key}/left", "1")
            except Exception as cause:  # noqa: BLE001
                _LOGGER.debug("could not say so in the store: %s", cause)
            return None
        beat = cls(period)
        try:  # what an earlier transport of this rank over a group of this name left: this one has not left, and
            # the run over there (RUN_OVER, added by the head of a re-formed link's earlier epoch) is not this one's:
            # the counter is set back, never deleted (a key listed, then gone, costs a severing's read a second)
            own.delete_key(f"{key}/left")
            own.set(key, "0")
        except Exception as error:  # noqa: BLE001  (a store without deletion: a stale word stays)
            _LOGGER.debug("could not clear the heartbeat's earlier last word: %s", error)
        beat._beating = threading.Thread(target=beat._beat, args=(own, key, rank), name=f"heartbeat {key}", daemon=True)
        beat._beating.start()
        if lost_after is not None:
            where = f"{tcp.host}:{tcp.port}"
            threading.Thread(target=beat._watch, args=(rank, where, lost_after), daemon=True).start()
        return beat

    def stop(self) -> None:
        """End both threads; the beat says in the store that this worker left (waits a beat for it, at most)."""
        self._stopped.set()
        if self._beating is not None:
            self._beating.join(2 * self._period)  # a store that does not answer: leave without the word
            self._beating = None

    def _beat(self, store: TCPStore, key: str, rank: int) -> None:
        told = False
        while not self._stopped.is_set():
            try:
                over = store.add(key, 1) >= RUN_OVER
                self._last = time.monotonic()
            except Exception as error:  # noqa: BLE001  (the watch decides when it is too long)
                _LOGGER.debug("a heartbeat failed: %s", error)
                over = False
            if over and not told:  # it goes on beating: it is not lost, its run is over
                told = True
                _LOGGER.warning("worker rank %d: the head found workers lost; its waits on the group end", rank)
                sever_group_connections(store)
            self._stopped.wait(self._period)
        try:  # a worker that left is not silent: the head names only those that could not say so
            store.set(f"{key}/left", "1")
        except Exception as error:  # noqa: BLE001
            _LOGGER.debug("could not leave the heartbeat's last word: %s", error)

    def _watch(self, rank: int, where: str, lost_after: float) -> None:
        # Wakes once per lost_after while beats arrive: it sleeps until the last beat is that old.
        while not self._stopped.wait(max(self._last + lost_after - time.monotonic(), 0.0)):
            if time.monotonic() - self._last < lost_after:
                continue
            if self._stopped.wait(2 * self._period) or time.monotonic() - self._last < lost_after:
                continue  # a beat came: this process was paused (a debugger, a suspended VM), not cut off
            quiet = time.monotonic() - self._last
            exit_anyway = threading.Timer(1.0, os._exit, (HEAD_LOST_EXIT_CODE,))
            exit_anyway.daemon = True
            exit_anyway.start()  # a stderr that blocks (its pipe over the lost link) must not keep it alive
            _LOGGER.critical(
                "worker rank %d: the head is lost: no answer from the group's store at %s for %.1f s "
                "(a cut link, the head's machine gone, or the head exited); ending this process with status %d",
                rank,
                where,
                quiet,
                HEAD_LOST_EXIT_CODE,
            )
            logging.shutdown()
            os._exit(HEAD_LOST_EXIT_CODE)


def checked_liveness(heartbeat: object, head_lost_after: object) -> tuple[float | None, float | None]:
    """``(heartbeat, head_lost_after)`` of ``TorchTransport``, checked: seconds or ``None``, the bound at
    least 4 beats (the head's wait before it calls a worker silent).

    Raises:
        TypeError, ValueError: either is not a positive number of seconds or ``None``,
            or ``head_lost_after`` is shorter than those beats.
    """
    period = check_seconds("heartbeat", heartbeat, allow_none=True)
    lost_after = check_seconds("head_lost_after", head_lost_after, allow_none=True)
    if period is not None and lost_after is not None and lost_after < SILENT_AFTER_BEATS * period:
        raise ValueError(
            f"head_lost_after={head_lost_after} must be at least {SILENT_AFTER_BEATS} heartbeats "
            f"({SILENT_AFTER_BEATS} x heartbeat={heartbeat} = {SILENT_AFTER_BEATS * period:g} s)"
        )
    return period, lost_after
