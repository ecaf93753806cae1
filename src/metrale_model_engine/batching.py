"""Batched commands, their checks and prefill chunks: protocol plumbing a model would otherwise repeat.

* [`send_batch`][metrale_model_engine.batching.send_batch] and [`recv_batch`][metrale_model_engine.batching.recv_batch]:
Metrale's batched command (a batched
  decode, say): a header with ``seq_id`` 0, a count word, then the slot ids and one
  u32 per slot (the tokens) as two token arrays, in one message.
* [`check_batch`][metrale_model_engine.batching.check_batch]: what a worker checks before it touches any slot of a batch
  (ids in range, no duplicates, every slot live), as Metrale's worker does.
* [`prefill_chunks`][metrale_model_engine.batching.prefill_chunks]: a prompt cut into chunks of at most a given length.

Torch-free.  The toy model's and the reference model's batched decodes use the
first three; the reference server cuts prompts with [`prefill_chunks`][metrale_model_engine.batching.prefill_chunks].
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ._core.checks import check_int
from ._core.namespace import PublicDir, public_dir
from ._core.tokens import TokenArray, as_u32_buffer, token_count
from ._engine.link import EpLink

__all__ = ["check_batch", "prefill_chunks", "recv_batch", "send_batch"]
__dir__: PublicDir = public_dir(globals(), __all__)


def send_batch(link: EpLink, cmd: int, slot_ids: TokenArray, values: TokenArray) -> None:
    """Head: send batched command ``cmd``: the count, ``slot_ids`` and one value per slot, as one message.

    Raises:
        TypeError, ValueError: an id or value is not a u32, or the two arrays differ
            in length (nothing is sent).
        EpRoleError, EpSendError: as [`EpLink.send_command`][metrale_model_engine.EpLink.send_command].
    """
    if isinstance(slot_ids, (list, tuple)) and isinstance(values, (list, tuple)) and len(slot_ids) == len(values):
        try:  # lists go into the message as they are: converted and checked once, by the link's encoder
            link.send_command(0, cmd, len(slot_ids), slot_ids, values)
        except (TypeError, ValueError):
            as_u32_buffer("slot_ids", slot_ids)  # a bad id or value: raise in the batch's own words
            as_u32_buffer("values", values)
            raise
        return
    ids, tokens = as_u32_buffer("slot_ids", slot_ids), as_u32_buffer("values", values)
    count = token_count(ids)
    if token_count(tokens) != count:
        raise ValueError(f"a batch needs one value per slot: {count} slot ids, {token_count(tokens)} values")
    link.send_command(0, cmd, count, ids, tokens)


def recv_batch(link: EpLink, slots: Sequence[object | None]) -> tuple[list[int], list[int]]:
    """Worker: read a batched command's follow-ups, then check the batch (``check_batch``).

    Everything is read before anything is checked, so a bad batch leaves nothing
    unread.  Returns the slot ids and the values.

    Raises:
        EpMismatchError: the follow-ups are not a count and two arrays of that count.
        IndexError, ValueError, KeyError: as [`check_batch`][metrale_model_engine.batching.check_batch].
        EpReceiveError, EpRoleError: as the link's receives.
    """
    count = link.recv_word()
    ids = link.recv_tokens(count)
    values = link.recv_tokens(count)
    check_batch(ids, slots)
    return ids, values


def check_batch(slot_ids: Sequence[int], slots: Sequence[object | None]) -> None:
    """Raise unless every id indexes a live slot (not ``None``) and no id repeats.

    Raises:
        TypeError: an id is not an integer (``bool`` is not; numpy's integers are).
        IndexError: an id is out of range (the message names it and the slot count).
        ValueError: an id repeats.
        KeyError: an id's slot is free.
    """
    count = len(slots)
    try:
        distinct = len(set(slot_ids)) == len(slot_ids)  # one pass in C
    except TypeError:  # an unhashable id: the careful loop names it
        distinct = False
    if distinct:
        for value in slot_ids:
            if type(value) is not int or not 0 <= value < count or slots[value] is None:
                break
        else:
            return
    seen: set[int] = set()  # the careful loop: it raises for the first bad id, in order (numpy's ints pass)
    for index, value in enumerate(slot_ids):
        seq_id = value if type(value) is int else _slot_id(index, value)
        if not 0 <= seq_id < len(slots):
            raise IndexError(f"slot_ids[{index}]={seq_id} is out of range for {len(slots)} slots")
        if seq_id in seen:
            raise ValueError(f"slot_ids[{index}]={seq_id} repeats: a batch names each slot once")
        if slots[seq_id] is None:
            raise KeyError(f"slot_ids[{index}]={seq_id}: the slot is free")
        seen.add(seq_id)


def _slot_id(index: int, value: object) -> int:
    """``value`` as an int if it is an integer (an ``IntEnum``, numpy's), else ``TypeError`` naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]  # TypeError below
        except TypeError:
            pass
    raise TypeError(f"slot_ids[{index}] must be an int, got {type(value).__name__} {value!r}")


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of a ``length``-token prompt cut into chunks of at most ``chunk``.

    An empty prompt has no chunk.

    Raises:
        TypeError, ValueError: ``length`` is not an int ``>= 0`` or ``chunk`` not an int ``>= 1``.
    """
    check_int("length", length, 0)
    check_int("chunk", chunk, 1)
    return [(start, min(chunk, length - start)) for start in range(0, length, chunk)]
