"""``HeadSender``: the head's sends, each one call: the checks, the encoding chosen, the one way every message goes."""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from typing import Final

from typing_extensions import Buffer

from .._core.codec import (
    encode_close,
    encode_command,
    encode_header,
    encode_plain_command,
    encode_tokens_prefix,
    encode_word,
)
from .._core.errors import EpError, EpLinkError, EpSendError, RunStopped, command_word
from .._core.tokens import TokenArray, as_u32_buffer, token_count
from .._core.transport import TransportClosed, TransportCorrupt, TransportTimeout
from .._core.words import CMD_SHUTDOWN, U32_MAX, check_u32
from .run_state import LinkParts, Phase
from .settings import LinkSettings
from .way_back.reports import DEATH_GRACE, WorkerReports

_CLOSE_TIMEOUT: Final[float] = 1.0
"""Seconds the head's close waits to tell the workers it closed (best effort)."""
_LOGGER = logging.getLogger("metrale_model_engine.link")


class HeadSender:
    """The head's sends: every check first, the encoding chosen, then the one path every message takes.

    ``EpLink``'s sends state the contract.  A command starts once what the workers
    reported is raised (the transport's cheap ``answers_ready`` says whether to look),
    and once the head entered the forward it owes (``forward_skipped``).

    Args:
        parts: the link's parts.
        reports: the head's reading of its workers' reports.
    """

    __slots__ = (
        "_answers_ready",
        "_declared",
        "_owed",
        "_reports",
        "_scope",
        "_send",
        "_settings",
        "_state",
        "_stream",
        "stops_on_loss",
    )

    def __init__(self, parts: LinkParts, reports: WorkerReports) -> None:
        transport, self._settings, self._stream, self._state, self._scope = parts
        self._send = transport.send  # the hot paths call these bound methods
        self._answers_ready = transport.answers_ready
        self._reports = reports
        self._owed: Container[int] = frozenset()
        self._declared = False
        self.stops_on_loss = False
        """A send that fails because workers are gone (exited, silent) stops the run (its model re-forms the link)."""

    def owed_words(self, words: Container[int], *, declared: bool) -> None:
        """The command words whose forward the head owes (they run collectives): ``declared`` by the model's
        ``ep_collective_commands``, else learned from its ``collective()`` blocks (``words`` grows)."""
        self._owed = words
        self._declared = declared

    def send_command(self, seq_id: int, cmd: int, follow_ups: Sequence[int | TokenArray]) -> None:
        """``EpLink.send_command``: the command and its follow-ups, as one message."""
        seq_id, cmd = checked_header(self._settings, seq_id, cmd)
        plain = encode_plain_command(seq_id, cmd, follow_ups)
        message = encode_command(seq_id, cmd, checked_follow_ups(follow_ups)) if plain is None else (plain,)
        self._start(seq_id, cmd, message)

    def send_header(self, seq_id: int, cmd: int) -> None:
        """``EpLink.send_header``: the header that starts a command, alone."""
        seq_id, cmd = checked_header(self._settings, seq_id, cmd)
        self._start(seq_id, cmd, (encode_header(seq_id, cmd),))

    def send_word(self, word: int) -> None:
        """``EpLink.send_word``: one follow-up word of the command in flight."""
        if type(word) is not int or word >> 32:
            word = check_u32("word", word)
        self.send((encode_word(word),))

    def send_tokens(self, tokens: TokenArray) -> Buffer:
        """``EpLink.send_tokens``: one follow-up token array; return the u32 buffer sent."""
        buffer = as_u32_buffer("tokens", tokens)
        self.send((encode_tokens_prefix(token_count(buffer)), buffer))
        return buffer

    def shutdown(self, failure: BaseException | None) -> None:
        """Send the shutdown header; every later send raises.

        ``failure``: what the sync point before it raised, the error to raise then.
        The header still goes out, best effort (a failure is only logged), and
        without waiting when the link itself failed (a worker dead, silent or lost).
        """
        message = (encode_header(0, CMD_SHUTDOWN),)
        try:
            if failure is None:
                self.send(message)
            elif isinstance(failure, EpLinkError):
                self._send(message, 0.0)
            else:  # the workers answered: they are in step, and wait for it
                self._send(message, self._settings.command_timeout)
        except Exception as error:
            if failure is None:
                raise
            _LOGGER.debug("the head could not send the shutdown header after a failed sync point: %s", error)
        finally:
            self._state.phase = Phase.SHUT_DOWN

    def tell_closed(self) -> None:
        """The head closes before the shutdown: tell the workers, so that their next receive raises at once.

        Best effort, within a second (once the run stopped, without waiting: workers
        may be inside a collective); a failure is only logged.
        """
        settings = self._settings
        if self._state.phase is Phase.SHUT_DOWN or settings.world_size == 1:
            return
        timeout = min(_CLOSE_TIMEOUT, settings.command_timeout or _CLOSE_TIMEOUT)
        try:
            self._send((encode_close(),), 0.0 if self._state.stopped is not None else timeout)
        except Exception as error:  # noqa: BLE001  (the workers may be gone: the transport's close is what is left)
            _LOGGER.debug("the head could not tell its workers that it closed: %s", error)

    def _start(self, seq_id: int, cmd: int, message: Sequence[Buffer]) -> None:
        """Send a command's first message, once the forward owed and what the workers reported are raised."""
        scope = self._scope
        if scope.due:
            raise self.forward_skipped("sent the next command")
        if self._answers_ready():
            self._reports.raise_pending()
        self.send(message)
        self._stream.begin(seq_id, cmd)
        scope.begin(False, cmd in self._owed)  # its collectives run in collective() blocks, never declared

    def forward_skipped(self, doing: str) -> RunStopped:
        """The head owes the forward of the command in flight and ``doing`` instead: stop the run; return the error.

        Its workers wait in that forward's collectives, where a later forward of the head
        would meet them off by one; so it is refused before anything more is sent.
        """
        self._scope.due = False  # settled: the run stops here, and later calls say it stopped earlier
        stream = self._stream
        word = command_word(stream.command[1])
        why = "ep_collective_commands declares it" if self._declared else "its earlier forwards ran them"
        return self._state.stop(
            RunStopped(
                f"head: the run stopped in {stream.described()}: the head {doing} without running its forward: "
                f"the forward of cmd {word} runs collectives ({why}), which the workers wait in; run the head's "
                f"forward of every cmd {word} inside `with link.collective():` (an empty one says "
                "link.empty_forward())"
            )
        )

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send one message, the concatenation of ``parts``, and fold it into the stream's digest."""
        state = self._state
        if state.phase is not Phase.OPEN or state.closed:
            raise self._refused()
        try:
            self._send(parts, self._settings.command_timeout)
        except Exception as error:
            raise self._failed(error) from error
        self._stream.add(parts)

    def _refused(self) -> EpSendError | RunStopped:
        """Why nothing more can be sent: the workers were shut down, the run stopped, or the link closed."""
        state = self._state
        if state.phase is Phase.SHUT_DOWN:
            return EpSendError("the workers were shut down (shutdown_workers); nothing more can be sent")
        if state.stopped is not None:
            return state.still_stopped()
        return EpSendError("this link was closed; nothing more can be sent")

    def _failed(self, error: Exception) -> EpSendError | RunStopped:
        """Why a send failed, as far as the head can tell: a worker that stopped the run, or the ranks gone.

        Reports found on the way (ordinary ones too) are in the error's message.
        """
        reports = self._reports
        ours = isinstance(error, (EpError, TransportClosed, TransportTimeout, TransportCorrupt))
        lost, ranks = reports.lost()
        failures, exited = reports.stopped_workers(0.0 if ours or lost else DEATH_GRACE)
        if lost:
            return reports.stop(lost, failures, [*ranks, *exited], note="; the send failed")
        why = reports.why(failures, exited) or reports.silence()
        if any(failure.stopped for failure in failures):
            return reports.stop(why, failures, exited, note="; the send failed")
        gone = exited or (reports.silent() if self.stops_on_loss else [])
        if self.stops_on_loss and gone:  # a lost worker: the run stops, and the link re-forms without it
            return reports.stop(why, failures, gone, note=f"; the send failed: {error}")
        return EpSendError(f"head: broadcast to the workers failed: {error}" + (f"; {why}" if why else ""))


def checked_header(settings: LinkSettings, seq_id: int, cmd: int) -> tuple[int, int]:
    """``(seq_id, cmd)`` as the header carries them (``seq_id`` 0 when it is left off the wire).

    Raises:
        TypeError, ValueError: a word is not a u32, ``seq_id >= num_slots``, or ``cmd``
            is the reserved shutdown word.
    """
    if type(seq_id) is not int or seq_id >> 32:
        seq_id = check_u32("seq_id", seq_id)
    if type(cmd) is not int or cmd >> 32:
        cmd = check_u32("cmd", cmd)
    slots = settings.num_slots
    if seq_id >= slots:
        raise ValueError(f"seq_id={seq_id} is out of range for {slots} slots (0 ..= {slots - 1})")
    if cmd == CMD_SHUTDOWN:
        raise ValueError(
            f"cmd={CMD_SHUTDOWN:#x} is the reserved shutdown word; call ep_link.shutdown_workers() to stop the workers"
        )
    return (seq_id if settings.seq_id_on_wire else 0), cmd


def checked_follow_ups(follow_ups: Sequence[object]) -> list[int | Buffer]:
    """A command's follow-ups, each a u32 word or a token array (converted once), checked.

    Raises:
        TypeError, ValueError: as ``follow_up_array``, or a word that is not a u32.
    """
    items: list[int | Buffer] = []
    for index, follow_up in enumerate(follow_ups):
        if isinstance(follow_up, int):
            fast = type(follow_up) is int and not follow_up >> 32
            items.append(follow_up if fast else check_u32(f"follow_ups[{index}]", follow_up))
        else:
            items.append(follow_up_array(index, follow_up))
    return items


def follow_up_array(index: int, value: object) -> Buffer:
    """Follow-up ``index`` of a command that is not an int: a token array, converted and checked.

    Raises:
        TypeError, ValueError: it is neither a u32 word nor a token array, or a token
            is not a u32 (the message names ``follow_ups[index]``).
    """
    name = f"follow_ups[{index}]"
    try:
        return as_u32_buffer(name, value)  # type: ignore[arg-type]  # any object: TypeError below
    except TypeError:
        if isinstance(value, Sequence):
            raise
        try:
            memoryview(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            raise
    raise TypeError(
        f"{name} must be a u32 word (an int in 0 ..= {U32_MAX}) or a token array, got {type(value).__name__} {value!r}"
    )
