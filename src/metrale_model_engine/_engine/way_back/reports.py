"""``WorkerReports``: the head's view of its workers: their reports of failed commands, and which have stopped."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Final

from ..._core.checks import check_seconds
from ..._core.codec import WireError
from ..._core.errors import EpLinkError, EpWorkerFailed, RunStopped, WorkerFailure, error_text
from ..._core.transport import NamesLostRanks, NamesSilentRanks
from ..._host.liveness import ProcessWatch, exit_status, process_state
from ..run_state import LinkParts
from .answers import read_answers

EXIT_GRACE: Final = 5.0
"""Seconds the head looks for the worker behind a failed collective (a failing worker takes a moment to exit)."""
DEATH_GRACE: Final = 0.2
"""Seconds a failure the backend raised looks for the worker behind it: a killed worker's sockets close a
moment before its process shows as exited (the kernel closes its files first), and a report a worker left
in a group's store is read at most every 10 ms."""
_CHECK_PAUSE: Final = 0.001
"""Seconds between two looks of ``WorkerReports.stopped_workers``."""
_NOT_SENT: Final = "; nothing of the command being sent was sent"


class WorkerReports:
    """The head's reading of its workers' reports, and its watch of the worker processes of its host.

    Every report is counted once, by worker (a sync point checks that none was
    lost); the worker processes of the head's host (their pids travel in the setup
    exchange) are watched with pidfds, so that the head can name the ranks that
    exited or are stopped.

    Args:
        parts: the link's parts.
        pids: the pid of every worker on the head's host, by rank.
    """

    __slots__ = ("_pids", "_ranks", "_seen", "_settings", "_state", "_stream", "_transport", "_watch")

    def __init__(self, parts: LinkParts, pids: Mapping[int, int]) -> None:
        self._transport, self._settings, self._stream, self._state, _ = parts
        self._seen = [0] * self._settings.world_size  # by rank: failures the head has read
        self._watch: ProcessWatch | None = ProcessWatch()
        self._pids = dict(pids)
        self._ranks = {pid: rank for rank, pid in pids.items()}
        for pid in pids.values():
            self._watch.add(pid)

    def seen(self, failures: list[WorkerFailure]) -> list[WorkerFailure]:
        """Count ``failures`` as read; return them."""
        for failure in failures:
            self._seen[failure.rank] += 1
        return failures

    def seen_count(self, rank: int) -> int:
        """How many reports of worker ``rank`` the head has read."""
        return self._seen[rank]

    def poll(self) -> list[WorkerFailure]:
        """The failures the workers reported since the last look (each counted as read).

        Raises:
            EpLinkError: an answer is corrupt, or reading the answers failed.
        """
        failures: list[WorkerFailure] = []
        try:
            for rank, answer in self._transport.poll_answers():
                found, _ = read_answers(rank, [answer])
                failures += self.seen(found)
        except WireError as error:
            raise EpLinkError(f"head: a corrupt answer: {error}") from None
        except Exception as error:
            raise EpLinkError(f"head: reading the workers' answers failed: {error}") from error
        return failures

    def raise_pending(self) -> None:
        """Raise what the workers reported since the last look: the command being sent is not sent.

        Raises:
            RunStopped: a report stopped the run.
            EpWorkerFailed: ordinary failed commands.
        """
        failures = self.poll()
        if any(failure.stopped for failure in failures):
            raise self.stopped_by(failures, note=_NOT_SENT)
        if failures:
            raise EpWorkerFailed(failures, _NOT_SENT)

    def stopped_by(self, failures: list[WorkerFailure], *, note: str = "", where: str = "") -> RunStopped:
        """Reports that stop the run arrived (``failures``): stop it, naming the ranks that exited too (a moment
        more for them when the reports are all witnesses'); return the ``RunStopped`` to raise."""
        failures, exited = self.stopped_workers(DEATH_GRACE, failures)
        return self.stop(self.why(failures, exited), failures, exited, note=note, where=where)

    def check(self, timeout: object) -> None:
        """``EpLink.check_workers``: raise why workers stopped, looking up to ``timeout`` seconds."""
        limit = check_seconds("timeout", timeout, allow_zero=True)
        assert limit is not None
        failures, exited = self.stopped_workers(limit)
        if exited or any(failure.stopped for failure in failures):
            raise self.stop(self.why(failures, exited), failures, exited)
        if failures:
            raise EpWorkerFailed(failures)

    def stopped_workers(
        self, limit: float, found: Sequence[WorkerFailure] = ()
    ) -> tuple[list[WorkerFailure], list[int]]:
        """The reports not read yet (after ``found``, read already) and the worker ranks that exited; looks up to
        ``limit`` seconds for either.

        Reports of witnesses alone (workers whose collective failed: they saw another
        rank's failure) do not end the look at once: it goes on up to ``DEATH_GRACE``
        more (within ``limit``) for the rank behind them, whose exit may show a moment
        after its sockets closed (its other threads still ending).
        """
        deadline = time.monotonic() + limit
        failures = list(found)
        while self._settings.world_size > 1:
            exited = self.exited()  # first: a report written before the exit is in by now
            failures += self.poll()
            now = time.monotonic()
            if exited or any(not failure.witness for failure in failures) or now >= deadline:
                return failures, exited
            if failures:
                deadline = min(deadline, now + DEATH_GRACE)
            time.sleep(_CHECK_PAUSE)
        return [], []

    def stop(
        self, why: str, failures: Sequence[WorkerFailure], ranks: Sequence[int], *, note: str = "", where: str = ""
    ) -> RunStopped:
        """Stop the run for ``why``; return the ``RunStopped`` to raise (the link closes once the call is over)."""
        return self._state.stop(RunStopped(f"head: the run stopped{where}: {why}{note}", failures, ranks))

    def why(self, failures: Sequence[WorkerFailure], exited: Sequence[int]) -> str:
        """Why a run stopped, as the head knows it: first-hand reports, the ranks that exited (and how), witnesses.

        A witness (a worker whose collective failed) may only have seen another rank's
        failure: its report comes last.  Where a first-hand report or a rank that
        exited explains the stop, a witness that lives on is said to have witnessed it,
        not to have failed its command; it is named as failing when it is all that is
        known, or when its rank exited (its last word).  When nothing else is
        known (no first-hand report, no rank that exited but the witnesses, which leave
        after they report), the ranks that said nothing are named.
        """
        first_hand = [str(failure) for failure in failures if not failure.witness]
        reasons = list(first_hand)
        if exited:
            reasons.append(
                f"worker rank(s) {list(exited)} exited (died or left the run) after command "
                f"{self._stream.commands}{self.ended(exited)}"
            )
        witnesses = [failure for failure in failures if failure.witness]
        reasons += [str(failure) for failure in witnesses if failure.rank in exited]
        alive = [failure for failure in witnesses if failure.rank not in exited]
        caused = any(rank not in {failure.rank for failure in witnesses} for rank in exited)
        if first_hand or caused:
            reasons += [f"worker rank {failure.rank} only witnessed it ({failure.error})" for failure in alive]
        else:
            reasons += [str(failure) for failure in alive]
        seen = {failure.rank for failure in witnesses}
        silent = [rank for rank in range(1, self._settings.world_size) if rank not in seen and rank not in exited]
        if witnesses and not first_hand and not caused and silent:
            reasons.append(f"rank(s) {silent} said nothing (they stall, skipped their forward, or left)")
        return "; ".join(reasons)

    def ended(self, ranks: Sequence[int]) -> str:
        """How the worker ``ranks`` of the head's host that exited ended, as a clause (``" (rank 3 was killed by
        SIGKILL)"``); empty where none can be told (not of this host, or reaped by its parent already)."""
        told = [f"rank {rank} {how}" for rank in ranks if (how := self.how(rank))]
        return f" ({'; '.join(told)})" if told else ""

    def how(self, rank: int) -> str:
        """How worker ``rank`` of the head's host ended (``"was killed by SIGKILL"``); ``""`` where unknown."""
        return exit_status(self._pids.get(rank, 0))

    def silent(self) -> list[int]:
        """The worker ranks whose transport says they went silent (see ``NamesSilentRanks``); waits a moment."""
        transport = self._transport
        return transport.silent_ranks() if isinstance(transport, NamesSilentRanks) else []

    def silence(self) -> str:
        """``silent`` as the clause an error ends with (those of the head's host that exited, as such).

        Empty when none went silent.
        """
        ranks = self.silent()
        exited = [rank for rank in self.exited() if rank in ranks]
        quiet = [rank for rank in ranks if rank not in exited]
        return "; ".join(filter(None, [self.why((), exited), silent_text(quiet) if quiet else ""]))

    def lost(self) -> tuple[str, list[int]]:
        """The workers the transport found lost (silent past ``head_lost_after`` while the head waited on them):
        the clause that names them and how long each was silent, and their ranks; ``("", [])`` when none is."""
        transport = self._transport
        lost = transport.lost_ranks() if isinstance(transport, NamesLostRanks) else {}
        if not lost:
            return "", []
        each = ", ".join(f"{seconds:.1f} s (rank {rank})" for rank, seconds in sorted(lost.items()))
        clause = (
            f"worker rank(s) {sorted(lost)} are lost: no heartbeat for {each}, past head_lost_after "
            "(their host is unreachable, or they died)"
        )
        return clause, sorted(lost)

    def exited(self) -> list[int]:
        """The worker ranks of the head's host whose process has exited.

        By their pidfds, and by their state: a process killed with many threads is a
        zombie (its main thread gone, its sockets closed) a moment before its pidfd
        tells, while its other threads end.
        """
        if self._watch is None:
            return []
        dead = set(self._watch.dead())
        dead.update(pid for pid in self._ranks if pid not in dead and process_state(pid) == "Z")
        return sorted(self._ranks[pid] for pid in dead)

    def halted(self) -> list[int]:
        """The worker ranks of the head's host whose process is stopped (a signal, a debugger)."""
        if self._watch is None:
            return []
        return sorted(self._ranks[pid] for pid in self._watch.halted())

    def close(self) -> None:
        """Stop watching the worker processes (release the pidfds).  Idempotent."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def forward_failed(self, error: BaseException) -> RunStopped:
        """The head's forward failed inside ``EpLink.collective()`` with ``error``: stop the run; return what to raise.

        Its workers first, as ``collective_failed`` does: one that reported a
        failure that stops the run, or exited, is named, since the head's error may
        be only what its leaving caused (an all-reduce the model ran itself, failed
        with "Connection closed by peer"); else the head's own error.
        """
        where = self._stream.described()
        failures, exited = self.stopped_workers(DEATH_GRACE)
        if exited or any(failure.stopped for failure in failures):
            return self.stop(self.why(failures, exited), failures, exited, where=f" in {where}")
        return self.stop(f"its own forward of {where} failed: {error_text(error)}", failures, ())

    def collective_failed(self, error: BaseException, what: str, grace: object) -> RunStopped:
        """``EpLink.collective_failed`` on the head: look for the worker behind it, stop the run, name it."""
        where = self._stream.described()
        limit = check_seconds("grace", grace, allow_zero=True)
        assert limit is not None
        lost, ranks = self.lost()
        if lost:  # its wait ended because they are: no grace to wait
            failures, exited = self.stopped_workers(0.0)
            return self.stop(f"{what} failed: {lost}", failures, [*ranks, *exited], where=f" in {where}")
        halted = self.halted()  # a worker that cannot run will not report or exit: no grace to wait
        failures, exited = self.stopped_workers(0.0 if halted else limit)
        silent = [] if failures or exited or halted else self.silent()
        if failures or exited:
            why = self.why(failures, exited)
        elif silent:
            exited = silent
            why = f"{what} failed ({error_text(error)}): {silent_text(silent)}"
        elif halted:
            exited = halted
            why = f"{what} failed ({error_text(error)}): worker rank(s) {halted} are stopped (a signal, a debugger)"
        else:
            why = (
                f"{what} failed ({error_text(error)}), and no worker reported a failure or exited within {limit:g} s "
                "(a worker that stalls or skipped its forward, or one on another host)"
            )
        return self.stop(why, failures, exited, where=f" in {where}")


def silent_text(ranks: Sequence[int]) -> str:
    """What the head says of workers that went silent."""
    return f"no heartbeat from worker rank(s) {list(ranks)} (their host is unreachable, or they died)"
