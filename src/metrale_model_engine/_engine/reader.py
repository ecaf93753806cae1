"""The worker's side of a link: the item stream, the step that runs a command, the receives.

Pull-style: a worker asks for the next header (:meth:`CommandReader.step`) and then
for each follow-up it expects (``recv_word``, ``recv_tokens``...); the reader
decodes the item the request meets and receives the next message only when the
current one is used up, so it reads a command the same way whether the head sent it
as one message or item by item.  A follow-up of another kind or length is an
:class:`EpMismatchError` after the item was consumed (a next command's header is
left for the next step); so is a follow-up asked for past the end of a command sent
as one message, at once.  What a failed command left unread is skipped on the way
to the next header, and what a successful one left unread fails it: at once when it
came as one message, else when the worker meets the next header.

A command the model declared collective (``LinkedEp.ep_collective_commands``) cannot
fail here alone: the other ranks are in, or on their way to, its collectives.  Any
failure of one is a refusal (:class:`EpCommandRefused`): it is reported to the head
as a report that stops the run, and the link refuses every later step.

The way back: every command that fails on a worker is also reported to the head
(``EpTransport.answer``), and a sync item on the stream is answered with what the
worker received (a count of commands and a digest of every message) and, when the
head asks, the digest of its state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, MutableSequence
from typing import Any, NoReturn

from typing_extensions import Buffer

from .._core.checks import check_slot
from .._core.codec import (
    Ack,
    Item,
    ItemKind,
    Report,
    WireError,
    decode_header,
    decode_item,
    decode_tokens,
    decode_word,
    describe_item,
    encode_ack,
    encode_report,
    fold_message,
)
from .._core.errors import (
    EpCommandFailed,
    EpCommandRefused,
    EpLinkError,
    EpMismatchError,
    EpReceiveError,
    EpRoleError,
    RunStopped,
    WorkerFailure,
    describe_command,
    error_text,
)
from .._core.tokens import ArrayInterface, writable_u32_buffer
from .._core.transport import EpTransport
from .._core.words import CMD_SHUTDOWN, U32_TYPECODE
from .model import S
from .run_state import CommandStream, ForwardScope, RunState, ran_no_collective
from .settings import LinkSettings

RunCommand = Callable[[int, int, MutableSequence[S | None]], None]
"""A worker hook: ``run(seq_id, cmd, slots)`` runs one command (``ep_run_command``)."""

StateDigest = Callable[[Any], int]
"""A digest of a rank's slots, ``digest(slots) -> int`` (u64), compared at sync points (``EpLink.state_digest``)."""

_NO_WORDS = memoryview(b"").cast(U32_TYPECODE)
_LOGGER = logging.getLogger("metrale_model_engine.link")
_LEAVE_TIMEOUT = 1.0
"""Seconds a worker that stops the run waits to hand its last report over (best effort)."""
_NO_COMMANDS: frozenset[int] = frozenset()


class CommandReader:
    """A worker's reading of the command stream: the step that runs a command, the follow-ups, the way back.

    Every rank's link has one; on the head its methods raise ``EpRoleError``.

    Args:
        transport, settings, stream, run, scope: the link's parts.
    """

    __slots__ = (
        "_at",
        "_collective",
        "_last_failed",
        "_reports",
        "_run",
        "_scope",
        "_settings",
        "_stream",
        "_transport",
        "_whole",
        "_words",
        "state_digest",
    )

    def __init__(
        self, transport: EpTransport, settings: LinkSettings, stream: CommandStream, run: RunState, scope: ForwardScope
    ) -> None:
        self._transport = transport
        self._settings = settings
        self._stream = stream
        self._run = run
        self._scope = scope
        self._words = _NO_WORDS  # the current message, as u32 words
        self._at = 0  # the index of its next unread word
        self._last_failed = False  # the last command failed: skip what it left unread
        self._whole = False  # the command in flight came as one message, every follow-up in it
        self._collective = False  # the command in flight runs collectives: a failure stops the run
        self._reports = 0  # failures this worker reported
        self.state_digest: StateDigest | None = None
        """The digest of this rank's slots that sync points ask for (``EpLink.state_digest``)."""

    # -- the step ------------------------------------------------------------

    def step(
        self, run: RunCommand[S], slots: MutableSequence[S | None], collective: Container[int] = _NO_COMMANDS
    ) -> bool:
        """Worker: ``EpLink.step``: receive the next header and run its command with ``run(seq_id, cmd, slots)``.

        ``collective`` holds the command words whose forward runs collectives.  What
        it raises, and when, is ``EpLink.step``'s contract.
        """
        if self._settings.rank == 0:
            raise EpRoleError("the step of a command (ep_worker_step) runs on worker ranks; this is the head (rank 0)")
        if self._run.stopped is not None:
            raise self._run.still_stopped()
        if self._at >= len(self._words):
            self._words, self._at = self._receive(None), 0
        header = decode_header(self._words, self._at)
        if header is None:
            header = self._skip_to_header(slots)
        cmd, seq_id, self._at, self._whole = header
        if cmd == CMD_SHUTDOWN:
            return False
        self._stream.begin(seq_id, cmd)
        self._last_failed = True  # until the command returns
        self._collective = cmd in collective
        scope = self._scope
        scope.begin(self._collective)
        try:
            check_slot(seq_id, slots)
            run(seq_id, cmd, slots)
            if self._whole and self._at < len(self._words):
                raise self._left_unread(self._skip_rest())
            if scope.open and scope.declared and scope.ran_none():
                raise self.refused(ran_no_collective(cmd))
        except RunStopped as stopped:
            if self._run.stopped is None:  # the hook refused the command itself: tell the head first
                self.leave(stopped, error_text(stopped))
            raise
        except EpLinkError:
            raise
        except EpCommandFailed as failed:  # the hook tagged it itself
            if self._collective:
                raise self._failed(failed.cause) from failed.cause
            self._report(seq_id, cmd, error_text(failed.cause))
            raise
        except Exception as error:
            raise self._failed(error) from error
        finally:
            self._whole = False  # follow-ups read outside a step wait for the head, as before any command
            scope.open = False
        self._last_failed = False
        return True

    def refuse(self, error: BaseException) -> EpCommandRefused:
        """Refuse the command in flight, failed by ``error``, as one that runs collectives (``EpLink.collective``)."""
        return self.refused(error_text(error))

    def refused(self, text: str) -> EpCommandRefused:
        """Refuse the command in flight for ``text``: report it to the head as stopping the run, stop; return it."""
        self._collective = True
        seq_id, cmd = self._stream.command
        number = self._stream.commands
        failure = WorkerFailure(self._settings.rank, number, seq_id, cmd, text, stopped=True)
        refused = EpCommandRefused(
            f"{self._settings.who}: {describe_command(number, seq_id, cmd)}, which runs collectives, "
            f"failed here, so the run stops on every rank: {text}",
            (failure,),
        )
        self.leave(refused, text)
        return refused

    def _failed(self, error: BaseException) -> EpCommandFailed | EpCommandRefused:
        """Report the command in flight as failed by ``error``; return what to raise.

        A command that runs collectives is refused: the report stops the run, and so
        does the :class:`EpCommandRefused` returned.
        """
        if self._collective:
            return self.refuse(error)
        self._report(*self._stream.command, error_text(error))
        return EpCommandFailed(error)

    def witness(self, error: BaseException, what: str) -> RunStopped:
        """A collective (``what``) of the command in flight failed here: report it as a witness, stop; return it."""
        where = describe_command(self._stream.commands, *self._stream.command)
        stopped = RunStopped(
            f"{self._settings.who}: the run stopped in {where}: {what} failed, so a rank died, "
            f"left the run or stalls: {error_text(error)}"
        )
        self.leave(stopped, f"{what} failed here: {error_text(error)}", witness=True)
        return stopped

    def leave(self, stopped: RunStopped, text: str, *, witness: bool = False) -> None:
        """Worker: tell the head that the command in flight stopped the run, and why; stop; close the link.

        The report is best effort, within a second (the head may be gone, or its
        answer ring full); closing the link hands it over even where reports
        otherwise wait for a sync point.  ``witness``: this worker's collective failed.
        """
        try:
            report = Report(self._stream.commands, *self._stream.command, text, True, witness)
            self._answer(encode_report(report), timeout=_LEAVE_TIMEOUT)
            self._reports += 1
        except EpLinkError as error:
            _LOGGER.debug("%s could not report why the run stopped: %s", self._settings.who, error)
        self._run.stop(stopped)

    def _skip_rest(self) -> list[str]:
        """Consume the items left in the current message; describe each."""
        skipped = []
        while self._at < len(self._words):
            item = self._peek(None)
            skipped.append(describe_item(item))
            self._at = item.end
        return skipped

    def _skip_to_header(self, slots: MutableSequence[S | None]) -> tuple[int, int, int, bool]:
        """Answer sync points and skip follow-ups up to the next header; fail a success that left them unread.

        What a successful command left unread is reported to the head before any sync
        point is answered, so that the sync point hears of it; a command that runs
        collectives is refused at the first such item.
        """
        skipped: list[str] = []
        reported = self._last_failed  # a failed command was reported already
        while True:
            item = self._peek(None)
            if item.starts_command:
                break
            self._at = item.end
            if item.kind is not ItemKind.SYNC:
                skipped.append(describe_item(item))
                if self._collective and not self._last_failed:
                    self._last_failed = True
                    raise self._failed(self._left_unread(skipped))
                continue
            if skipped and not reported:
                self._report(*self._stream.command, error_text(self._left_unread(skipped)))
                reported = True
            self._answer_sync(item.first, bool(item.second & 1), slots)
        if skipped and not self._last_failed:  # raised once; the header behind them runs at the next step
            error = self._left_unread(skipped)
            if not reported:
                self._report(*self._stream.command, error_text(error))
            raise EpCommandFailed(error)
        return item.first, item.second, item.end, item.kind is ItemKind.COMMAND

    def _left_unread(self, skipped: list[str]) -> EpMismatchError:
        them = "it was" if len(skipped) == 1 else "they were"
        return EpMismatchError(
            f"{self._settings.who}: {describe_command(self._stream.commands, *self._stream.command)} "
            f"left {', '.join(skipped)} unread; {them} skipped"
        )

    def _report(self, seq_id: int, cmd: int, text: str) -> None:
        """Tell the head that the command in flight (its count of them) failed here, and why (``text``)."""
        self._answer(encode_report(Report(self._stream.commands, seq_id, cmd, text)))
        self._reports += 1

    def _answer_sync(self, number: int, compare_state: bool, slots: MutableSequence[S | None]) -> None:
        digest = self.state_digest(slots) if compare_state and self.state_digest is not None else None
        stream = self._stream
        self._answer(encode_ack(Ack(number, stream.crc, stream.commands, self._reports, digest)))
        try:
            self._transport.flush_answers(self._settings.command_timeout)
        except Exception as error:
            raise EpReceiveError(f"{self._settings.who}: answering sync point {number} failed: {error}") from error

    def _answer(self, answer: bytes, *, timeout: float | None = None) -> None:
        try:
            self._transport.answer(answer, self._settings.command_timeout if timeout is None else timeout)
        except Exception as error:
            raise EpReceiveError(f"{self._settings.who}: answering the head failed: {error}") from error

    # -- follow-ups ----------------------------------------------------------

    def recv_word(self) -> int:
        """Worker: the next follow-up word (the head's ``send_word``, or a word of ``send_command``).

        Bounded by ``command_timeout``.

        Raises:
            EpMismatchError: the head sent something else (a token array, or the
                next command's header, which then runs at the next step).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        found = decode_word(self._words, self._at)
        if found is not None:
            value, self._at = found
            return value
        item = self._follow_up("a follow-up word")
        if item.kind is not ItemKind.WORD:
            self._mismatch("a follow-up word", item)
        self._at = item.end
        return item.first

    def recv_tokens(self, count: int | None = None) -> list[int]:
        """Worker: the next follow-up token array, as a list; pass ``count`` to require a length.

        Bounded by ``command_timeout``.

        Raises:
            TypeError, ValueError: ``count`` is not ``None`` or an int ``>= 0``
                (nothing is received).
            EpMismatchError: the head sent something else, or ``count`` tokens were
                expected and another number came (the message names both; the
                tokens are consumed).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        if count is not None and (type(count) is not int or count < 0):
            error = ValueError if type(count) is int else TypeError
            raise error(f"count must be None or an int >= 0, got {type(count).__name__} {count!r}")
        found = decode_tokens(self._words, self._at)
        if found is not None and (count is None or found[1] - found[0] == count):
            start, self._at = found
            return self._words[start : self._at].tolist()
        item = self._tokens(count)
        return self._words[item.second : item.end].tolist()

    def recv_tokens_into(self, buffer: Buffer | ArrayInterface) -> None:
        """Worker: the next follow-up token array, written into ``buffer`` in place.

        ``buffer`` must be a writable, C-contiguous, 1-D u32 buffer (``array('I')``,
        numpy ``uint32``) of the head's length.  For workers that feed the tokens
        to a tensor rather than to Python code.

        Raises:
            TypeError: ``buffer`` is not a u32 buffer (a non-native byte order
                included); ValueError: not writable, 1-D and contiguous (nothing is
                received in either case).
            EpMismatchError: the head sent something else, or a token array of
                another length (the message names both; it is consumed).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        view = writable_u32_buffer("buffer", buffer)
        item = self._tokens(len(view))
        view[:] = self._words[item.second : item.end]

    def _tokens(self, count: int | None) -> Item:
        expected = "a token array" if count is None else f"a token array of {count} tokens"
        item = self._follow_up(expected)
        if item.kind is not ItemKind.TOKENS or (count is not None and item.first != count):
            self._mismatch(expected, item)
        self._at = item.end
        return item

    def _follow_up(self, expected: str) -> Item:
        if self._settings.rank == 0:
            raise EpRoleError("follow-ups are received on worker ranks; this is the head (rank 0)")
        timeout = self._settings.command_timeout
        if self._at >= len(self._words):
            what = describe_command(self._stream.commands, *self._stream.command)
            if self._whole:  # nothing can follow: the message was the whole command
                raise EpMismatchError(
                    f"{self._settings.who} expected {expected}, but {what} came whole, "
                    "as one message, and this worker has read all of it"
                )
            try:
                self._words, self._at = self._receive(timeout), 0
            except EpReceiveError as error:
                if not isinstance(error.__cause__, TimeoutError):
                    raise
                raise EpReceiveError(
                    f"{self._settings.who} expected {expected} of {what}, and none came within "
                    f"{timeout} s (the command timeout): the head sent fewer follow-ups than this "
                    f"worker reads, or stalls ({error.__cause__})"
                ) from error.__cause__
        return self._peek(timeout)

    def _mismatch(self, expected: str, item: Item) -> NoReturn:
        if not item.starts_command and item.kind is not ItemKind.SYNC:
            self._at = item.end  # consumed; a header or a sync point stays for the next step
        raise EpMismatchError(f"{self._settings.who} expected {expected}, but the head sent {describe_item(item)}")

    # -- the stream ------------------------------------------------------------

    def _peek(self, timeout: float | None) -> Item:
        """The next unread item, receiving a message when the current one is used up."""
        while self._at >= len(self._words):
            self._words = self._receive(timeout)
            self._at = 0
        try:
            item = decode_item(self._words, self._at)
        except WireError as error:
            raise EpReceiveError(f"{self._settings.who}: a corrupt message from the head: {error}") from None
        if item.kind is ItemKind.CLOSE:
            raise EpReceiveError(f"{self._settings.who}: the head closed its link before shutting the workers down")
        return item

    def _receive(self, timeout: float | None) -> memoryview:
        try:
            message = self._transport.receive(timeout)
        except Exception as error:
            raise EpReceiveError(f"{self._settings.who}: receive from the head failed: {error}") from error
        if len(message) % 4:
            raise EpReceiveError(f"{self._settings.who}: a corrupt message of {len(message)} bytes from the head")
        self._stream.crc = fold_message(self._stream.crc, (message,))
        return message.cast(U32_TYPECODE)
