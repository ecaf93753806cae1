"""The setup gather over a ring's segment: every rank's few words, by rank, woken by a shared bell.

Each rank owns one gather line: a generation, an acknowledgement and a count, then
its words.  A gather writes the words, then the next generation; waits until every
rank's generation reached it; reads them all; acknowledges; and waits until every
rank has acknowledged, so that nobody overwrites words another rank has not read
yet.  Waits sleep on the bell word, which every rank bumps and wakes after each
step, and are bounded by the setup timeout.  Only setup uses it: it is not fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .._core.checks import disagreement
from .._core.transport import GATHER_WORDS, PeerLost, TransportClosed, TransportTimeout
from .._core.words import u32_values
from .._host.liveness import ProcessWatch
from . import futex
from .segment import BELL_AT, GONE_AT, HEAD_OPEN, HEAD_PID_AT, HEAD_STATE_AT, Segment
from .waiting import DEFAULT_SPIN_TIME, wait_until


class SetupGather:
    """The gathers of one rank of a ring, counted by generation.

    ``members``: pids to watch from the first gather on, before they attach (a ring
    formed again over the ranks left of a group).

    Raises from ``gather`` (plain errors): ``TypeError`` or ``ValueError`` for a word
    that is not a u32 (as [`check_u32`][metrale_model_engine.check_u32] says, naming ``words[i]``),
    ``ValueError`` for more than ``GATHER_WORDS`` words or counts that differ between ranks,
    [`PeerLost`][metrale_model_engine.transport.PeerLost] when a rank of the ring died, or left it (closed its
    transport) before it answered,
    [`TransportTimeout`][metrale_model_engine.transport.TransportTimeout] past ``setup_timeout``,
    [`TransportClosed`][metrale_model_engine.transport.TransportClosed] once ``closed`` is set.
    """

    __slots__ = ("_attempted", "_generation", "_members", "_rank", "_segment", "_setup_timeout", "closed")

    def __init__(self, segment: Segment, rank: int, setup_timeout: float, members: Sequence[int] = ()) -> None:
        self._segment = segment
        self._rank = rank
        self._setup_timeout = setup_timeout
        self._members = tuple(members)  # pids watched before they attach: a ring formed again over known ranks
        self._generation = 0
        self._attempted = 0  # the generation of the latest gather begun
        self.closed = False
        """Set when the transport closes: a gather in progress then raises."""

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words``, by rank; collective, each wait bounded by ``timeout`` (default the setup's)."""
        if len(words) > GATHER_WORDS:
            raise ValueError(f"gather takes at most {GATHER_WORDS} u32 words, got {len(words)}: {list(words)!r}")
        values = u32_values("words", words)
        segment = self._segment
        layout, u32 = segment.layout, segment.u32
        generation = self._attempted = self._generation + 1
        mine = layout.gather_at(self._rank) // 4
        u32[mine + 2] = len(values)
        for index, value in enumerate(values):
            u32[mine + 3 + index] = value
        futex.full_fence()
        u32[mine] = generation
        self._ring_bell()
        lines = [layout.gather_at(rank) // 4 for rank in range(layout.world_size)]
        limit = f"setup_timeout={self._setup_timeout}" if timeout is None else str(timeout)
        seconds = self._setup_timeout if timeout is None else timeout
        self._wait_for_ranks(
            lambda: [rank for rank, line in enumerate(lines) if u32[line] < generation], "answer the gather", seconds,
            limit,
        )  # fmt: skip
        everyone = [list(u32[line + 3 : line + 3 + u32[line + 2]]) for line in lines]
        u32[mine + 1] = generation  # read: the others may overwrite their words after this
        self._ring_bell()
        self._wait_for_ranks(
            lambda: [rank for rank, line in enumerate(lines) if u32[line + 1] < generation], "finish the gather",
            seconds, limit,
        )  # fmt: skip
        self._generation = generation
        differ = disagreement(self._rank, "word count of a gather", [len(words) for words in everyone])
        if differ is not None:
            raise ValueError(differ)
        return everyone

    def unanswered(self) -> list[int]:
        """The ranks that have not answered this rank's latest gather and are still in the ring (none once it
        passed).  A worker that closed its end before answering is not counted: it left on its own, and will check
        in for the next epoch or end (its process's end is seen apart)."""
        segment = self._segment
        lines = [segment.layout.gather_at(rank) // 4 for rank in range(segment.layout.world_size)]
        return [rank for rank, line in enumerate(lines) if segment.u32[line] < self._attempted and not self._left(rank)]

    def _left(self, rank: int) -> bool:
        """Whether worker ``rank`` closed its end of the ring (the head never leaves it)."""
        return bool(rank) and bool(self._segment.bytes[GONE_AT + rank - 1])

    def _wait_for_ranks(self, pending: Callable[[], list[int]], doing: str, timeout: float, limit: str) -> None:
        """Wait until no rank is ``pending``; raise as the class says (``PeerLost`` too for a pending worker that left
        the ring: it closed its transport, alive, and will not answer)."""
        segment, layout = self._segment, self._segment.layout
        pid_words = [HEAD_PID_AT // 4] + [layout.pid_at(r) // 4 for r in range(layout.readers)]
        watch = ProcessWatch()
        for pid in self._members:
            watch.add(pid)

        def check() -> None:
            if self.closed:
                raise TransportClosed("this ShmTransport was closed")
            if self._rank and segment.u32[HEAD_STATE_AT // 4] != HEAD_OPEN:
                raise PeerLost(f"rank {self._rank}: the head left the ring before every rank could {doing}")
            for word in pid_words:
                if segment.u32[word]:
                    watch.add(segment.u32[word])
            dead = watch.dead()
            if dead:
                raise PeerLost(
                    f"rank {self._rank}: process(es) {sorted(dead)} of the ring died before every rank could {doing}"
                )
            left = [rank for rank in pending() if self._left(rank)]
            if left:
                raise PeerLost(f"rank {self._rank}: rank(s) {left} left the ring before every rank could {doing}")

        try:
            wait_until(
                lambda: not pending(),
                segment=segment,
                park_word=lambda: BELL_AT,
                parked_flag=None,
                deadline=time.monotonic() + max(timeout, 0.0),
                check=check,
                spin=DEFAULT_SPIN_TIME,
            )
        except TimeoutError:
            missing = [r for r, word in enumerate(pid_words) if not segment.u32[word]]
            hint = f"; rank(s) {missing} never attached" if missing else ""
            raise TransportTimeout(
                f"rank {self._rank}: not every rank of the ring managed to {doing} within {limit} s{hint}"
            ) from None
        finally:
            watch.close()

    def _ring_bell(self) -> None:
        u32, bell = self._segment.u32, BELL_AT // 4
        u32[bell] = (u32[bell] + 1) & 0xFFFF_FFFF
        futex.futex_wake(self._segment.address + BELL_AT)
