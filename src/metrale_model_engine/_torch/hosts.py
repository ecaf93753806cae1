"""``HostsTransport``: each command crosses the network once per remote host, then a ring inside each host."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Final

import torch.distributed as dist
from typing_extensions import Buffer

from .._core.codec import acknowledged, answer_bytes, closes_answers
from .._core.transport import PeerLost, TransportClosed, TransportCorrupt, TransportTimeout
from .._shm.transport import ShmTransport
from .transport import TorchTransport, group_waits

_LOST: Final[int] = 1 << 31
"""Set in the rank word of a leader's bundle entry that says the rank was lost (its text follows)."""
_LEADER_SHARE: Final[float] = 0.8
"""Part of a sync point's timeout a leader waits for its host's answers: its bundle, naming the late ranks,
then reaches the head before the head's own wait for it ends."""
_LOOK_PAUSE: Final[float] = 0.001
"""Seconds between a leader's first two looks at its ring once a wait for a reader failed (then doubling)."""
_LOOK_PAUSE_MAX: Final[float] = 0.02
"""The longest pause between two such looks."""


class HostsTransport:
    """An [`EpTransport`][metrale_model_engine.EpTransport] for ranks on several hosts, several on some.

    Each host's lowest rank is its *leader* (the head leads its own host).  The head
    publishes a message on its host's shared-memory ring and broadcasts it once to
    the leaders, over a process group of the head and the leaders alone; each
    leader republishes it on its own host's ring before it returns it, and every
    other worker reads its host's ring.  So a command pays one network broadcast to
    ``hosts - 1`` leaders and one ring hop, where [`TorchTransport`][metrale_model_engine.torch.TorchTransport] over the
    whole group pays a broadcast to every rank.

    The way back crosses the same two hops.  The workers of the head's host answer
    on its ring, at once, as on one host.  A remote worker holds its answers until
    a sync point, then hands them to its leader on its host's ring; the leader reads
    them until each of its readers has acknowledged this sync point (the number of
    its own acknowledgement), stopped the run, or is lost (gone, or late past 0.8 of
    the timeout: named in the bundle), and sends the head one bundle of its host's
    answers, by rank, point to point over the leaders' group.  The head keeps what a
    bundle brings for the ranks it has not asked yet.  Answers that will not reach a
    sync point go to the group's store, appended: a remote worker's held ones when it
    leaves (it stopped the run), and a leader's own, its unsent bundle and what its
    readers left on the ring when it closes; the head reads them there once a send
    fails, as over [`TorchTransport`][metrale_model_engine.torch.TorchTransport].

    Liveness: the head watches the workers of its host through pidfds, and each
    leader its host's workers the same way (a reader lost at a sync point is named
    in the bundle).  Every worker also beats in the whole group's store, where the
    head reads which ranks went silent ([`silent_ranks`][metrale_model_engine.torch.HostsTransport.silent_ranks]), and a
    worker cut off from it ends its process (see [`TorchTransport`][metrale_model_engine.torch.TorchTransport]).  The
    setup gathers go over the whole group.

    Built by [`open_transport`][metrale_model_engine.torch.open_transport] (``"auto"``, when the
    ranks span hosts and some host holds several); it owns its three parts.

    Args:
        world: this rank's transport over the whole group (its rank is this one's).
        leaders: the transport over the head and the leaders (``None`` on a worker
            that leads nothing).
        ring: this host's ring, this rank's end of it (``None`` on a host of one rank).
        leaders_group: the process group under ``leaders``, destroyed at close.
        hosts: the ranks by host, the head's host first, each host's leader first
            (its ring ranks are the positions in it).
    """

    __slots__ = (
        "_bundled",
        "_held",
        "_host_of",
        "_hosts",
        "_leaders",
        "_leaders_group",
        "_lost",
        "_members",
        "_ring",
        "_unsent",
        "_world",
        "rank",
        "world_size",
    )

    def __init__(
        self,
        world: TorchTransport,
        leaders: TorchTransport | None,
        ring: ShmTransport | None,
        leaders_group: dist.ProcessGroup | None = None,
        *,
        hosts: Sequence[Sequence[int]],
    ) -> None:
        self._world: Final = world
        self._leaders = leaders  # the head's and the leaders' broadcast; None on other workers
        self._leaders_group = leaders_group  # the group under it, this transport's to destroy
        self._ring = ring  # this host's ring; None on a host of one rank
        self.rank: Final = world.rank
        """This process's rank in the whole group; 0 is the head."""
        self.world_size: Final = world.world_size
        """Number of ranks in the whole group."""
        self._host_of: Final = {rank: index for index, host in enumerate(hosts) for rank in host}
        """Each rank's host, as its leader's rank in the leaders' group (the head's host is 0)."""
        self._hosts: Final = tuple(tuple(host) for host in hosts)
        self._members: Final = self._hosts[self._host_of[world.rank]]  # this host's ranks, by ring rank
        self._held: deque[bytes] = deque()  # a remote worker's answers, until its sync point
        self._unsent: list[bytes] = []  # a leader's bundle until it is sent
        self._bundled: dict[int, list[bytes]] = {}  # head: what leaders' bundles brought, by rank, not yet asked
        self._lost: dict[int, str] = {}  # head: the ranks a bundle said were lost, and how

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: publish on its host's ring (the near readers first), then broadcast to the leaders."""
        if self._ring is not None:
            self._publish(parts, timeout)
        if self._leaders is not None:
            with group_waits(self._world)():
                self._leaders.send(parts, timeout)

    def _publish(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """On this host's ring, as its head (the head, or a leader relaying)."""
        assert self._ring is not None
        try:
            self._ring.send(parts, timeout)
        except (PeerLost, TransportTimeout) as error:
            raise self._in_ranks(error) from None

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: from the leaders' broadcast (a leader republishes it first), else from the host's ring."""
        if self._leaders is not None:
            message = self._leaders.receive(timeout)
            if self._ring is not None:
                self._publish((message,), timeout)
            return message
        assert self._ring is not None  # a worker that leads nothing reads its host's ring
        try:
            return self._ring.receive(timeout)
        except PeerLost as error:
            if self._members[0] == 0:
                raise
            raise self._from_leader(error) from None

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words``, over the whole group."""
        return self._world.gather(words, timeout)

    # -- the way back ---------------------------------------------------------

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: on the head's host, on its ring at once; elsewhere held until the next sync point."""
        if self.rank == 0:
            raise TransportClosed("the head does not answer")
        if self._members[0] == 0:
            assert self._ring is not None  # the head's host holds several ranks, since it holds this one too
            self._ring.answer(answer, timeout)
        else:
            self._held.append(bytes(answer_bytes(answer)))

    def flush_answers(self, timeout: float | None) -> None:
        """Worker, at a sync point: a remote reader hands its answers to its leader, a leader its host's to the head."""
        if self._leaders is not None:
            self._send_bundle(timeout)
        elif self._members[0] != 0:
            assert self._ring is not None  # a remote worker that does not lead shares a ring with its leader
            held = self._held
            try:
                while held:  # one at a time: what a failure leaves held, close leaves in the store
                    self._ring.answer(held[0], timeout)  # the leader reads now: a full ring waits for it, bounded
                    held.popleft()
            except PeerLost as error:
                raise self._from_leader(error) from None

    def _send_bundle(self, timeout: float | None) -> None:
        """Leader: its answers and its readers' for this sync point, to the head in one bundle.

        The bundle grows in ``_unsent`` as it is read, so that whatever stops it
        leaves nothing read in the void: [`close`][metrale_model_engine.torch.HostsTransport.close] puts it in the
        store.
        """
        assert self._leaders is not None
        own = list(self._held)
        self._held.clear()
        self._unsent += [_entry(self.rank, answer) for answer in own]
        numbers = [number for number in map(acknowledged, own) if number is not None]
        self._read_readers(numbers[-1] if numbers else None, timeout)  # the leader acknowledges it too
        self._leaders.send_answers(self._unsent, timeout)
        self._unsent = []

    def _read_readers(self, number: int | None, timeout: float | None) -> None:
        """Leader: each reader's answers up to its acknowledgement of sync point ``number`` (``None``: any), bundled.

        Read reader by reader as they come; once a wait fails (some reader is gone,
        or the time is up), each reader still awaited is looked at in turn.  The time
        is ``_LEADER_SHARE`` of ``timeout``.
        """
        ring = self._ring
        if ring is None:
            return
        deadline = None if timeout is None else time.monotonic() + _LEADER_SHARE * timeout
        awaited = list(range(1, len(self._members)))  # ring ranks
        try:
            while awaited:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                answers = ring.receive_answers(awaited[0], left)
                self._unsent += [_entry(self._members[awaited[0]], answer) for answer in answers]
                if any(closes_answers(answer, number) for answer in answers):
                    awaited.pop(0)
        except (PeerLost, TransportTimeout):
            self._look_at_each_reader(ring, awaited, number, deadline, timeout)

    def _look_at_each_reader(
        self, ring: ShmTransport, awaited: list[int], number: int | None, deadline: float | None, timeout: float | None
    ) -> None:
        """Leader, once a wait failed: poll the ring until each awaited reader answered, or is gone, or late."""
        pause = _LOOK_PAUSE
        while True:
            gone = ring.gone_workers()  # first: what a reader answered before it went is in the poll below
            for reader, answer in ring.poll_answers():
                self._unsent.append(_entry(self._members[reader], answer))
                if reader in awaited and closes_answers(answer, number):
                    awaited.remove(reader)
            self._unsent += [self._lost_entry(reader, gone[reader]) for reader in awaited if reader in gone]
            awaited = [reader for reader in awaited if reader not in gone]
            if not awaited:
                return
            if deadline is not None and time.monotonic() >= deadline:
                late = f"sent no answer within {_LEADER_SHARE * (timeout or 0.0):g} s"
                self._unsent += [self._lost_entry(reader, late) for reader in awaited]
                return
            time.sleep(pause)
            pause = min(2 * pause, _LOOK_PAUSE_MAX)

    def _lost_entry(self, reader: int, how: str) -> bytes:
        text = f"worker rank {self._members[reader]} {how} (on its host's ring, led by rank {self.rank})"
        return _entry(self._members[reader] | _LOST, text.encode())

    def _from_leader(self, error: PeerLost) -> PeerLost:
        """A remote reader's ring error, saying that the ring's head is the host's leader."""
        return PeerLost(f"{error} (the head of this host's ring is its leader, rank {self._members[0]})")

    def answers_ready(self) -> bool:
        """Head: whether a worker of its host answered (remote answers arrive at sync points)."""
        return self._ring is not None and self.rank == 0 and self._ring.answers_ready()

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: the answers on its host's ring, and those remote workers left in the store when they left."""
        found = self._world.poll_answers()
        if self._ring is not None:
            found += [(self._members[reader], answer) for reader, answer in self._ring.poll_answers()]
        return found

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head, at a sync point: worker ``rank``'s answers, from its host's ring or its leader's bundle.

        Raises:
            PeerLost: the leader's bundle says the rank was lost (its leader's words).
            TransportCorrupt: a bundle of its leader held nothing of it.
        """
        host = self._host_of[rank]
        if host == 0:
            assert self._ring is not None  # the head's host holds several ranks, since it holds this one too
            try:
                return self._ring.receive_answers(self._members.index(rank), timeout)
            except (PeerLost, TransportTimeout) as error:
                raise self._in_ranks(error) from None
        if rank not in self._bundled and rank not in self._lost:
            self._take_bundle(host, timeout)
            if rank not in self._bundled and rank not in self._lost:
                raise TransportCorrupt(f"the answers of worker rank {rank}'s host held none of it")
        answers = self._bundled.pop(rank, [])
        if not answers:
            raise PeerLost(self._lost.pop(rank))
        return answers

    def _take_bundle(self, host: int, timeout: float | None) -> None:
        """Head: the next bundle of ``host``'s leader, its answers kept by rank (its lost ranks replaced)."""
        assert self._leaders is not None  # the head is in the leaders' group
        ranks = self._hosts[host]
        whose = f"the answers of the host of ranks {list(ranks)}, which its leader, rank {ranks[0]}, bundles"
        try:
            with group_waits(self._world)():
                entries = self._leaders.receive_answers(host, timeout)
        except TransportTimeout as error:
            raise TransportTimeout(f"{whose}, did not come: {error}") from None
        except (TransportClosed, TransportCorrupt):
            raise
        except Exception as error:  # the backend's own (gloo: RuntimeError)
            raise PeerLost(f"{whose}, could not be received: {error}") from error
        opened = list(map(_opened, entries))
        strangers = sorted({rank for rank, _, _ in opened} - set(ranks))
        if strangers:
            raise TransportCorrupt(f"{whose}, held answers of rank(s) {strangers}, of other hosts")
        for rank in ranks:
            self._lost.pop(rank, None)
        for rank, lost, data in opened:
            if lost:
                self._lost[rank] = data.decode(errors="replace")
            else:
                self._bundled.setdefault(rank, []).append(data)

    def _in_ranks(self, error: PeerLost | TransportTimeout) -> PeerLost | TransportTimeout:
        """This host's ring's ``error``, where ring ranks are not ranks, saying how they map."""
        if self._members == tuple(range(len(self._members))):
            return error
        return type(error)(f"{error} (this host's ring numbers ranks {list(self._members)} from 0)")

    def silent_ranks(self) -> list[int]:
        """Head: the workers whose heartbeat stopped (see ``TorchTransport``)."""
        return self._world.silent_ranks()

    def lost_ranks(self) -> dict[int, float]:
        """Head: the workers found lost while it waited on them, each with how long it was silent (see
        [`TorchTransport`][metrale_model_engine.torch.TorchTransport])."""
        return self._world.lost_ranks()

    def close(self) -> None:
        """Close the ring, the leaders' transport (destroying its group) and the whole group's.  Idempotent.

        Answers that will not reach a sync point go to the group's store first (best
        effort): a remote worker's held ones, and on a leader those of a bundle not
        sent and those its readers left on the ring.
        """
        with ExitStack() as closing:  # each part is closed, whatever another one raises; the whole group's last
            closing.callback(self._world.close)
            closing.callback(self._destroy_leaders_group)
            if self._leaders is not None:
                closing.callback(self._leaders.close)
            if self._ring is not None:
                closing.callback(self._ring.close)
            if self.rank != 0 and self._leaders is not None:
                self._leave_relayed()  # first: a bundle not sent holds the leader's earlier answers
            self._world.leave_answers(self.rank, list(self._held))
            self._held.clear()

    def _destroy_leaders_group(self) -> None:
        group, self._leaders_group = self._leaders_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _leave_relayed(self) -> None:
        """Leader, closing: its host's answers it holds or its ring holds, in the store by rank."""
        by_rank: dict[int, list[bytes]] = {}
        for rank, lost, data in map(_opened, self._unsent):
            if not lost:
                by_rank.setdefault(rank, []).append(data)
        self._unsent = []
        if self._ring is not None:
            try:
                unread = self._ring.poll_answers()
            except TransportClosed:  # closed already: nothing to read
                unread = []
            for reader, answer in unread:
                by_rank.setdefault(self._members[reader], []).append(answer)
        for rank, answers in by_rank.items():
            self._world.leave_answers(rank, answers)


def _entry(tag: int, data: bytes | memoryview) -> bytes:
    """One entry of a leader's bundle: the rank (or'ed with ``_LOST``), then the answer (or the text)."""
    return tag.to_bytes(4, sys.byteorder) + bytes(data)


def _opened(entry: bytes) -> tuple[int, bool, bytes]:
    """An entry of ``_entry``: its rank, whether it says the rank was lost, and the answer (or the text)."""
    tag = int.from_bytes(entry[:4], sys.byteorder)
    return tag & ~_LOST, bool(tag & _LOST), entry[4:]


def waits_of(transport: object) -> Callable[[], AbstractContextManager[object]]:
    """What a wait on the whole group under ``transport`` runs inside (see ``group_waits``).

    A [`TorchTransport`][metrale_model_engine.torch.TorchTransport]'s own, a
    [`HostsTransport`][metrale_model_engine.torch.HostsTransport]'s group's (the whole group, not the leaders'), and
    ``nullcontext`` for any other transport.
    """
    world = transport._world if isinstance(transport, HostsTransport) else transport
    return group_waits(world) if isinstance(world, TorchTransport) else nullcontext
