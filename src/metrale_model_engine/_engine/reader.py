"""The worker's reading of the command stream: the step that runs a command, the receives.

Pull-style: a worker asks for the next header (``CommandReader.step``) and then
for each follow-up it expects (``recv_word``, ``recv_tokens``...); the reader
decodes the item the request meets and receives the next message only when the
current one is used up, so it reads a command the same way whether the head sent it
as one message or item by item.  A follow-up of another kind or length is an
[`EpMismatchError`][metrale_model_engine.EpMismatchError] after the item was consumed (a next command's header is
left for the next step); so is a follow-up asked for past the end of a command sent
as one message, at once.  What a failed command left unread is skipped on the way
to the next header, and what a successful one left unread fails it: at once when it
came as one message, else when the worker meets the next header.

A command the model declared collective (``LinkedEp.ep_collective_commands``) cannot
fail here alone: the other ranks are in, or on their way to, its collectives.  Any
failure of one is a refusal ([`EpCommandRefused`][metrale_model_engine.EpCommandRefused]): it is reported to the head
as a report that stops the run, and the link refuses every later step.

What a worker answers (reports, refusals, sync points) goes back through ``way_back.worker``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, MutableSequence
from typing import NoReturn

from typing_extensions import Buffer

from .._core.checks import check_slot
from .._core.codec import (
    Item,
    ItemKind,
    WireError,
    decode_header,
    decode_item,
    decode_tokens,
    decode_word,
    describe_item,
)
from .._core.digest import fold_message
from .._core.errors import (
    EpCommandFailed,
    EpLinkError,
    EpMismatchError,
    EpReceiveError,
    RunStopped,
    error_text,
)
from .._core.state import S
from .._core.tokens import ArrayInterface, writable_u32_buffer
from .._core.words import CMD_SHUTDOWN, U32_TYPECODE
from .run_state import LinkParts, ran_no_collective
from .way_back.worker import WorkerWayBack

RunCommand = Callable[[int, int, MutableSequence[S | None]], None]
"""A worker hook: ``run(seq_id, cmd, slots)`` runs one command (``ep_run_command``)."""

_NO_WORDS = memoryview(b"").cast(U32_TYPECODE)
_NO_COMMANDS: frozenset[int] = frozenset()


class CommandReader:
    """A worker's reading of the command stream (``EpLink.step`` and the receives state the contract).

    Args:
        parts: the link's parts.
        way_back: where the worker's answers go.
    """

    __slots__ = (
        "_at",
        "_last_failed",
        "_scope",
        "_settings",
        "_state",
        "_stream",
        "_transport",
        "_way_back",
        "_whole",
        "_words",
    )

    def __init__(self, parts: LinkParts, way_back: WorkerWayBack) -> None:
        self._transport, self._settings, self._stream, self._state, self._scope = parts
        self._way_back = way_back
        self._words = _NO_WORDS  # the current message, as u32 words
        self._at = 0  # the index of its next unread word
        self._last_failed = False  # the last command failed: skip what it left unread
        self._whole = False  # the command in flight came as one message, every follow-up in it

    # -- the step ------------------------------------------------------------

    def step(
        self, run: RunCommand[S], slots: MutableSequence[S | None], collective: Container[int] = _NO_COMMANDS
    ) -> bool:
        """``EpLink.step``: receive the next header and run its command with ``run(seq_id, cmd, slots)``."""
        if self._state.stopped is not None:
            raise self._state.still_stopped()
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
        way_back = self._way_back
        way_back.collective = cmd in collective
        scope = self._scope
        scope.begin(way_back.collective, False)  # a worker owes nothing: it runs each forward as it steps
        try:
            check_slot(seq_id, slots)
            run(seq_id, cmd, slots)
            if self._whole and self._at < len(self._words):
                raise self._left_unread(self._skip_rest())
            if scope.open and scope.declared and scope.ran_none():
                raise way_back.refused(ran_no_collective(cmd))
        except RunStopped as stopped:
            if self._state.stopped is None:  # the hook refused the command itself: tell the head first
                way_back.leave(stopped, error_text(stopped))
            raise
        except EpLinkError:
            raise
        except EpCommandFailed as failed:  # the hook tagged it itself
            if way_back.collective:
                raise way_back.refuse(failed.cause) from failed.cause
            way_back.report(error_text(failed.cause))
            raise
        except Exception as error:
            raise way_back.failed(error) from error
        finally:
            self._whole = False  # follow-ups read outside a step wait for the head, as before any command
            scope.open = False
        self._last_failed = False
        return True

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
        way_back = self._way_back
        while True:
            item = self._peek(None)
            if item.starts_command:
                break
            self._at = item.end
            if item.kind is not ItemKind.SYNC:
                skipped.append(describe_item(item))
                if way_back.collective and not self._last_failed:
                    self._last_failed = True
                    raise way_back.failed(self._left_unread(skipped))
                continue
            if skipped and not reported:
                way_back.report(error_text(self._left_unread(skipped)))
                reported = True
            way_back.acknowledge(item.first, bool(item.second & 1), slots)
        if skipped and not self._last_failed:  # raised once; the header behind them runs at the next step
            error = self._left_unread(skipped)
            if not reported:
                way_back.report(error_text(error))
            raise EpCommandFailed(error)
        return item.first, item.second, item.end, item.kind is ItemKind.COMMAND

    def _left_unread(self, skipped: list[str]) -> EpMismatchError:
        them = "it was" if len(skipped) == 1 else "they were"
        return EpMismatchError(
            f"{self._settings.who}: {self._stream.described()} left {', '.join(skipped)} unread; {them} skipped"
        )

    # -- follow-ups ----------------------------------------------------------

    def recv_word(self) -> int:
        """``EpLink.recv_word``: the next follow-up word."""
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
        """``EpLink.recv_tokens``: the next follow-up token array, as a list (``count`` tokens if given)."""
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
        """``EpLink.recv_tokens_into``: the next follow-up token array, written into ``buffer``."""
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
        timeout = self._settings.command_timeout
        if self._at >= len(self._words):
            what = self._stream.described()
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
