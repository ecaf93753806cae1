"""``HostsTransport``: each command crosses the network once per remote host, then a ring inside each host."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Final

import torch.distributed as dist
from typing_extensions import Buffer

from .._core.codec import answer_bytes, closes_answers
from .._core.transport import PeerLost, TransportClosed, TransportCorrupt
from .._shm.transport import ShmTransport
from .transport import TorchTransport

_LOST: Final[int] = 1 << 31
"""Set in the rank word of a leader's bundle entry that says the rank was lost (its text follows)."""
_LEADER_SHARE: Final[float] = 0.8
"""Part of a sync point's timeout a leader waits for its host's answers: its bundle, naming the late ranks,
then reaches the head before the head's own wait for it ends."""


class HostsTransport:
    """An :class:`~metrale_model_engine.EpTransport` for ranks on several hosts, several on some.

    Each host's lowest rank is its *leader* (the head leads its own host).  The head
    publishes a message on its host's shared-memory ring and broadcasts it once to
    the leaders, over a process group of the head and the leaders alone; each
    leader republishes it on its own host's ring before it returns it, and every
    other worker reads its host's ring.  So a command pays one network broadcast to
    ``hosts - 1`` leaders and one ring hop, where :class:`TorchTransport` over the
    whole group pays a broadcast to every rank.

    The way back crosses the same two hops.  The workers of the head's host answer
    on its ring, at once, as on one host.  A remote worker holds its answers until
    a sync point, then hands them to its leader on its host's ring; the leader reads
    them until each of its readers has acknowledged the sync point (or stopped, or
    is lost) and sends the head one bundle of its host's answers, by rank, point to
    point over the leaders' group.  The head keeps what a bundle brings for the
    ranks it has not asked yet.  A remote worker that leaves with answers held (it
    stopped the run) puts them in the group's store, and so does a leader for its
    own and for those its readers handed it too late; the head reads them there
    once a send fails, as over :class:`TorchTransport`.

    Liveness: the head watches the workers of its host through pidfds, and each
    leader its host's workers the same way (a reader lost at a sync point is named
    in the bundle).  Every worker also beats in the whole group's store, where the
    head reads which ranks went silent (:meth:`silent_ranks`), and a worker cut off
    from it ends its process (see :class:`TorchTransport`).  The setup gathers go
    over the whole group.

    Built by :func:`~metrale_model_engine.torch.open_transport` (``"auto"``, when the
    ranks span hosts and some host holds several); it owns its three parts.
    """

    __slots__ = (
        "_bundled",
        "_held",
        "_host_of",
        "_leaders",
        "_leaders_group",
        "_lost",
        "_members",
        "_ring",
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
        self._members: Final = tuple(hosts[self._host_of[world.rank]])  # this host's ranks, by ring rank
        self._held: list[bytes] = []  # a remote worker's answers, until its sync point
        self._bundled: dict[int, list[bytes]] = {}  # head: what leaders' bundles brought, by rank, not yet asked
        self._lost: dict[int, str] = {}  # head: the ranks a bundle said were lost, and how

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: publish on its host's ring (the near readers first), then broadcast to the leaders."""
        if self._ring is not None:
            self._ring.send(parts, timeout)
        if self._leaders is not None:
            self._leaders.send(parts, timeout)

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: from the leaders' broadcast (a leader republishes it first), else from the host's ring."""
        if self._leaders is not None:
            message = self._leaders.receive(timeout)
            if self._ring is not None:
                self._ring.send((message,), timeout)
            return message
        assert self._ring is not None  # a worker that leads nothing reads its host's ring
        try:
            return self._ring.receive(timeout)
        except PeerLost as error:
            if self._members[0] == 0:
                raise
            raise PeerLost(f"{error} (the head of this host's ring is its leader, rank {self._members[0]})") from None

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
        held, self._held = self._held, []
        if self._leaders is not None:
            self._leaders.send_answers(self._host_answers(held, timeout), timeout)
        elif self._members[0] != 0:
            assert self._ring is not None  # a remote worker that does not lead shares a ring with its leader
            for answer in held:  # the leader reads them now: a full answer ring waits for it, bounded
                self._ring.answer(answer, timeout)

    def _host_answers(self, own: list[bytes], timeout: float | None) -> list[bytes]:
        """Leader: its answers and its readers' up to each one's last for this sync point, as bundle entries."""
        entries = [_entry(self.rank, answer) for answer in own]
        ring = self._ring
        if ring is None:
            return entries
        deadline = None if timeout is None else time.monotonic() + _LEADER_SHARE * timeout
        for reader, rank in enumerate(self._members[1:], start=1):
            closed = False
            while not closed:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    answers = ring.receive_answers(reader, left)
                except Exception as error:  # noqa: BLE001  (named to the head, in the bundle)
                    entries.append(_entry(rank | _LOST, self._lost_text(rank, error).encode()))
                    break
                entries += [_entry(rank, answer) for answer in answers]
                closed = any(closes_answers(answer) for answer in answers)
        return entries

    def _lost_text(self, rank: int, error: Exception) -> str:
        ring_ranks = ", ".join(f"{index} is rank {member}" for index, member in enumerate(self._members))
        return (
            f"worker rank {rank}'s answers could not be read on its host's ring, led by rank {self.rank} "
            f"(ring rank {ring_ranks}): {error}"
        )

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
            return self._ring.receive_answers(self._members.index(rank), timeout)
        if rank not in self._bundled and rank not in self._lost:
            assert self._leaders is not None  # the head is in the leaders' group
            self._take_bundle(self._leaders.receive_answers(host, timeout))
            if rank not in self._bundled and rank not in self._lost:
                raise TransportCorrupt(f"the answers of worker rank {rank}'s host held none of it")
        answers = self._bundled.pop(rank, [])
        if not answers:
            raise PeerLost(self._lost.pop(rank))
        return answers

    def _take_bundle(self, entries: list[bytes]) -> None:
        for entry in entries:
            tag = int.from_bytes(entry[:4], sys.byteorder)
            if tag & _LOST:
                self._lost[tag & ~_LOST] = entry[4:].decode(errors="replace")
            else:
                self._bundled.setdefault(tag, []).append(entry[4:])

    def silent_ranks(self) -> list[int]:
        """Head: the workers whose heartbeat stopped (see :class:`TorchTransport`)."""
        return self._world.silent_ranks()

    def close(self) -> None:
        """Close the ring, the leaders' transport (destroying its group) and the whole group's.  Idempotent.

        A remote worker's answers still held, and on a leader its readers' answers
        still on the ring, go to the group's store first (best effort).
        """
        try:
            held, self._held = self._held, []
            self._world.leave_answers(self.rank, held)
            if self._ring is not None:
                if self._leaders is not None and self.rank != 0:
                    self._leave_readers_answers(self._ring)
                self._ring.close()
            if self._leaders is not None:
                self._leaders.close()
            group, self._leaders_group = self._leaders_group, None
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        finally:
            self._world.close()

    def _leave_readers_answers(self, ring: ShmTransport) -> None:
        try:
            unread = ring.poll_answers()
        except Exception:  # noqa: BLE001  (a ring already closed: nothing to leave)
            return
        by_rank: dict[int, list[bytes]] = {}
        for reader, answer in unread:
            by_rank.setdefault(self._members[reader], []).append(answer)
        for rank, answers in by_rank.items():
            self._world.leave_answers(rank, answers)


def _entry(tag: int, data: bytes | memoryview) -> bytes:
    """One entry of a leader's bundle: the rank (or'ed with ``_LOST``), then the answer (or the text)."""
    return tag.to_bytes(4, sys.byteorder) + bytes(data)
