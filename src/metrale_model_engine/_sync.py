"""What a sync point compares, and how a difference is worded: pure functions, no IO.

At sync point ``n`` every worker acknowledges what it received (the count of
commands, a CRC-32 of every message's bytes) and, when asked, its state's digest.
The head holds the same figures for what it sent.  A stream that differs means a
lost or altered message (or a bug in a transport); a state that differs with an
equal stream means a model that did not apply a command the same way on every rank.
Either way the message names the ranks, and the commands between the last sync
point where every rank agreed and this one: where they could have diverged, as far
as a digest can tell.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from typing_extensions import Buffer

from ._core.checks import check_seconds
from ._core.codec import Ack, Report, WireError, decode_answer, encode_sync
from ._core.errors import EpDivergenceError, EpLinkError, EpWorkerFailed, RunStopped, WorkerFailure
from ._core.words import check_u32
from ._host.liveness import ProcessWatch
from ._reader import ItemReader

_CHECK_PAUSE: Final = 0.001
"""Seconds between two looks of :meth:`SyncPoints.check_workers`."""
EXIT_GRACE: Final = 5.0
"""Seconds the head looks for the worker behind a failed collective (a failing worker takes a moment to exit)."""


@dataclass(frozen=True)
class HeadFigures:
    """What the head sent, at a sync point."""

    number: int
    commands: int
    stream_crc: int
    state_digest: int | None
    agreed_commands: int
    """The commands sent by the last sync point where every rank agreed (0: the start)."""


def read_answers(rank: int, answers: Iterable[bytes]) -> tuple[list[WorkerFailure], list[Ack]]:
    """The failures and acknowledgements in worker ``rank``'s answers.

    Raises:
        WireError: an answer is neither (the message names the rank).
    """
    failures: list[WorkerFailure] = []
    acks: list[Ack] = []
    for answer in answers:
        try:
            decoded = decode_answer(answer)
        except WireError as error:
            raise WireError(f"worker rank {rank}: {error}") from None
        if isinstance(decoded, Report):
            failures.append(
                WorkerFailure(
                    rank, decoded.command, decoded.seq_id, decoded.cmd, decoded.error, decoded.stopped, decoded.witness
                )
            )
        else:
            acks.append(decoded)
    return failures, acks


def differences(head: HeadFigures, acks: Mapping[int, Ack]) -> tuple[str, list[int]] | None:
    """``None`` when every worker's acknowledgement matches the head, else the message and the ranks that differ."""
    found: list[str] = []
    ranks: list[int] = []
    states = {rank: ack.state_digest for rank, ack in acks.items()}
    for rank, ack in sorted(acks.items()):
        what = []
        if ack.commands != head.commands:
            what.append(f"received {ack.commands} commands where the head sent {head.commands}")
        elif ack.stream_crc != head.stream_crc:
            what.append(f"its command stream's CRC-32 is {ack.stream_crc:#010x}, the head's {head.stream_crc:#010x}")
        expected = head.state_digest if head.state_digest is not None else states[min(states)]
        if head.state_digest is not None or len(set(states.values())) > 1:
            if ack.state_digest is None:
                what.append("it computed no state digest (set link.state_digest on every rank)")
            elif ack.state_digest != expected:
                whose = "the head's" if head.state_digest is not None else f"worker rank {min(states)}'s"
                what.append(f"its state digest is {ack.state_digest:#018x}, {whose} {expected:#018x}")
        if what:
            ranks.append(rank)
            found.append(f"worker rank {rank}: {'; '.join(what)}")
    if not found:
        return None
    since = (
        f"they agreed at the last sync point, after command {head.agreed_commands}: they diverged within "
        f"commands {head.agreed_commands + 1} ..= {head.commands}"
        if head.agreed_commands
        else f"no sync point has seen every rank agree yet: they diverged within commands 1 ..= {head.commands}"
    )
    return f"at sync point {head.number}, the ranks differ: {'; '.join(found)}; {since}", ranks


def disagreement_of_values(names: Sequence[str], everyone: Sequence[Sequence[int]]) -> tuple[str, list[int]] | None:
    """``None`` when every rank gathered the same named values, else the message (each mismatch) and the ranks."""
    mismatches: list[str] = []
    ranks: set[int] = set()
    for index, name in enumerate(names):
        values = [words[index] for words in everyone]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            mismatches.append(f"{name} ({per_rank})")
            ranks.update(rank for rank, value in enumerate(values) if value != values[0])
    if not mismatches:
        return None
    return f"the ranks disagree on {'; '.join(mismatches)}", sorted(ranks)


class SyncPoints(ItemReader):
    """The head's sync points and every rank's agreement helpers: a part of :class:`~metrale_model_engine.EpLink`.

    Built on the reading state below it and on the link's :meth:`_send` and
    :meth:`_require_head` above it.
    """

    __slots__ = ("_agreed_commands", "_reports_seen", "_sync_number", "_worker_ranks", "_workers")

    _world_size: int

    def _start_syncing(self) -> None:
        self._sync_number = 0
        self._agreed_commands = 0  # commands sent by the last sync point where every rank agreed
        self._reports_seen = [0] * self._world_size  # by rank: failures the head has read
        self._workers: ProcessWatch | None = None
        self._worker_ranks: dict[int, int] = {}

    if TYPE_CHECKING:  # the link above provides them

        def _send(self, parts: Sequence[Buffer]) -> None: ...

        def _require_head(self) -> None: ...

    def sync(self, slots: MutableSequence[Any] | None = None) -> None:
        """Head: wait until every worker has run every command sent so far, and check that they agree.

        Sends a sync item; each worker's loop answers it with what it received (the
        count of commands and a CRC-32 of every message) and, when ``slots`` is
        given and :attr:`state_digest` is set, the digest of its own slots; the
        head reads every worker's answers (its failure reports first) within
        ``command_timeout``.  A no-op on a one-rank group.

        Raises:
            EpWorkerFailed: workers reported failed commands not raised yet (every
                one of them, once).
            RunStopped: a worker reported a failure that stopped the run (a command
                that runs collectives), or the run stopped earlier.
            EpDivergenceError: a worker's stream or state differs from the head's
                (the message names the ranks and the commands within which they
                diverged).
            EpRoleError: called on a worker.
            EpSendError: the sync item could not be sent.
            EpLinkError: a worker died, or did not answer within ``command_timeout``
                (the message names it).
        """
        self._require_head()
        if self._world_size == 1:
            return
        mine = None if slots is None or self._state_digest is None else self._state_digest(slots)
        self._sync_number += 1
        self._send((encode_sync(self._sync_number, mine is not None),))
        failures: list[WorkerFailure] = []
        acks: dict[int, Ack] = {}
        for rank in range(1, self._world_size):
            while rank not in acks:
                try:
                    found, answered = read_answers(rank, self._transport.receive_answers(rank, self._command_timeout))
                except WireError as error:
                    raise EpLinkError(f"head: a corrupt answer at sync point {self._sync_number}: {error}") from None
                except Exception as error:
                    exited = " (it exited: died or left the run)" if rank in self._exited_workers() else ""
                    raise EpLinkError(
                        f"head: sync point {self._sync_number} failed waiting for worker rank {rank}{exited}: {error}"
                    ) from error
                failures += self._seen(found)
                if any(failure.stopped for failure in found):  # that worker left: no acknowledgement will come
                    raise self._stop(RunStopped(f"head: the run stopped: {self._why_stopped(failures, [])}", failures))
                acks.update((rank, ack) for ack in answered if ack.number == self._sync_number)
        figures = HeadFigures(self._sync_number, self._commands, self._crc, mine, self._agreed_commands)
        differ = differences(figures, acks)
        lost = [rank for rank, ack in acks.items() if ack.reports != self._reports_seen[rank]]
        if lost:
            raise EpLinkError(f"head: reports of worker rank(s) {lost} were lost on the way (a transport fault)")
        if failures:
            raise EpWorkerFailed(failures, f"; at sync point {self._sync_number}: {differ[0]}" if differ else "")
        if differ is not None:
            raise EpDivergenceError(*differ)
        self._agreed_commands = self._commands

    def gather_u32(self, value: int) -> list[int]:
        """Every rank's ``value`` (a u32), by rank, on every rank.  Collective: at the same point on every rank.

        Usable inside a command: the head after sending it, each worker in its
        hook.  Bounded by ``command_timeout``.

        Raises:
            TypeError, ValueError: ``value`` is not a u32.
            EpLinkError: a rank did not take part in time, or died.
        """
        return [words[0] for words in self._gather([check_u32("value", value)], "gathering a value")]

    def min_u32(self, value: int) -> int:
        """The smallest ``value`` (a u32) of every rank, on every rank (a :meth:`gather_u32`)."""
        return min(self.gather_u32(value))

    def assert_ranks_agree(self, **values: int) -> None:
        """Raise :class:`EpDivergenceError` on every rank unless every rank passed the same named u32 values.

        Collective, like :meth:`gather_u32`; at most 12 values.  The message lists
        every value that differs, with each rank's.

        Raises:
            TypeError, ValueError: a value is not a u32, or more than 12 are given.
            EpDivergenceError: the ranks differ (the names too count: every rank must pass the same).
            EpLinkError: a rank did not take part in time, or died.
        """
        names = sorted(values)
        if len(names) > 12:
            raise ValueError(f"assert_ranks_agree takes at most 12 values, got {len(names)}")
        words = [zlib.crc32("\0".join(names).encode())] + [check_u32(name, values[name]) for name in names]
        everyone = self._gather(words, "checking that the ranks agree")
        differ = disagreement_of_values(["the names of the values", *names], everyone)
        if differ is not None:
            raise EpDivergenceError(f"rank {self._rank}: {differ[0]}", differ[1])

    def _gather(self, words: list[int], doing: str) -> list[list[int]]:
        try:
            return self._transport.gather(words, self._command_timeout)
        except Exception as error:
            raise EpLinkError(f"rank {self._rank}: {doing} failed: {error}") from error

    def _seen(self, failures: list[WorkerFailure]) -> list[WorkerFailure]:
        for failure in failures:
            self._reports_seen[failure.rank] += 1
        return failures

    def check_workers(self, timeout: float = 0.0) -> None:
        """Head: raise why workers stopped, if they reported a failure or their process (on this host) exited.

        For a model whose own collective failed, which tells only that some peer is
        gone (``metrale_model_engine.torch.Collectives`` and
        :meth:`~metrale_model_engine.EpLink.collective_failed` do it for you): this
        names the ranks and, where their reports arrived, the reason.  It looks until
        it finds something or ``timeout`` seconds have passed (a worker that just
        failed takes a moment to exit), and returns when it found nothing: no worker
        stopped, or the one that did runs on another host and sent no report.  A
        no-op on one rank.

        Raises:
            EpWorkerFailed: workers reported failed commands (each report once), none
                of which stopped the run.
            RunStopped: a worker reported a failure that stopped the run, or worker
                ranks on this host have exited (the message names them); the link
                is closed.
            EpRoleError: called on a worker.
            TypeError, ValueError: ``timeout`` is not a number of seconds ``>= 0``.
        """
        self._require_head()
        limit = check_seconds("timeout", timeout, allow_zero=True)
        assert limit is not None
        failures, exited = self._stopped_workers(limit)
        if exited or any(failure.stopped for failure in failures):
            raise self._stop(
                RunStopped(f"head: the run stopped: {self._why_stopped(failures, exited)}", failures, exited)
            )
        if failures:
            raise EpWorkerFailed(failures)

    def _stopped_workers(self, limit: float) -> tuple[list[WorkerFailure], list[int]]:
        """The reports not seen yet and the worker ranks that exited; looks up to ``limit`` seconds for either."""
        deadline = time.monotonic() + limit
        while self._world_size > 1:
            exited = self._exited_workers()  # first: a report written before the exit is in the ring by now
            failures = self._poll_reports()
            if failures or exited or time.monotonic() >= deadline:
                return failures, exited
            time.sleep(_CHECK_PAUSE)
        return [], []

    def _why_stopped(self, failures: Sequence[WorkerFailure], exited: Sequence[int]) -> str:
        """The reason a run stopped, as the head knows it: first-hand reports, the ranks that exited, witnesses.

        A witness (a worker whose collective failed) may only have seen another rank's
        failure: its report comes last, and when nothing else is known, the ranks
        that said nothing are named.
        """
        reasons = [str(failure) for failure in failures if not failure.witness]
        if exited:
            reasons.append(
                f"worker rank(s) {list(exited)} exited (died or left the run) after command {self._commands}"
            )
        witnesses = [failure for failure in failures if failure.witness]
        reasons += [str(failure) for failure in witnesses]
        silent = [rank for rank in range(1, self._world_size) if rank not in {f.rank for f in witnesses}]
        if witnesses and len(reasons) == len(witnesses) and silent:
            reasons.append(f"rank(s) {silent} said nothing (they stall, skipped their forward, or left)")
        return "; ".join(reasons)

    def _watch_workers(self, pids: Mapping[int, int]) -> None:
        """Head: watch the worker processes ``{rank: pid}`` of this host, for :meth:`check_workers`."""
        self._workers = ProcessWatch()
        self._worker_ranks = {pid: rank for rank, pid in pids.items()}
        for pid in pids.values():
            self._workers.add(pid)

    def _stop_watching(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def _exited_workers(self) -> list[int]:
        if self._workers is None:
            return []
        return sorted(self._worker_ranks[pid] for pid in self._workers.dead())

    def _halted_workers(self) -> list[int]:
        """The worker ranks of this host whose process is stopped (a signal, a debugger)."""
        if self._workers is None:
            return []
        return sorted(self._worker_ranks[pid] for pid in self._workers.halted())

    def _poll_reports(self) -> list[WorkerFailure]:
        """The failures the workers reported since the last look (each counted as seen)."""
        failures: list[WorkerFailure] = []
        try:
            for rank, answer in self._transport.poll_answers():
                found, _ = read_answers(rank, [answer])
                failures += self._seen(found)
        except WireError as error:
            raise EpLinkError(f"head: a corrupt answer: {error}") from None
        except Exception as error:
            raise EpLinkError(f"head: reading the workers' answers failed: {error}") from error
        return failures

    def _raise_reports(self) -> None:
        """Raise what the workers reported since the last look, before the command being sent goes out."""
        failures = self._poll_reports()
        if any(failure.stopped for failure in failures):
            why = self._why_stopped(failures, [])
            raise self._stop(
                RunStopped(f"head: the run stopped: {why}; nothing of the command being sent was sent", failures)
            )
        if failures:
            raise EpWorkerFailed(failures, "; nothing of the command being sent was sent")
