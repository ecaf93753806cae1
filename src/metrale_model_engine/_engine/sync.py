"""``SyncPoints``: the head's sync points; and the values every rank can check that all ranks agree on."""

from __future__ import annotations

import zlib
from typing import Final

from .._core.codec import Ack, WireError, encode_sync
from .._core.errors import EpDivergenceError, EpLinkError, EpWorkerFailed, RunStopped, WorkerFailure
from .._core.transport import GATHER_WORDS, EpTransport, PretendGroup
from .._core.words import check_u32
from .agreement import HeadFigures, differences, disagreement_of_values
from .run_state import LinkParts
from .sender import HeadSender
from .settings import LinkSettings
from .way_back.answers import read_answers
from .way_back.reports import WorkerReports

AGREED_VALUES: Final = GATHER_WORDS - 1
"""How many named values ``EpLink.assert_ranks_agree`` compares at once: a gather's words, less one for the names."""


class SyncPoints:
    """The head's sync points (``EpLink.sync`` states the contract).

    Args:
        parts: the link's parts.
        sender: the head's sends (a sync item goes the way every message goes).
        reports: the head's reading of its workers' reports.
    """

    __slots__ = ("_agreed", "_number", "_reports", "_scope", "_sender", "_settings", "_stream", "_transport")

    def __init__(self, parts: LinkParts, sender: HeadSender, reports: WorkerReports) -> None:
        self._transport, self._settings, self._stream = parts.transport, parts.settings, parts.stream
        self._scope = parts.scope
        self._sender = sender
        self._reports = reports
        self._number = 0  # sync points sent
        self._agreed = 0  # commands sent by the last sync point where every rank agreed

    def sync(self, mine: int | None) -> None:
        """``EpLink.sync``, comparing state digests when ``mine`` (the head's) is given."""
        if self._scope.due:
            raise self._sender.forward_skipped("reached a sync point")
        reports = self._reports
        self._number += 1
        number = self._number
        if isinstance(self._transport, PretendGroup):
            self._transport.pretend_state(mine)
        self._sender.send((encode_sync(number, mine is not None),))
        failures: list[WorkerFailure] = []
        acks: dict[int, Ack] = {}
        for rank in range(1, self._settings.world_size):
            while rank not in acks:
                try:
                    answers = self._transport.receive_answers(rank, self._settings.command_timeout)
                    found, answered = read_answers(rank, answers)
                except WireError as error:
                    raise EpLinkError(f"head: a corrupt answer at sync point {number}: {error}") from None
                except Exception as error:
                    raise self._failed_waiting(reports, number, rank, error, failures) from error
                failures += reports.seen(found)
                if any(failure.stopped for failure in found):  # that worker left: no acknowledgement will come
                    raise reports.stopped_by(failures)
                acks.update((rank, ack) for ack in answered if ack.number == number)
        stream = self._stream
        differ = differences(HeadFigures(number, stream.commands, stream.crc, mine, self._agreed), acks)
        lost = [rank for rank, ack in acks.items() if ack.reports != reports.seen_count(rank)]
        if lost:
            raise EpLinkError(f"head: reports of worker rank(s) {lost} were lost on the way (a transport fault)")
        if failures:
            raise EpWorkerFailed(failures, f"; at sync point {number}: {differ[0]}" if differ else "")
        if differ is not None:
            raise EpDivergenceError(*differ)
        self._agreed = stream.commands

    def _failed_waiting(
        self, reports: WorkerReports, number: int, rank: int, error: Exception, failures: list[WorkerFailure]
    ) -> RunStopped:
        """Sync point ``number`` failed waiting for worker ``rank`` (``error``): stop the run, naming why.

        A worker that does not answer in time (or at all) leaves the head unable to
        know what it ran: the run cannot go on.  Workers the transport found lost
        are named as such; then the workers of the head's host that exited (the rank
        that did not answer may have left its wait as the run stopped); else the rank
        that did not answer, whether it exited, and the workers whose heartbeat stopped.
        """
        where = f" at sync point {number}"
        lost, ranks = reports.lost()
        if lost:
            return reports.stop(lost, failures, ranks, where=where)
        gone = reports.exited()
        if rank not in gone and gone:  # another worker exited: the cause, and the end of this one's wait
            why = f"{reports.why((), gone)}; worker rank {rank} did not answer: {error}"
            return reports.stop(why, failures, [*gone, rank], where=where)
        how = reports.how(rank)
        exited = f" (it exited: died or left the run{'; it ' + how if how else ''})" if gone else ""
        silent = "" if exited else reports.silence()
        why = f"worker rank {rank} did not answer{exited}: {error}" + (f"; {silent}" if silent else "")
        return reports.stop(why, failures, [rank], where=where)


def gather_u32(transport: EpTransport, settings: LinkSettings, value: int) -> list[int]:
    """``EpLink.gather_u32``: every rank's ``value``, by rank."""
    return [words[0] for words in _gather(transport, settings, [check_u32("value", value)], "gathering a value")]


def assert_ranks_agree(transport: EpTransport, settings: LinkSettings, values: dict[str, int]) -> None:
    """``EpLink.assert_ranks_agree``: raise on every rank unless every rank passed the same named values."""
    names = sorted(values)
    if len(names) > AGREED_VALUES:
        raise ValueError(f"assert_ranks_agree takes at most {AGREED_VALUES} values, got {len(names)}")
    words = [zlib.crc32("\0".join(names).encode())] + [check_u32(name, values[name]) for name in names]
    everyone = _gather(transport, settings, words, "checking that the ranks agree")
    differ = disagreement_of_values(["the names of the values", *names], everyone)
    if differ is not None:
        raise EpDivergenceError(f"rank {settings.rank}: {differ[0]}", differ[1])


def _gather(transport: EpTransport, settings: LinkSettings, words: list[int], doing: str) -> list[list[int]]:
    try:
        return transport.gather(words, settings.command_timeout)
    except Exception as error:
        raise EpLinkError(f"rank {settings.rank}: {doing} failed: {error}") from error
