"""Stand-ins for ``HostsTransport``'s parts, the whole group's transport and the leaders', and a leader's
way back over a real ring (:func:`leader_on_a_ring`, a :func:`metrale_model_engine.shm.run_ring` target)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import cast

from metrale_model_engine._core.codec import Ack, Report, acknowledged, encode_ack, encode_report
from metrale_model_engine._torch.hosts import _opened
from metrale_model_engine.shm import ShmTransport
from metrale_model_engine.torch import HostsTransport, TorchTransport

from helpers.rank_results import save, wait_for_result

HOSTS = [[0, 1], [2, 3, 4]]
"""The head's host (ranks 0 and 1), and a host led by rank 2 with readers 3 and 4 (ring ranks 1 and 2)."""


def ack(number: int) -> bytes:
    return encode_ack(Ack(number, 7, 3, 0, None))


def report(text: str, *, stopped: bool = False) -> bytes:
    return encode_report(Report(2, 0, 5, text, stopped))


class World:
    """The whole group's transport: the store's last words (appended, as the store does), and its close."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 5
        self.left: dict[int, list[bytes]] = {}
        self.closed = False
        self._blocking = nullcontext  # the head's waits on the leaders (no heartbeats here)

    def leave_answers(self, rank: int, answers: Sequence[bytes]) -> None:
        if answers:
            self.left.setdefault(rank, []).extend(answers)

    def poll_answers(self) -> list[tuple[int, bytes]]:
        return [(rank, answer) for rank, answers in self.left.items() for answer in answers]

    def close(self) -> None:
        self.closed = True


class Leaders:
    """The leaders' group: a leader's bundles sent, or the bundles the head receives, by host."""

    def __init__(self, bundles: dict[int, list[list[bytes]]] | None = None, fail: Exception | None = None) -> None:
        self.sent: list[list[bytes]] = []
        self.bundles = bundles or {}
        self.asked: list[int] = []
        self.fail = fail

    def send(self, parts: Sequence[bytes], timeout: float | None) -> None:
        pass

    def receive(self, timeout: float | None) -> memoryview:
        return memoryview(bytes(12))  # a command of three words

    def send_answers(self, answers: Sequence[bytes], timeout: float | None) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append(list(answers))

    def receive_answers(self, host: int, timeout: float | None) -> list[bytes]:
        self.asked.append(host)
        if self.fail is not None:
            raise self.fail
        return self.bundles[host].pop(0)

    def close(self) -> None:
        pass


def hosts_transport(world: World, leaders: Leaders | None, ring: object) -> HostsTransport:
    """Rank ``world.rank``'s ``HostsTransport`` over :data:`HOSTS`, its parts the stand-ins (or a real ring)."""
    return HostsTransport(
        cast(TorchTransport, world), cast(TorchTransport | None, leaders), cast(ShmTransport | None, ring), hosts=HOSTS
    )


def leader_on_a_ring(ring: ShmTransport, scenario: str, out: str) -> None:
    """Ranks 2, 3, 4 of :data:`HOSTS` on a real ring (ring ranks 0, 1, 2); the leader saves its bundles.

    ``gone``: rank 4 closes at once, rank 3 acknowledges sync point 1 half a second
    after the leader began to wait.  ``late``: rank 3 acknowledges sync point 1 after
    the leader's time for it (0.4 s of 0.5), then sync point 2 at once; rank 4 each in time.
    """
    rank = HOSTS[1][ring.rank]
    transport = hosts_transport(World(rank), Leaders() if ring.rank == 0 else None, ring)
    if ring.rank == 0:
        leaders = cast(Leaders, transport._leaders)
        time.sleep(0.2)
        for number, timeout in [(1, 0.5), (2, 5.0)] if scenario == "late" else [(1, 5.0)]:
            transport.answer(ack(number), timeout)
            transport.flush_answers(timeout)
            time.sleep(1.5 if number == 1 else 0.0)
        save(out, 0, bundles=[described(bundle) for bundle in leaders.sent])
    elif scenario == "gone" and rank == 4:
        ring.close()
    else:
        pauses = {("gone", 3): [0.7], ("late", 3): [1.0, 0.0], ("late", 4): [0.0, 1.4]}[scenario, rank]
        for number, pause in enumerate(pauses, start=1):
            time.sleep(pause)
            transport.answer(ack(number), 5.0)
            transport.flush_answers(5.0)
        wait_for_result(out, 0, timeout=5.0)  # until the leader has read it all
    transport.close()


def described(bundle: Sequence[bytes]) -> list[tuple[int, str]]:
    """A bundle's entries as ``(rank, "ack N")`` or ``(rank, "lost: TEXT")``."""
    found = []
    for rank, lost, data in map(_opened, bundle):
        found.append((rank, f"lost: {data.decode()}" if lost else f"ack {acknowledged(data)}"))
    return found
