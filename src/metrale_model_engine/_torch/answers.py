"""Answers over a process group, as bytes: packed into one payload, and left in the group's store.

A worker's answers travel to the head point to point as one payload of u32 words
(``pack_answers``); those that will not reach a sync point are appended under
the worker's key in the group's store (``last_words_key``, ``append_text``),
as text, where the head reads them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store


def append_text(store: Store, key: str, text: str) -> None:
    """Append ``text`` to ``key``'s value in ``store`` (created if missing).

    ``Store.append`` (torch's stub lacks it); on a store that does not implement it
    (a ``Store`` subclass in Python), a read, then a set, where a writer in between
    would be lost.
    """
    try:
        store.append(key, text)  # type: ignore[attr-defined]
    except RuntimeError as error:
        if "not implemented" not in str(error).lower():
            raise
        earlier = store.get(key).decode() if store.check([key]) else ""
        store.set(key, earlier + text)


def pack_answers(answers: Sequence[bytes]) -> bytearray:
    """Answers as one payload of u32 words: each one's length in bytes, then its bytes padded to a word."""
    payload = bytearray()
    for data in answers:
        payload += len(data).to_bytes(4, sys.byteorder) + data.ljust(-(-len(data) // 4) * 4, b"\0")
    return payload


def unpack_answers(payload: bytes) -> list[bytes]:
    """The answers in a payload of ``pack_answers``."""
    found, at = [], 0
    while at + 4 <= len(payload):
        length = int.from_bytes(payload[at : at + 4], sys.byteorder)
        found.append(payload[at + 4 : at + 4 + length])
        at += 4 + -(-length // 4) * 4
    return found


def last_words_key(rank: int) -> str:
    """The store key where worker ``rank`` leaves the answers it still held when it left."""
    return f"metrale_model_engine/last_answers/{rank}"
