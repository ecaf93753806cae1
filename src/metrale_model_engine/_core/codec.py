"""The wire codec: what a head sends and a worker answers, as pure encode and decode functions.

The format is documented in the public module, [`metrale_model_engine.wire`][metrale_model_engine.wire].
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Final, NamedTuple

from typing_extensions import Buffer

from .words import U32_MAX, U32_MIN, U32_TYPECODE, plain_small_ints

__all__ = [
    "ANSWER_BYTES",
    "FRAME_PAYLOAD",
    "FRAME_WORDS",
    "U32_MAX",
    "U32_MIN",
    "U32_TYPECODE",
    "WIRE_VERSION",
    "Ack",
    "AnswerKind",
    "Item",
    "ItemKind",
    "Report",
    "WireError",
    "acknowledged",
    "answer_bytes",
    "answer_kind",
    "closes_answers",
    "decode_answer",
    "decode_header",
    "decode_item",
    "decode_tokens",
    "decode_word",
    "describe_item",
    "encode_ack",
    "encode_close",
    "encode_command",
    "encode_header",
    "encode_plain_command",
    "encode_report",
    "encode_sync",
    "encode_tokens_prefix",
    "encode_word",
    "frame_length",
    "frame_message",
    "report_text",
]

WIRE_VERSION: Final[int] = 7
"""Version of this wire format; every rank must run the same one.  3: items in messages; 4: the setup
exchange carries each rank's pid and host; 5: whole-command headers and reports that stop the run;
6: the stream digest folds a large message's edges and length
([`fold_message`][metrale_model_engine.wire.fold_message]); 7: the reference model's prefill and decode
commands carry the block-table entries of its paged KV cache."""

FRAME_WORDS: Final[int] = 16
"""u32 words per frame over a fixed-size broadcast (64 bytes: one cache line)."""

FRAME_PAYLOAD: Final[int] = FRAME_WORDS - 1
"""Message words a frame carries after its length word; longer messages add one bulk broadcast."""


class AnswerKind(enum.IntEnum):
    """The first word of an answer, a worker's message to its head: what it says (``decode_answer``)."""

    REPORT = 0x4D45_0011  # a command failed on the worker (an ordinary failure: it stays in step)
    ACK = 0x4D45_0012  # the worker's acknowledgement of a sync point
    STOP = 0x4D45_0013  # a command failed on the worker and stopped the run (it runs collectives)
    WITNESS = 0x4D45_0014  # a collective of the command failed on the worker: the run stopped, maybe for another

    @classmethod
    def of(cls, report: Report) -> AnswerKind:
        """The kind of answer that carries ``report``."""
        return cls.WITNESS if report.witness else cls.STOP if report.stopped else cls.REPORT

    @property
    def stops_run(self) -> bool:
        """Whether a report of this kind stopped the run (the worker answers nothing after it)."""
        return self is AnswerKind.STOP or self is AnswerKind.WITNESS


class ItemKind(enum.IntEnum):
    """The first word of an item.  Distinct, unlikely values, so that corruption shows.

    ``REPORT``, ``ACK``, ``STOP`` and ``WITNESS`` are the answer words
    ([`AnswerKind`][metrale_model_engine.wire.AnswerKind], their home), kept here so that code that named them
    here goes on working; an item is never one of them.
    """

    HEADER = 0x4D45_0001
    WORD = 0x4D45_0002
    TOKENS = 0x4D45_0003
    CLOSE = 0x4D45_0004
    SYNC = 0x4D45_0005
    COMMAND = 0x4D45_0006
    REPORT = AnswerKind.REPORT.value
    ACK = AnswerKind.ACK.value
    STOP = AnswerKind.STOP.value
    WITNESS = AnswerKind.WITNESS.value


class Item(NamedTuple):
    """One decoded item: its kind, two fields, and the index of the word after it.

    * header and whole command: ``first`` is ``cmd``, ``second`` is ``seq_id``;
    * word: ``first`` is the value;
    * tokens: ``first`` is the count, ``second`` the index of the first token;
    * sync: ``first`` is its number, ``second`` its flags;
    * close: both 0.
    """

    kind: ItemKind
    first: int
    second: int
    end: int

    @property
    def starts_command(self) -> bool:
        """Whether the item is a header (of either kind): the start of the next command."""
        return self.kind is ItemKind.HEADER or self.kind is ItemKind.COMMAND


class WireError(ValueError):
    """A message does not decode: an unknown kind, or an item that runs past the message's end."""


_KINDS: Final[dict[int, ItemKind]] = {int(kind): kind for kind in ItemKind}
_ANSWER_KINDS: Final[dict[int, AnswerKind]] = {int(kind): kind for kind in AnswerKind}
_HEADER: Final[struct.Struct] = struct.Struct("=3I")
_PAIR: Final[struct.Struct] = struct.Struct("=2I")
_CLOSE: Final[bytes] = struct.pack("=I", ItemKind.CLOSE)
_JOIN_LIMIT: Final[int] = 1 << 16
"""Token bytes up to which a command's message is joined into one ``bytes``."""
_HEADER_KIND: Final[int] = int(ItemKind.HEADER)
_COMMAND_KIND: Final[int] = int(ItemKind.COMMAND)
_WORD_KIND: Final[int] = int(ItemKind.WORD)
_TOKENS_KIND: Final[int] = int(ItemKind.TOKENS)
_REPORT: Final[struct.Struct] = struct.Struct("=6I")
_ACK: Final[struct.Struct] = struct.Struct("=9I")
ANSWER_BYTES: Final[int] = 248
"""The most bytes one answer (a report or an acknowledgement) takes: every transport's way back carries that."""
_REPORT_TEXT_BYTES: Final[int] = ANSWER_BYTES - _REPORT.size
"""Bytes of error text a report carries at most: a report is one answer."""
_U32: Final[int] = 0xFFFF_FFFF
_FRAME_PAYLOAD_BYTES: Final[int] = 4 * FRAME_PAYLOAD


def encode_header(seq_id: int, cmd: int) -> bytes:
    """The header item that starts command ``cmd`` for ``seq_id``, whose follow-ups come in messages of their own."""
    return _HEADER.pack(ItemKind.HEADER, cmd, seq_id)


def encode_word(value: int) -> bytes:
    """A follow-up word item."""
    return _PAIR.pack(ItemKind.WORD, value)


def encode_tokens_prefix(count: int) -> bytes:
    """The first two words of a token array item; the ``count`` tokens' bytes follow it."""
    return _PAIR.pack(ItemKind.TOKENS, count)


def encode_close() -> bytes:
    """The close item: the head closed its link before shutting the workers down."""
    return _CLOSE


def encode_command(seq_id: int, cmd: int, follow_ups: Sequence[int | Buffer]) -> list[Buffer]:
    """One message: the whole-command header of ``cmd`` for ``seq_id`` and every follow-up, in order.

    A follow-up is an ``int`` (a word) or a native u32 buffer (a token array).
    Returns the message's parts, to be sent as one message: a single ``bytes`` up to
    ``_JOIN_LIMIT`` bytes of tokens (one copy, cheaper than many small ones), else
    the items' ``bytes`` with the token buffers themselves between them (not copied).
    """
    parts: list[Buffer] = [_HEADER.pack(ItemKind.COMMAND, cmd, seq_id)]
    tokens_bytes = 0
    for follow_up in follow_ups:
        if isinstance(follow_up, int):
            parts.append(_PAIR.pack(ItemKind.WORD, follow_up))
            continue
        size = memoryview(follow_up).nbytes
        tokens_bytes += size
        parts.append(_PAIR.pack(ItemKind.TOKENS, size >> 2))
        parts.append(follow_up)
    return parts if tokens_bytes > _JOIN_LIMIT else [b"".join(parts)]


def encode_plain_command(seq_id: int, cmd: int, follow_ups: Sequence[object]) -> array[int] | None:
    """``encode_command``'s message in one pass, when every follow-up is plain Python; else ``None``.

    Plain: a word is an ``int`` in ``0 ..= 2**32 - 1``, a token array a ``list`` or
    ``tuple`` of ``int`` in ``0 ..= 2**31 - 1``.  The items are laid out in one list
    and converted once, in C; the tokens' check is one ``marshal`` pass per array.
    ``None`` (nothing built) for a buffer, a ``bool``, an ``int`` subclass, a larger
    token or a bad value: the caller's careful path converts those and names any bad
    one.  ``seq_id`` and ``cmd`` must be checked already.
    """
    words: list[object] = [_COMMAND_KIND, cmd, seq_id]
    for follow_up in follow_ups:
        if type(follow_up) is int:
            if follow_up >> 32:  # above 2**32 - 1, or negative
                return None
            words += (_WORD_KIND, follow_up)
        elif (type(follow_up) is list or type(follow_up) is tuple) and plain_small_ints(follow_up):
            words += (_TOKENS_KIND, len(follow_up))
            words += follow_up
        else:
            return None
    return array(U32_TYPECODE, words)  # type: ignore[arg-type]  # every item is an int, checked above


def decode_header(words: memoryview, at: int) -> tuple[int, int, int, bool] | None:
    """``(cmd, seq_id, end, whole)`` when a header item of either kind starts at word ``at``, else ``None``.

    ``whole``: the command came as one message, which holds every follow-up.
    """
    if at + 3 <= len(words):
        kind = words[at]
        if kind in (_COMMAND_KIND, _HEADER_KIND):
            return words[at + 1], words[at + 2], at + 3, kind == _COMMAND_KIND
    return None


def decode_word(words: memoryview, at: int) -> tuple[int, int] | None:
    """``(value, end)`` when a whole word item starts at word ``at``, else ``None``."""
    if at + 2 <= len(words) and words[at] == _WORD_KIND:
        return words[at + 1], at + 2
    return None


def decode_tokens(words: memoryview, at: int) -> tuple[int, int] | None:
    """``(start, end)`` of the tokens when a whole token array item starts at word ``at``, else ``None``."""
    if at + 2 <= len(words) and words[at] == _TOKENS_KIND:
        end = at + 2 + words[at + 1]
        if end <= len(words):
            return at + 2, end
    return None


def encode_sync(number: int, compare_state: bool) -> bytes:
    """The sync item of sync point ``number``."""
    return _HEADER.pack(ItemKind.SYNC, number, int(compare_state))


class Report(NamedTuple):
    """A worker's report that a command failed: which (the head's count of commands, from 1), and why.

    ``stopped``: the failure stopped the run (the command runs collectives);
    ``witness``: it was the worker's collective that failed, so the cause may be
    another rank's (a stopped report).
    """

    command: int
    seq_id: int
    cmd: int
    error: str
    stopped: bool = False
    witness: bool = False


class Ack(NamedTuple):
    """A worker's acknowledgement of a sync point: what it received, and its state's digest if asked."""

    number: int
    stream_crc: int
    commands: int
    reports: int
    state_digest: int | None


def report_text(error: str) -> bytes:
    """``error`` as a report carries it: UTF-8 of at most what one answer holds, whatever the text.

    What UTF-8 cannot encode (a lone surrogate: ``os.fsdecode`` makes one of each
    byte of a file name that is not UTF-8) is escaped as Python writes it
    (``\\udcff``); a text too long for one answer is cut on a character and ends
    with ``...``.  Only the head of a long text is looked at: a message of
    megabytes costs what a short one does.
    """
    head = error[: _REPORT_TEXT_BYTES + 1]  # a character takes a byte at least: the rest cannot fit
    data = head.encode("utf-8", "backslashreplace")
    if len(data) > _REPORT_TEXT_BYTES:
        data = data[: _REPORT_TEXT_BYTES - 3].decode("utf-8", "ignore").encode() + b"..."
    return data


def encode_report(report: Report) -> bytes:
    """A report answer; its error text as ``report_text`` makes it, to fit one answer."""
    text = report_text(report.error)
    kind = AnswerKind.of(report)
    head = _REPORT.pack(kind, report.command & _U32, report.command >> 32, report.seq_id, report.cmd, len(text))
    return head + text.ljust(-(-len(text) // 4) * 4, b"\0")


def encode_ack(ack: Ack) -> bytes:
    """An acknowledgement answer."""
    state = 0 if ack.state_digest is None else ack.state_digest
    return _ACK.pack(
        AnswerKind.ACK, ack.number, ack.stream_crc, ack.commands & _U32, ack.commands >> 32, ack.reports,
        int(ack.state_digest is not None), state & _U32, state >> 32,
    )  # fmt: skip


def answer_bytes(answer: Buffer) -> memoryview:
    """The bytes of one answer a transport is given, checked.

    Raises:
        ValueError: it takes more than ``ANSWER_BYTES`` bytes.
    """
    data = memoryview(answer).cast("B")
    if len(data) > ANSWER_BYTES:
        raise ValueError(f"an answer takes at most {ANSWER_BYTES} bytes, got {len(data)}")
    return data


def answer_kind(answer: bytes) -> AnswerKind | None:
    """What ``answer`` says, from its first word; ``None`` when that is no answer's."""
    return _ANSWER_KINDS.get(int.from_bytes(answer[:4], sys.byteorder)) if len(answer) >= 4 else None


def acknowledged(answer: bytes) -> int | None:
    """The number of the sync point that ``answer`` acknowledges; ``None`` when it is no acknowledgement."""
    if len(answer) != _ACK.size or answer_kind(answer) is not AnswerKind.ACK:
        return None
    return int.from_bytes(answer[4:8], sys.byteorder)


def closes_answers(answer: bytes, number: int | None = None) -> bool:
    """Whether a worker answers nothing more for sync point ``number`` after ``answer``.

    Its acknowledgement of that sync point (of any, when ``number`` is ``None``)
    closes what it answers for it, and a report that stopped the run closes
    everything it answers.  A transport that relays a host's answers
    (``HostsTransport``) reads this, and nothing else, of them.
    """
    kind = answer_kind(answer)
    if kind is not None and kind.stops_run:
        return True
    sync = acknowledged(answer)
    return sync is not None and (number is None or sync == number)


def decode_answer(answer: bytes) -> Report | Ack:
    """The report or acknowledgement in one answer.

    Raises:
        WireError: it is neither, or is cut short.
    """
    kind = answer_kind(answer)
    if kind is not None and kind is not AnswerKind.ACK and len(answer) >= _REPORT.size:
        _, low, high, seq_id, cmd, length = _REPORT.unpack_from(answer)
        if _REPORT.size + length <= len(answer):
            text = answer[_REPORT.size : _REPORT.size + length].decode(errors="replace")
            return Report(high << 32 | low, seq_id, cmd, text, kind.stops_run, kind is AnswerKind.WITNESS)
    if kind is AnswerKind.ACK and len(answer) == _ACK.size:
        _, number, crc, low, high, reports, has_state, state_low, state_high = _ACK.unpack(answer)
        return Ack(number, crc, high << 32 | low, reports, state_high << 32 | state_low if has_state else None)
    raise WireError(f"an answer of {len(answer)} bytes is neither a report nor an acknowledgement")


def decode_item(words: memoryview, at: int) -> Item:
    """The item that starts at word ``at`` of a message (a u32 memoryview of it).

    Raises:
        WireError: the first word is no item kind, or the item runs past the message.
    """
    end = len(words)
    kind = _KINDS.get(words[at])
    if (kind is ItemKind.HEADER or kind is ItemKind.COMMAND) and at + 3 <= end:
        return Item(kind, words[at + 1], words[at + 2], at + 3)
    if kind is ItemKind.WORD and at + 2 <= end:
        return Item(kind, words[at + 1], 0, at + 2)
    if kind is ItemKind.TOKENS and at + 2 <= end and at + 2 + words[at + 1] <= end:
        return Item(kind, words[at + 1], at + 2, at + 2 + words[at + 1])
    if kind is ItemKind.SYNC and at + 3 <= end:
        return Item(kind, words[at + 1], words[at + 2], at + 3)
    if kind is ItemKind.CLOSE:
        return Item(kind, 0, 0, at + 1)
    if kind is None:
        raise WireError(f"word {at} of a {end}-word message is {words[at]:#x}, not the start of an item")
    if kind in _ANSWER_KINDS:
        raise WireError(f"word {at} of a {end}-word message is a {kind.name.lower()} kind: answers go to the head")
    raise WireError(f"the {kind.name.lower()} item at word {at} runs past the end of its {end}-word message")


def describe_item(item: Item) -> str:
    """How error messages name an item: "a follow-up word (5)", "a token array of 3 tokens"..."""
    if item.starts_command:
        return f"the next command's header (cmd={item.first}, seq_id={item.second})"
    if item.kind is ItemKind.WORD:
        return f"a follow-up word ({item.first})"
    if item.kind is ItemKind.TOKENS:
        return f"a token array of {item.first} token{'' if item.first == 1 else 's'}"
    if item.kind is ItemKind.SYNC:
        return f"sync point {item.first}"
    return "the head's close"


def frame_message(message: Buffer) -> tuple[bytes, memoryview | None]:
    """Split a message (its bytes) into the frame and the bulk that fixed-size broadcasts carry.

    The frame is [`FRAME_WORDS`][metrale_model_engine.wire.FRAME_WORDS] words, ``[length in words, the first words...]``
    (zero-padded); the bulk is the rest of the message, ``None`` when it fits.
    """
    view = memoryview(message).cast("B")
    frame = struct.pack("=I", len(view) // 4) + bytes(view[:_FRAME_PAYLOAD_BYTES]).ljust(_FRAME_PAYLOAD_BYTES, b"\0")
    return frame, (view[_FRAME_PAYLOAD_BYTES:] if len(view) > _FRAME_PAYLOAD_BYTES else None)


def frame_length(frame: memoryview) -> int:
    """The message length, in words, that a received frame (a u32 memoryview) announces."""
    return int(frame[0])
