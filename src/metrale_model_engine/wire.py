"""The wire format, for peer implementers: what a head sends, as pure encode and decode functions.

A head sends a stream of *items*, each a run of native-order u32 words whose first
word says what it is ([`ItemKind`][metrale_model_engine.wire.ItemKind]):

* header: ``[HEADER, cmd, seq_id]``: starts a command (``seq_id`` is 0 when the
  link leaves it off, bare protocol v1) whose follow-ups come item by item;
* whole command: ``[COMMAND, cmd, seq_id]``: starts a command sent as one message,
  which holds every follow-up of it: a worker that asks for more has read past its
  end, and is told so at once;
* word: ``[WORD, value]``: a follow-up word;
* tokens: ``[TOKENS, count, token_0, ..., token_(count-1)]``: a follow-up token array;
* close: ``[CLOSE]``: the head closed its link before shutting the workers down;
* sync: ``[SYNC, number, flags]``: a sync point (flag 1: compare state digests); every
  worker answers with an acknowledgement.

Workers send *answers* back (``EpTransport.answer``), each one message whose first
word says what it is ([`AnswerKind`][metrale_model_engine.wire.AnswerKind]):

* report: ``[REPORT, command (u64, 2 words), seq_id, cmd, text bytes, text...]``: the
  command the head sent as its ``command``-th (from 1) failed on the worker;
  ``[STOP, ...]`` the same for a command whose failure stopped the run (it runs
  collectives, see ``RunStopped``); ``[WITNESS, ...]`` for a worker whose collective
  of that command failed, which may only have seen another rank's failure;
* acknowledgement: ``[ACK, number, stream crc32, commands (u64), reports, has state,
  state digest (u64)]``: the worker reached sync point ``number`` having received
  ``commands`` commands and a stream whose digest is ``stream crc32`` (every
  message folded in by [`fold_message`][metrale_model_engine.wire.fold_message], the sync's included: whole up to
  ``2 * DIGEST_EDGE`` bytes, else its length and both edges), and sent ``reports``
  reports in all.

Items travel in *messages*, one per send of a transport: a message holds one or
more whole items, never a part of one.  A command sent in one call
(``EpLink.send_command``) is one message, its whole-command header and every
follow-up; the trait's per-word calls send one item per message.  A worker reads a
command the same way whichever the head chose.

A transport over fixed-size collective broadcasts (gloo, NCCL) carries a message
as one frame of [`FRAME_WORDS`][metrale_model_engine.wire.FRAME_WORDS] words, ``[length, word_0, ..., word_14]``,
followed, when the message is longer than [`FRAME_PAYLOAD`][metrale_model_engine.wire.FRAME_PAYLOAD] words, by one bulk
broadcast of exactly the remaining words ([`frame_message`][metrale_model_engine.wire.frame_message]).  A shared-memory
ring carries each message whole, with its length.

Every rank checks [`WIRE_VERSION`][metrale_model_engine.wire.WIRE_VERSION] at setup.  These functions do no IO and
check nothing that the caller checked already: encoders take u32 values and native
u32 buffers; [`decode_item`][metrale_model_engine.wire.decode_item] checks what it reads and raises
[`WireError`][metrale_model_engine.wire.WireError], and [`decode_header`][metrale_model_engine.wire.decode_header],
[`decode_word`][metrale_model_engine.wire.decode_word] and [`decode_tokens`][metrale_model_engine.wire.decode_tokens]
read the one kind a reader expects, cheaply, or say it is not there.
"""

from ._core.codec import (
    ANSWER_BYTES,
    FRAME_PAYLOAD,
    FRAME_WORDS,
    U32_MAX,
    U32_MIN,
    U32_TYPECODE,
    WIRE_VERSION,
    Ack,
    AnswerKind,
    Item,
    ItemKind,
    Report,
    WireError,
    decode_answer,
    decode_header,
    decode_item,
    decode_tokens,
    decode_word,
    describe_item,
    encode_ack,
    encode_close,
    encode_command,
    encode_header,
    encode_report,
    encode_sync,
    encode_tokens_prefix,
    encode_word,
    frame_length,
    frame_message,
)
from ._core.digest import DIGEST_EDGE, fold_message
from ._core.namespace import PublicDir, public_dir

__all__ = [
    "ANSWER_BYTES",
    "DIGEST_EDGE",
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
    "encode_report",
    "encode_sync",
    "encode_tokens_prefix",
    "encode_word",
    "fold_message",
    "frame_length",
    "frame_message",
]

__dir__: PublicDir = public_dir(globals(), __all__)
