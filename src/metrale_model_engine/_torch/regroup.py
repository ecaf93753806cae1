"""``GroupRegroup``: the ranks of a torch.distributed group that lost some meet again in the group's store.

Once workers are lost, every rank ends its waits on the old group as a peer's death
would (``severing``: a survivor blocked on another survivor, itself blocked, is
freed too).  Each worker checks in under the next epoch's key, naming the ranks of
its host it saw end; the head waits until every rank not known gone checked in, or
fell silent (its heartbeat still for four beats), or the bound passed, then writes
the members.  Every member then leaves the old default group and joins a new one,
renumbered in rank order, through the same store under the epoch's prefix (gloo has
no ``shrink_group``, which is NCCL's), and makes its transport over it as it did at
first (``make``: shared memory on one host, the leaders chosen again across hosts).
The new group's rendezvous is bounded by the re-form's; its collectives then wait
as the old group's did.  Keys, under the channel's namespace: ``<epoch>/in/<rank>``
(``here``, with ``<rank>=<how>`` for each rank seen gone, or ``leave`` and why),
``<epoch>/members`` (``0,1,3``, or ``end``), ``<epoch>/world/`` (the new group).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from .._core.reform import Regroup
from .._core.transport import EpTransport, PeerLost, SoloTransport, TransportTimeout
from .heartbeat import SILENT_AFTER_BEATS, beat_key, tcp_store
from .hosts import HostsTransport
from .severing import sever_group_connections
from .transport import TorchTransport

_LOOK_PAUSE: Final = 0.002
"""Seconds between two looks of the head at the check-ins."""
_ENDED: Final = "end"
_LOGGER = logging.getLogger("metrale_model_engine.torch")

Beats = tuple[Store, str, float]
"""Where the workers of the epoch beat: the group's store, the group's name, the period in seconds."""


def beats_of(transport: EpTransport, period: float | None) -> Beats | None:
    """Where the workers of ``transport`` (over the default group) beat every ``period`` seconds; ``None`` where
    they do not (a ring on one host, heartbeats off, a group store other than a ``TCPStore``).

    The store is the ``TCPStore`` under the group store's prefixes, where each worker's ``Heartbeat`` beats (read
    through the prefixes, no counter would move and no ``left`` show: a live worker slow to check in for an epoch
    would be named silent).
    """
    world = dist.group.WORLD
    if period is None or world is None or not isinstance(transport, (TorchTransport, HostsTransport)):
        return None
    store = tcp_store(world.get_group_store())
    return None if store is None else (store, world.group_name, period)


class GroupRegroup:
    """The re-form channel of a torch.distributed default group (a [`Regroup`][metrale_model_engine.transport.Regroup]).

    See the module.  Built by ``open_link`` for the transport it chose.

    Args:
        store: the group's ``TCPStore`` (every rank's connection to it).
        namespace: this link's keys in it (the same on every rank).
        rank: this process's rank in the epoch.
        period: seconds between two beats of a worker of a transport that beats (``None``: heartbeats off).
        beats: where the epoch's workers beat (``beats_of``).
        make: this rank's end of the next epoch's transport, over the new default group (collective).
        backend: the group's backend (``"gloo"``, ``"nccl"``).
        device_id: the device the group was bound to, if any.
        idle_timeout: how long the new group's collectives wait (the old group's timeout).
    """

    __slots__ = (
        "_backend",
        "_beats",
        "_device_id",
        "_epoch",
        "_idle",
        "_make",
        "_namespace",
        "_period",
        "_rank",
        "_store",
        "_tried",
    )

    def __init__(
        self,
        store: TCPStore,
        namespace: str,
        rank: int,
        period: float | None,
        beats: Beats | None,
        make: Callable[[], EpTransport],
        backend: str,
        device_id: torch.device | None,
        idle_timeout: datetime.timedelta,
    ) -> None:
        self._store, self._namespace, self._rank = store, namespace, rank
        self._period, self._beats = period, beats
        self._make, self._backend, self._device_id, self._idle = make, backend, device_id, idle_timeout
        self._epoch = 0  # the epoch of the group now
        self._tried = 0  # the latest epoch tried

    def wake(self) -> None:
        """End this process's waits on the group now at once (the old one, or that of an epoch that failed to form
        here), as a peer's death would (``severing``)."""
        sever_group_connections(self._store)

    def survivors(
        self, epoch: int, candidates: Sequence[int], lost: dict[int, str], gone: Callable[[], Mapping[int, str]],
        deadline: float,
    ) -> list[int]:  # fmt: skip
        """Head: the ``candidates`` that checked in for ``epoch``; waits for each until it did, or is gone, or the
        ``deadline`` passed."""
        self._tried = max(self._tried, epoch)
        here: set[int] = set()
        silence = _Silence(self._beats)
        while True:
            for rank, how in gone().items():
                if rank in candidates and rank:
                    lost.setdefault(rank, how)
            for rank in candidates:
                if rank and rank not in here and rank not in lost:
                    self._read_check_in(epoch, rank, candidates, here, lost)
            awaited = [rank for rank in candidates if rank and rank not in here and rank not in lost]
            for rank, seconds in silence.silent(awaited).items():
                lost[rank] = f"fell silent: no heartbeat for {seconds:.1f} s (its host is unreachable, or it died)"
            awaited = [rank for rank in awaited if rank not in lost]
            if not awaited:
                return [rank for rank in candidates if rank == 0 or rank in here]
            if time.monotonic() >= deadline:
                for rank in awaited:
                    lost[rank] = f"did not join epoch {epoch} of the link in time"
                return [rank for rank in candidates if rank == 0 or rank in here]
            time.sleep(_LOOK_PAUSE)

    def _read_check_in(
        self, epoch: int, rank: int, candidates: Sequence[int], here: set[int], lost: dict[int, str]
    ) -> None:
        """Head: worker ``rank``'s check-in for ``epoch``, if it came: it is here (or leaves), and whom it saw gone."""
        key = self._key(epoch, f"in/{rank}")
        if not self._store.check([key]):
            return
        word, _, rest = self._store.get(key).decode().partition(":")
        if word == "leave":
            lost[rank] = f"left the run: {rest}"
            return
        here.add(rank)
        for seen in filter(None, rest.split(";")):
            other, _, how = seen.partition("=")
            if int(other) in candidates and int(other):
                lost.setdefault(int(other), f"{how} (seen by worker rank {rank}, on its host)")

    def form(self, epoch: int, members: Sequence[int], deadline: float) -> EpTransport:
        """Head: the members written under the epoch's key; the new default group joined; the transport made."""
        self._tried = max(self._tried, epoch)
        self._store.set(self._key(epoch, "members"), ",".join(map(str, members)))
        return self._transport(epoch, members, 0, deadline)

    def abandon(self, transport: EpTransport) -> None:
        """Head: the epoch failed to form: its transport closed and its group's connections shut down, as the death
        of the head would (a survivor still waiting on the head in the epoch's setup agreement goes on to check in for
        the next epoch, instead of waiting out the re-form's bound); the next epoch leaves its group."""
        transport.close()
        sever_group_connections(self._store)

    def join(
        self, epoch: int, rank: int, gone: Callable[[], Mapping[int, str]], deadline: float
    ) -> tuple[int, list[int]]:
        """Worker: check in for ``epoch`` (naming its host's ranks seen gone), then wait for its members."""
        seen = ";".join(f"{other}={how}" for other, how in sorted(gone().items()))
        self._store.set(self._key(epoch, f"in/{rank}"), f"here:{seen}")
        key = self._key(epoch, "members")
        try:
            self._store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            members = self._store.get(key).decode()
        except Exception as error:  # the store's own: a timeout, or its server (the head's process) gone
            if "timeout" in str(error).lower():
                none = f"no re-form of the link came from the head by its bound (epoch {epoch})"
                raise TransportTimeout(none) from None
            raise PeerLost(f"the group's store does not answer (the head is gone?): {error}") from error
        return epoch, [] if members == _ENDED else [int(member) for member in members.split(",")]

    def attach(self, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        """Worker: the new default group joined at this rank's place among ``members``; the transport made."""
        self._tried = max(self._tried, epoch)
        return self._transport(epoch, members, members.index(rank), deadline)

    def leave(self, rank: int, why: str) -> None:
        """Worker ``rank`` leaves: its word under the next epoch's key, so that the head does not wait for it."""
        self._store.set(self._key(self._epoch + 1, f"in/{rank}"), f"leave:{why}")

    def end(self) -> None:
        """Head: every epoch a worker may wait for says that none comes."""
        for epoch in range(self._epoch + 1, self._tried + 2):
            key = self._key(epoch, "members")
            if not self._store.check([key]):
                self._store.set(key, _ENDED)

    def carried(self, transport: EpTransport) -> Regroup | None:
        """This channel, for the group now formed (its beats where its workers beat); none for the head alone."""
        if transport.world_size == 1:
            return None
        self._epoch = self._tried
        self._rank = transport.rank
        self._beats = beats_of(transport, self._period)
        return self

    def close(self) -> None:
        """Nothing is held but references."""

    def _key(self, epoch: int, what: str) -> str:
        return f"{self._namespace}/{epoch}/{what}"

    def _transport(self, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        """Leave the old default group; join the epoch's (``rank`` of ``members``); make the transport over it."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if len(members) == 1:
            return SoloTransport()
        rendezvous = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        dist.init_process_group(
            self._backend,
            store=PrefixStore(self._key(epoch, "world/"), self._store),
            rank=rank,
            world_size=len(members),
            timeout=rendezvous,
            device_id=self._device_id,
        )
        dist.distributed_c10d._set_pg_timeout(self._idle)  # past the rendezvous: its collectives wait as before
        return self._make()


class _Silence:
    """The head's reading of the workers' beats while it waits for check-ins: who stopped beating."""

    __slots__ = ("_beats", "_first", "_next", "_still")

    def __init__(self, beats: Beats | None) -> None:
        self._beats = beats
        self._first: dict[int, tuple[int, float]] = {}  # by rank: the counter first read, and when
        self._next = 0.0  # when to read the counters again
        self._still: dict[int, float] = {}

    def silent(self, ranks: Sequence[int]) -> dict[int, float]:
        """The ``ranks`` whose counter has not moved for ``SILENT_AFTER_BEATS`` beats and who did not leave, each
        with the seconds it has been still (as far as this reading saw)."""
        if self._beats is None:
            return {}
        store, group, period = self._beats
        now = time.monotonic()
        if now < self._next:  # read once a half beat
            return {rank: seconds for rank, seconds in self._still.items() if rank in ranks}
        self._next, still = now + period / 2, {}
        for rank in ranks:
            key = beat_key(group, rank)
            try:
                if store.check([f"{key}/left"]):  # it closed its transport: a survivor on its way to check in
                    continue
                counter = store.add(key, 0)
            except Exception as error:  # noqa: BLE001  (a store that does not answer: the bound decides)
                _LOGGER.debug("head: reading worker rank %d's heartbeat failed: %s", rank, error)
                continue
            first = self._first.setdefault(rank, (counter, now))
            if counter != first[0]:
                self._first[rank] = (counter, now)
            elif now - first[1] >= SILENT_AFTER_BEATS * period:
                still[rank] = now - first[1]
        self._still = still
        return still
