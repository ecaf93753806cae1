"""The head's sends: its checks of a command before it goes, and ``HeadSender``, the one path every message takes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from typing_extensions import Buffer

from .._core.codec import encode_close, encode_header
from .._core.errors import EpError, EpLinkError, EpRoleError, EpSendError, RunStopped
from .._core.tokens import as_u32_buffer
from .._core.transport import EpTransport, TransportClosed, TransportCorrupt, TransportTimeout
from .._core.words import CMD_SHUTDOWN, U32_MAX, check_u32
from .reports import DEATH_GRACE, WorkerReports
from .run_state import CommandStream, ForwardScope, RunState
from .settings import LinkSettings

_CLOSE_TIMEOUT: Final[float] = 1.0
"""Seconds the head's close waits to tell the workers it closed (best effort)."""
_LOGGER = logging.getLogger("metrale_model_engine.link")


class HeadSender:
    """The head's side of the stream: a command starts once the workers' pending reports are raised.

    Args:
        transport, settings, stream, run, scope: the link's parts.
        reports: the head's reading of its workers' reports (``None`` on a worker,
            whose every send raises ``EpRoleError``).
        closed: whether the link was closed.
    """

    __slots__ = (
        "_answers_ready",
        "_closed",
        "_reports",
        "_run",
        "_scope",
        "_send",
        "_settings",
        "_stream",
        "shut_down",
    )

    def __init__(
        self,
        transport: EpTransport,
        settings: LinkSettings,
        stream: CommandStream,
        run: RunState,
        scope: ForwardScope,
        reports: WorkerReports | None,
        closed: Callable[[], bool],
    ) -> None:
        self._send = transport.send  # the hot paths call these bound methods
        self._answers_ready = transport.answers_ready
        self._settings = settings
        self._stream = stream
        self._run = run
        self._scope = scope
        self._reports = reports
        self._closed = closed
        self.shut_down = False
        """Whether the shutdown header went out: every later send raises."""

    def tell_closed(self) -> None:
        """Head, closing before the shutdown: tell the workers, so that their next receive raises at once.

        Best effort, within a second (once the run stopped, without waiting: workers
        may be inside a collective); a failure is only logged.
        """
        settings = self._settings
        if settings.rank or self.shut_down or settings.world_size == 1:
            return
        timeout = min(_CLOSE_TIMEOUT, settings.command_timeout or _CLOSE_TIMEOUT)
        try:
            self._send((encode_close(),), 0.0 if self._run.stopped is not None else timeout)
        except Exception as error:  # noqa: BLE001  (the workers may be gone: the transport's close is what is left)
            _LOGGER.debug("the head could not tell its workers that it closed: %s", error)

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
            self.shut_down = True

    def require_head(self) -> None:
        """Raise ``EpRoleError`` on a worker."""
        if self._settings.rank:
            raise EpRoleError(f"only the head (rank 0) sends; this is worker rank {self._settings.rank}")

    def start(self, seq_id: int, cmd: int, message: Sequence[Buffer]) -> None:
        """Send a command's first message, once what the workers reported is raised; count the command."""
        self.require_head()
        if self._answers_ready():
            assert self._reports is not None
            self._reports.raise_pending()
        self.send(message)
        self._stream.begin(seq_id, cmd)
        self._scope.begin(False)  # the head declares its forward's collectives with collective() blocks

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send one message, the concatenation of ``parts``, and fold it into the stream's digest."""
        if self.shut_down:
            raise EpSendError("the workers were shut down (shutdown_workers); nothing more can be sent")
        if self._closed():
            self._run.raise_if_stopped()
            raise EpSendError("this link was closed; nothing more can be sent")
        try:
            self._send(parts, self._settings.command_timeout)
        except Exception as error:
            raise self._failed(error) from error
        self._stream.add(parts)

    def _failed(self, error: Exception) -> EpSendError | RunStopped:
        """Why a send failed, as far as the head can tell: a worker that stopped the run, or the ranks gone.

        Reports found on the way (ordinary ones too) are in the error's message.
        """
        reports = self._reports
        assert reports is not None
        ours = isinstance(error, (EpError, TransportClosed, TransportTimeout, TransportCorrupt))
        lost, ranks = reports.lost()
        failures, exited = reports.stopped_workers(0.0 if ours or lost else DEATH_GRACE)
        if lost:
            return reports.stop(lost, failures, [*ranks, *exited], note="; the send failed")
        why = reports.why(failures, exited) or reports.silence()
        if any(failure.stopped for failure in failures):
            return reports.stop(why, failures, exited, note="; the send failed")
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
        TypeError, ValueError: as :func:`follow_up_array`, or a word that is not a u32.
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
