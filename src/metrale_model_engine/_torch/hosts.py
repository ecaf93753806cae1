"""``HostsTransport``: each command crosses the network once per remote host, then a ring inside each host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch.distributed as dist
from typing_extensions import Buffer

from .._shm.transport import ShmTransport
from .transport import TorchTransport


class HostsTransport:
    """An :class:`~metrale_model_engine.EpTransport` for ranks on several hosts, several on some.

    Each host's lowest rank is its *leader* (the head leads its own host).  The head
    publishes a message on its host's shared-memory ring and broadcasts it once to
    the leaders, over a process group of the head and the leaders alone; each
    leader republishes it on its own host's ring before it returns it, and every
    other worker reads its host's ring.  So a command pays one network broadcast to
    ``hosts - 1`` leaders and one ring hop, where :class:`TorchTransport` over the
    whole group pays a broadcast to every rank.

    Everything else goes over the whole group, as :class:`TorchTransport` does it:
    the setup gathers, the workers' answers (held until a sync point, then point to
    point to the head), the heartbeats and :meth:`silent_ranks`.  A ring's head (the
    head, or a leader) watches its readers through pidfds, and its readers watch it:
    a leader that dies ends its host's workers' waits; the head's sends fail when a
    leader is lost, and name the silent ranks from their heartbeats.

    Built by :func:`~metrale_model_engine.torch.open_transport` (``"auto"``, when the
    ranks span hosts and some host holds several); it owns its three parts.
    """

    __slots__ = ("_leaders", "_leaders_group", "_ring", "_world", "rank", "world_size")

    def __init__(
        self,
        world: TorchTransport,
        leaders: TorchTransport | None,
        ring: ShmTransport | None,
        leaders_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._world: Final = world
        self._leaders = leaders  # the head's and the leaders' broadcast; None on other workers
        self._leaders_group = leaders_group  # the group under it, this transport's to destroy
        self._ring = ring  # this host's ring; None on a host of one rank
        self.rank: Final = world.rank
        """This process's rank in the whole group; 0 is the head."""
        self.world_size: Final = world.world_size
        """Number of ranks in the whole group."""

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
        return self._ring.receive(timeout)

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words``, over the whole group."""
        return self._world.gather(words, timeout)

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: held until the next sync point (see :class:`TorchTransport`)."""
        self._world.answer(answer, timeout)

    def flush_answers(self, timeout: float | None) -> None:
        """Worker, at a sync point: the held answers to the head, point to point."""
        self._world.flush_answers(timeout)

    def answers_ready(self) -> bool:
        """Nothing arrives between sync points."""
        return self._world.answers_ready()

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: answers that workers which left put in the store."""
        return self._world.poll_answers()

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head, at a sync point: worker ``rank``'s flushed answers."""
        return self._world.receive_answers(rank, timeout)

    def silent_ranks(self) -> list[int]:
        """Head: the workers whose heartbeat stopped (see :class:`TorchTransport`)."""
        return self._world.silent_ranks()

    def close(self) -> None:
        """Close the ring, the leaders' transport (destroying its group) and the whole group's.  Idempotent."""
        try:
            if self._ring is not None:
                self._ring.close()
            if self._leaders is not None:
                self._leaders.close()
            group, self._leaders_group = self._leaders_group, None
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        finally:
            self._world.close()
