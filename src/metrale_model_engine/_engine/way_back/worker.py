"""``WorkerWayBack``: a worker's answers to its head: reports of failed commands, refusals that stop the run,
and acknowledgements of sync points (the head reads them in ``reports`` and ``_engine.sync``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableSequence
from typing import Any, Final

from ..._core.codec import Ack, Report, encode_ack, encode_report
from ..._core.errors import (
    EpCommandFailed,
    EpCommandRefused,
    EpLinkError,
    EpReceiveError,
    RunStopped,
    WorkerFailure,
    error_text,
)
from ..run_state import LinkParts

StateDigest = Callable[[Any], int]
"""A digest of a rank's slots, ``digest(slots) -> int`` (u64), compared at sync points (``EpLink.state_digest``)."""

_LOGGER = logging.getLogger("metrale_model_engine.link")
_LEAVE_TIMEOUT: Final = 1.0
"""Seconds a worker that stops the run waits to hand its last report over (best effort)."""


class WorkerWayBack:
    """A worker's way back to the head, for the command in flight (``EpLink`` states the contract).

    Every failed command is reported (``EpTransport.answer``); one that runs
    collectives (``collective``) is refused instead: the report stops the run.
    A sync item is acknowledged with what the worker received (the count of
    commands, the stream's CRC, the reports it sent) and, when asked, its state's
    digest.

    Args:
        parts: the link's parts.
    """

    __slots__ = ("_reports", "_settings", "_state", "_stream", "_transport", "collective", "state_digest")

    def __init__(self, parts: LinkParts) -> None:
        self._transport, self._settings, self._stream, self._state, _ = parts
        self._reports = 0  # failures this worker reported
        self.collective = False
        """The command in flight runs collectives: a failure of it stops the run."""
        self.state_digest: StateDigest | None = None
        """The digest of this rank's slots that sync points ask for (``EpLink.state_digest``)."""

    def failed(self, error: BaseException) -> EpCommandFailed | EpCommandRefused:
        """Report the command in flight as failed by ``error``; return what to raise (see ``collective``)."""
        if self.collective:
            return self.refuse(error)
        self.report(error_text(error))
        return EpCommandFailed(error)

    def report(self, text: str) -> None:
        """Tell the head that the command in flight (its count of them) failed here, and why (``text``)."""
        self._answer(encode_report(self._report(text)))
        self._reports += 1

    def refuse(self, error: BaseException) -> EpCommandRefused:
        """Refuse the command in flight, failed by ``error``, as one that runs collectives (``EpLink.collective``)."""
        return self.refused(error_text(error))

    def refused(self, text: str) -> EpCommandRefused:
        """Refuse the command in flight for ``text``: report it to the head as stopping the run, stop; return it."""
        self.collective = True
        refused = EpCommandRefused(
            f"{self._settings.who}: {self._stream.described()}, which runs collectives, "
            f"failed here, so the run stops on every rank: {text}",
            (WorkerFailure.from_report(self._settings.rank, self._report(text, stopped=True)),),
        )
        self.leave(refused, text)
        return refused

    def witness(self, error: BaseException, what: str) -> RunStopped:
        """A collective (``what``) of the command in flight failed here: report it as a witness, stop; return it."""
        stopped = RunStopped(
            f"{self._settings.who}: the run stopped in {self._stream.described()}: {what} failed, so a rank died, "
            f"left the run or stalls: {error_text(error)}"
        )
        self.leave(stopped, f"{what} failed here: {error_text(error)}", witness=True)
        return stopped

    def leave(self, stopped: RunStopped, text: str, *, witness: bool = False) -> None:
        """Tell the head that the command in flight stopped the run, and why; record the stop.

        The report is best effort, within a second (the head may be gone, or its
        answer ring full); the link's close, which follows, hands it over even where
        reports otherwise wait for a sync point.  ``witness``: this worker's collective failed.
        """
        try:
            self._answer(encode_report(self._report(text, stopped=True, witness=witness)), timeout=_LEAVE_TIMEOUT)
            self._reports += 1
        except EpLinkError as error:
            _LOGGER.debug("%s could not report why the run stopped: %s", self._settings.who, error)
        self._state.stop(stopped)

    def acknowledge(self, number: int, compare_state: bool, slots: MutableSequence[Any]) -> None:
        """Answer sync point ``number`` (with the slots' digest if ``compare_state``), and hand the answers over."""
        digest = self.state_digest(slots) if compare_state and self.state_digest is not None else None
        stream = self._stream
        self._answer(encode_ack(Ack(number, stream.crc, stream.commands, self._reports, digest)))
        try:
            self._transport.flush_answers(self._settings.command_timeout)
        except Exception as error:
            raise EpReceiveError(f"{self._settings.who}: answering sync point {number} failed: {error}") from error

    def _report(self, text: str, *, stopped: bool = False, witness: bool = False) -> Report:
        """The report that the command in flight (the head's count of it, ``seq_id``, ``cmd``) failed for ``text``."""
        return Report(self._stream.commands, *self._stream.command, text, stopped, witness)

    def _answer(self, answer: bytes, *, timeout: float | None = None) -> None:
        try:
            self._transport.answer(answer, self._settings.command_timeout if timeout is None else timeout)
        except Exception as error:
            raise EpReceiveError(f"{self._settings.who}: answering the head failed: {error}") from error
