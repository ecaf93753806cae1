"""The messages a head puts on the wire, spelled with the codec of ``metrale_model_engine.wire``."""

from collections.abc import Sequence

from typing_extensions import Buffer

from metrale_model_engine.wire import (
    U32_TYPECODE,
    encode_command,
    encode_header,
    encode_sync,
    encode_tokens_prefix,
    encode_word,
)

Message = tuple[int, ...]


def words(*parts: Buffer) -> Message:
    """One message made of ``parts``, as its u32 words."""
    return tuple(memoryview(b"".join(parts)).cast(U32_TYPECODE).tolist())


def header(cmd: int, seq_id: int = 0) -> Message:
    """The header of a command whose follow-ups come item by item (the trait's per-word calls)."""
    return words(encode_header(seq_id, cmd))


def whole(cmd: int, seq_id: int = 0) -> Message:
    """The header of a command sent as one message (``send_command``): its follow-ups come in the same message."""
    return words(*encode_command(seq_id, cmd, []))


def word(value: int) -> Message:
    return words(encode_word(value))


def tokens(values: Sequence[int]) -> Message:
    return words(encode_tokens_prefix(len(values))) + tuple(values)


def sync(number: int, compare_state: bool = False) -> Message:
    return words(encode_sync(number, compare_state))
