"""The wire codec: pure encode and decode functions, the layout they fix, and what they refuse."""

import itertools
import os
import zlib
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_model_engine._core.codec import encode_plain_command
from metrale_model_engine.wire import (
    ANSWER_BYTES,
    DIGEST_EDGE,
    FRAME_PAYLOAD,
    FRAME_WORDS,
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
    describe_item,
    encode_ack,
    encode_close,
    encode_command,
    encode_header,
    encode_report,
    encode_tokens_prefix,
    encode_word,
    fold_message,
    frame_length,
    frame_message,
)

from helpers.messages import words

u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)


def view(*values: int) -> memoryview:
    return memoryview(array("I", values))


def test_the_layout_is_fixed() -> None:
    assert WIRE_VERSION == 7 and (FRAME_WORDS, FRAME_PAYLOAD, ANSWER_BYTES, DIGEST_EDGE) == (16, 15, 248, 4096)
    assert words(encode_header(7, 3)) == (0x4D45_0001, 3, 7)
    assert words(*encode_command(3, 7, [])) == (0x4D45_0006, 7, 3)
    assert words(encode_word(9)) == (0x4D45_0002, 9)
    assert words(encode_tokens_prefix(2)) == (0x4D45_0003, 2)
    assert words(encode_close()) == (0x4D45_0004,)


def test_a_command_is_its_header_then_each_follow_up_in_order() -> None:
    parts = encode_command(1, 9, [5, array("I", [7, 8]), array("I"), 6])
    expected = (
        ItemKind.COMMAND,
        9,
        1,
        ItemKind.WORD,
        5,
        ItemKind.TOKENS,
        2,
        7,
        8,
        ItemKind.TOKENS,
        0,
        ItemKind.WORD,
        6,
    )
    assert words(*parts) == expected
    assert len(parts) == 1 and isinstance(parts[0], bytes)  # small: one joined message
    tokens = array("I", range(20_000))
    parts = encode_command(0, 1, [tokens, 5])
    assert len(parts) == 4 and parts[2] is tokens  # 80 KB of tokens travel as they are, not copied
    assert words(*parts) == (ItemKind.COMMAND, 1, 0, ItemKind.TOKENS, 20_000, *tokens, ItemKind.WORD, 5)


@given(st.lists(st.one_of(u32, st.lists(u32, max_size=20)), max_size=6), u32, u32)
def test_every_command_decodes_to_what_was_encoded(follow_ups: list[int | list[int]], seq_id: int, cmd: int) -> None:
    encoded = encode_command(seq_id, cmd, [f if isinstance(f, int) else array("I", f) for f in follow_ups])
    message = memoryview(array("I", words(*encoded)))
    item = decode_item(message, 0)
    assert (item.kind, item.first, item.second) == (ItemKind.COMMAND, cmd, seq_id) and item.starts_command
    assert decode_header(message, 0) == (cmd, seq_id, 3, True)
    for follow_up in follow_ups:
        item = decode_item(message, item.end)
        if isinstance(follow_up, int):
            assert (item.kind, item.first) == (ItemKind.WORD, follow_up)
        else:
            assert item.kind is ItemKind.TOKENS and message[item.second : item.end].tolist() == follow_up
    assert item.end == len(message)


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        (view(0xDEAD), r"word 0 of a 1-word message is 0xdead, not the start of an item"),
        (view(ItemKind.HEADER, 1), r"the header item at word 0 runs past the end of its 2-word message"),
        (view(ItemKind.WORD), r"the word item at word 0 runs past"),
        (view(ItemKind.TOKENS, 3, 1, 2), r"the tokens item at word 0 runs past the end of its 4-word message"),
        (view(ItemKind.TOKENS), r"the tokens item at word 0 runs past"),
        (view(ItemKind.STOP, 1), r"word 0 of a 2-word message is a stop kind: answers go to the head"),
        (view(AnswerKind.ACK, 1), r"word 0 of a 2-word message is a ack kind: answers go to the head"),
    ],
)
def test_what_does_not_decode_is_a_wire_error(message: memoryview, fragment: str) -> None:
    with pytest.raises(WireError, match=fragment):
        decode_item(message, 0)
    assert issubclass(WireError, ValueError)


def test_items_are_described_for_error_messages() -> None:
    assert describe_item(Item(ItemKind.HEADER, 3, 2, 3)) == "the next command's header (cmd=3, seq_id=2)"
    assert describe_item(Item(ItemKind.COMMAND, 3, 2, 3)) == "the next command's header (cmd=3, seq_id=2)"
    assert describe_item(Item(ItemKind.WORD, 5, 0, 2)) == "a follow-up word (5)"
    assert describe_item(Item(ItemKind.TOKENS, 1, 2, 3)) == "a token array of 1 token"
    assert describe_item(Item(ItemKind.TOKENS, 0, 2, 2)) == "a token array of 0 tokens"
    assert describe_item(Item(ItemKind.CLOSE, 0, 0, 1)) == "the head's close"


@pytest.mark.parametrize("length", [0, 1, 15, 16, 40])
def test_a_message_travels_as_a_frame_and_at_most_one_bulk(length: int) -> None:
    message = array("I", range(100, 100 + length))
    frame, rest = frame_message(message)
    frame_words = memoryview(frame).cast("I")
    assert len(frame_words) == FRAME_WORDS and frame_length(frame_words) == length
    assert frame_words[1 : 1 + min(length, 15)].tolist() == message.tolist()[:15]
    assert frame_words[1 + min(length, 15) :].tolist() == [0] * (15 - min(length, 15))
    if length <= FRAME_PAYLOAD:
        assert rest is None
    else:
        assert rest is not None and rest.cast("I").tolist() == message.tolist()[15:]


any_text = st.text(
    st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from("\0\n")),
    max_size=300,
)
"""Any ``str``: lone surrogates (what ``os.fsdecode`` makes of a file name's bad byte), NUL, every script."""


@given(st.integers(min_value=1, max_value=2**64 - 1), u32, u32, any_text, st.booleans(), st.booleans())
def test_a_report_of_any_text_decodes_to_it_escaped_where_it_cannot_be_encoded_and_cut_to_one_answer(
    command: int, seq_id: int, cmd: int, text: str, stopped: bool, witness: bool
) -> None:
    answer = encode_report(Report(command, seq_id, cmd, text, stopped, witness))
    assert len(answer) <= ANSWER_BYTES and len(answer) % 4 == 0
    decoded = decode_answer(answer)
    assert isinstance(decoded, Report) and decoded[:3] == (command, seq_id, cmd)
    assert (decoded.stopped, decoded.witness) == (stopped or witness, witness)
    decoded.error.encode()  # readable: a str UTF-8 takes, every time
    escaped = text.encode("utf-8", "backslashreplace").decode()
    if len(escaped.encode()) <= ANSWER_BYTES - 24:
        assert decoded.error == escaped
    else:
        assert decoded.error.endswith("...") and escaped.startswith(decoded.error[:-3])
        assert len(decoded.error.encode()) > ANSWER_BYTES - 24 - 8  # cut at the end of the room, not before


def test_a_report_of_a_file_name_that_is_not_utf_8_keeps_the_name_readable() -> None:
    text = "ValueError: no such file: " + os.fsdecode(b"/data/\xff.bin")
    decoded = decode_answer(encode_report(Report(3, 0, 8, text)))
    assert isinstance(decoded, Report) and decoded.error == "ValueError: no such file: /data/\\udcff.bin"


def test_a_report_of_megabytes_is_cut_to_one_answer() -> None:
    decoded = decode_answer(encode_report(Report(1, 0, 1, "x" * (8 << 20))))
    assert isinstance(decoded, Report) and decoded.error == "x" * (ANSWER_BYTES - 24 - 3) + "..."


def test_a_per_word_header_is_not_a_whole_command() -> None:
    message = memoryview(array("I", words(encode_header(2, 9))))
    assert decode_header(message, 0) == (9, 2, 3, False)
    assert (
        decode_header(message[:2], 0) is None
        and decode_header(memoryview(array("I", words(encode_word(1)))), 0) is None
    )


@given(
    st.binary(max_size=3 * DIGEST_EDGE),
    st.lists(st.integers(0, 3 * DIGEST_EDGE), max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_the_digest_of_a_message_does_not_depend_on_how_it_is_cut(data: bytes, cuts: list[int], crc: int) -> None:
    points = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]
    parts = [data[start:end] for start, end in itertools.pairwise(points)]
    assert fold_message(crc, parts) == fold_message(crc, [data])
    if len(data) % 4 == 0:  # as a worker holds it: one u32 view
        assert fold_message(crc, [memoryview(data).cast("I")]) == fold_message(crc, [data])


def test_a_message_up_to_two_edges_is_folded_whole_and_a_longer_one_by_its_length_and_edges() -> None:
    small = bytes(range(256)) * (2 * DIGEST_EDGE // 256)
    assert fold_message(5, [small]) == zlib.crc32(small, 5)
    large = bytearray(small * 4)
    digest = fold_message(0, [large])
    for at in (0, DIGEST_EDGE - 1, len(large) - DIGEST_EDGE, len(large) - 1):  # the edges count
        changed = bytearray(large)
        changed[at] ^= 1
        assert fold_message(0, [changed]) != digest, at
    assert fold_message(0, [large + b"\0\0\0\0"]) != digest  # and the length
    middle = bytearray(large)
    middle[len(large) // 2] ^= 1  # the middle is the transport's to deliver whole: not folded
    assert fold_message(0, [middle]) == digest


follow_up_values = st.one_of(
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(0, 2**32 - 1), max_size=6),
    st.lists(st.integers(0, 2**31 - 1), max_size=6).map(tuple),
)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.lists(follow_up_values, max_size=4))
def test_the_one_pass_encoder_writes_exactly_the_careful_encoders_message(
    seq_id: int, cmd: int, follow_ups: list[int | list[int] | tuple[int, ...]]
) -> None:
    plain = encode_plain_command(seq_id, cmd, follow_ups)
    buffers = [f if isinstance(f, int) else array("I", f) for f in follow_ups]
    careful = b"".join(bytes(part) for part in encode_command(seq_id, cmd, buffers))
    big_token = any(not isinstance(f, int) and any(t >= 2**31 for t in f) for f in follow_ups)
    assert plain is None if big_token else plain is not None and plain.tobytes() == careful


@pytest.mark.parametrize("odd", [True, [1, True], [-1], 2**32, -1, [2**31], array("I", [1]), b"\0\0\0\0", 1.0])
def test_the_one_pass_encoder_leaves_anything_not_plain_to_the_careful_path(odd: object) -> None:
    assert encode_plain_command(0, 1, [5, odd]) is None


@pytest.mark.parametrize(
    ("stopped", "witness", "kind"),
    [(False, False, AnswerKind.REPORT), (True, False, AnswerKind.STOP), (True, True, AnswerKind.WITNESS)],
)
def test_a_reports_answer_kind_says_whether_it_stopped_the_run_and_as_what(
    stopped: bool, witness: bool, kind: AnswerKind
) -> None:
    report = Report(3, 1, 7, "KeyError: 'slot 1 is free'", stopped, witness)
    answer = encode_report(report)
    assert words(answer)[0] == kind and AnswerKind.of(report) is kind and kind.stops_run is stopped
    assert decode_answer(answer) == report


def test_the_answer_words_are_answer_kinds_and_the_item_kinds_keep_their_old_names_for_them() -> None:
    ack = Ack(2, 0xABCD, 5, 1, None)
    assert words(encode_ack(ack))[0] == AnswerKind.ACK and decode_answer(encode_ack(ack)) == ack
    assert not AnswerKind.ACK.stops_run and not AnswerKind.REPORT.stops_run
    assert {kind.name: kind.value for kind in AnswerKind} == {
        name: ItemKind[name].value for name in ("REPORT", "ACK", "STOP", "WITNESS")
    }
    with pytest.raises(WireError, match="neither a report nor an acknowledgement"):
        decode_answer(bytes(view(ItemKind.SYNC, 1, 0)))
