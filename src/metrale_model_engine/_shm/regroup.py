"""``RingRegroup``: the ranks of a ring that lost some meet again through its segment, and form the next ring.

The head writes its word in the old segment's re-form line (``segment.REFORM_AT``):
the epoch, which ranks form it (one bit each) and the new ring's name, the epoch
last, then rings the bell; the ranks that wait there (a worker whose epoch ended)
read it and attach, each at its rank among the members.  The head's setup wait
watches the members' pids before they attach, so that a member that dies first
fails it at once (and the head's leaving the new ring, every other member's).  A
head that forms no epoch writes ``ENDED``.  No
file is left: the new ring's name goes at its first gather, as any ring's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, runtime_checkable

from .._core.reform import Reformable, Regroup
from .._core.transport import EpTransport, PeerLost, SoloTransport, TransportClosed, TransportTimeout
from .._host.liveness import ProcessWatch, ended_processes
from . import futex
from .segment import BELL_AT, HEAD_PID_AT, REFORM_AT, REFORM_NAME_BYTES, Layout, Segment, create_segment
from .waiting import DEFAULT_SPIN_TIME, wait_until

FORMED: Final = 1
"""The re-form line's state: the head formed the epoch it names."""
ENDED: Final = 2
"""The re-form line's state: the head forms no epoch (it ended the run)."""
_NAME: Final = slice(REFORM_AT + 16, REFORM_AT + 16 + REFORM_NAME_BYTES)
"""Where the next ring's name lies in the segment."""

MakeRing = Callable[[Segment, float, Sequence[int]], EpTransport]
"""The head's end of a ring over a segment it created, its setup bounded by the seconds given, watching from its
first gather the pids given (the members that have not attached yet)."""
AttachRing = Callable[[str, int, float], EpTransport]
"""A worker's end of the ring of that name at that rank, its setup bounded by the seconds given."""


@runtime_checkable
class _Gathers(Protocol):
    def unanswered(self) -> list[int]: ...


class RingRegroup:
    """The re-form channel of one ring (a [`Regroup`][metrale_model_engine.transport.Regroup]): see the module.

    Args:
        segment: a share of the ring's segment, kept mapped past the ring's close.
        rank: this process's rank in the ring.
        make: the head's end of a new ring.
        attach: a worker's end of a new ring.
    """

    __slots__ = ("_attach", "_attempt", "_closed", "_make", "_missing", "_rank", "_segment")

    def __init__(self, segment: Segment, rank: int, make: MakeRing, attach: AttachRing) -> None:
        self._segment = segment
        self._rank = rank
        self._make = make
        self._attach = attach
        self._attempt: tuple[int, list[int], EpTransport] | None = None  # head: the epoch being formed
        self._missing: dict[int, str] = {}  # head: members of the last epoch that did not join it, and how
        self._closed = False

    def wake(self) -> None:
        """Nothing: the ring's close ends every wait on it."""

    def survivors(
        self, epoch: int, candidates: Sequence[int], lost: dict[int, str], gone: Callable[[], Mapping[int, str]],
        deadline: float,
    ) -> list[int]:  # fmt: skip
        """Head: the ``candidates`` whose process lives (every rank of a ring is of the head's host)."""
        pids = self._pids()
        for rank, how in {**gone(), **ended_processes(pids), **self._missing}.items():
            if rank in candidates and rank:
                lost.setdefault(rank, how)
        self._missing = {}
        return [rank for rank in candidates if rank not in lost]

    def form(self, epoch: int, members: Sequence[int], deadline: float) -> EpTransport:
        """Head: a new ring for ``members`` (their pids named), told to every rank; the head alone: no ring."""
        if len(members) == 1:
            self._tell(epoch, members, "")
            return SoloTransport()
        pids, old = self._pids(), self._segment.layout
        segment = create_segment(Layout(len(members), old.ring_bytes, old.chunk_bytes), os.getpid())
        try:
            ring = self._make(segment, max(deadline - time.monotonic(), 0.001), [pids[rank] for rank in members[1:]])
        except BaseException:
            segment.close()
            raise
        self._attempt = (epoch, list(members), ring)
        self._tell(epoch, members, segment.name)
        return ring

    def abandon(self, transport: EpTransport) -> None:
        """Head: the epoch's ring failed to form: note the members that did not answer its setup, close it."""
        attempt = self._attempt
        try:
            if attempt is not None and attempt[2] is transport and isinstance(transport, _Gathers):
                epoch, members, _ = attempt
                for rank in transport.unanswered():
                    self._missing[members[rank]] = f"did not join epoch {epoch} of the link in time"
        finally:
            self._attempt = None
            transport.close()

    def join(
        self, epoch: int, rank: int, gone: Callable[[], Mapping[int, str]], deadline: float
    ) -> tuple[int, list[int]]:
        """Worker: wait in the old segment for the head's word of an epoch from ``epoch`` on (or that it ended)."""
        segment, line = self._segment, REFORM_AT // 4
        u32 = segment.u32
        watch = ProcessWatch()
        watch.add(u32[HEAD_PID_AT // 4])

        def check() -> None:
            if watch.dead():
                raise PeerLost(f"the head (pid {u32[HEAD_PID_AT // 4]}) died")

        try:
            wait_until(
                lambda: u32[line] >= epoch or u32[line + 1] == ENDED,
                segment=segment,
                park_word=lambda: BELL_AT,
                parked_flag=None,
                deadline=deadline,
                check=check,
                spin=DEFAULT_SPIN_TIME,
            )
        except TimeoutError:
            raise TransportTimeout(f"no re-form of the link came from the head by its bound (epoch {epoch})") from None
        finally:
            watch.close()
        futex.full_fence()
        if u32[line + 1] == ENDED:
            return epoch, []
        bits = segment.u64[line // 2 + 1]
        return u32[line], [member for member in range(64) if bits >> member & 1]

    def attach(self, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        """Worker: attach to epoch ``epoch``'s ring at this rank's place among ``members``."""
        segment, line = self._segment, REFORM_AT // 4
        name = bytes(segment.bytes[_NAME]).rstrip(b"\0").decode()
        futex.full_fence()
        if segment.u32[line] != epoch:  # the head moved on meanwhile: the name read may be another epoch's
            raise TransportClosed(f"the head formed epoch {segment.u32[line]} meanwhile, not {epoch}")
        return self._attach(name, members.index(rank), max(deadline - time.monotonic(), 0.001))

    def leave(self, rank: int, why: str) -> None:
        """Nothing: the head sees the process that leaves end."""

    def end(self) -> None:
        """Head: the workers that wait learn that no re-form comes."""
        segment = self._segment
        segment.u32[REFORM_AT // 4 + 1] = ENDED
        self._ring_bell()

    def carried(self, transport: EpTransport) -> Regroup | None:
        """The new ring's own channel (this one lets go of the old segment)."""
        self.close()
        return transport.regroup() if isinstance(transport, Reformable) else None

    def close(self) -> None:
        """Let go of the old segment (unmapped once the old ring is closed too).  Idempotent."""
        if not self._closed:
            self._closed = True
            self._segment.close()

    def _pids(self) -> dict[int, int]:
        """Every worker's pid in the old segment, by rank."""
        layout, u32 = self._segment.layout, self._segment.u32
        return {reader + 1: u32[layout.pid_at(reader) // 4] for reader in range(layout.readers)}

    def _tell(self, epoch: int, members: Sequence[int], name: str) -> None:
        """Write the head's word of ``epoch`` in the re-form line (its epoch last), and ring the bell."""
        segment, line = self._segment, REFORM_AT // 4
        encoded = name.encode()
        if len(encoded) > REFORM_NAME_BYTES:
            raise ValueError(f"the ring's name {name!r} is longer than the re-form line's {REFORM_NAME_BYTES} bytes")
        segment.bytes[_NAME] = encoded.ljust(REFORM_NAME_BYTES, b"\0")
        segment.u64[line // 2 + 1] = sum(1 << member for member in members)
        segment.u32[line + 1] = FORMED
        futex.full_fence()
        segment.u32[line] = epoch
        self._ring_bell()

    def _ring_bell(self) -> None:
        futex.full_fence()
        u32, bell = self._segment.u32, BELL_AT // 4
        u32[bell] = (u32[bell] + 1) & 0xFFFF_FFFF
        futex.futex_wake(self._segment.address + BELL_AT)
