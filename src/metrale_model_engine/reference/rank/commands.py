"""The reference model's command words, Metrale's, and each command's wire layout: one send/receive pair per
command, which the head and the workers share.

* ``CMD_ALLOC`` (``0xFFFFFFF1``) and one word: 1 allocates slot ``seq_id`` (a slot that
  was held is freed first: ``send_alloc``), 0 frees it (``send_free``); ``recv_alloc``
  reads which.  No collective.
* ``CMD_PREFILL`` (``0xFFFFFFF0``): words ``chunk_len``, ``chunk_start``, ``full_len``,
  then the whole prompt (``full_len`` tokens) as one token array (``send_prefill``,
  ``recv_prefill``); the chunk ``prompt[chunk_start : chunk_start + chunk_len]`` goes
  into the slot's KV cache, after the ``chunk_start`` tokens it holds already.  A
  prompt of ``L`` tokens in chunks of ``c`` costs ``L * ceil(L / c)`` tokens on the wire.
* ``CMD_DECODE`` (``0xFFFFFFE0``): a batched command
  ([`send_batch`][metrale_model_engine.batching.send_batch]): a count, then the slot ids
  and one token per slot as two token arrays (``send_decode``, ``recv_decode``); each
  slot feeds its token.

Prefill and decode run the forward's all-reduces on every rank (``COLLECTIVE_COMMANDS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ... import EpLink
from ...batching import recv_batch, send_batch

CMD_PREFILL: Final = 0xFFFFFFF0
"""A prefill chunk: ``chunk_len``, ``chunk_start``, ``full_len``, then the whole prompt."""
CMD_ALLOC: Final = 0xFFFFFFF1
"""Allocate (word 1; a held slot is freed first) or free (word 0) slot ``seq_id``."""
CMD_DECODE: Final = 0xFFFFFFE0
"""A batched decode step: a count, the slot ids, one token per slot."""
COLLECTIVE_COMMANDS: Final = frozenset({CMD_PREFILL, CMD_DECODE})
"""The commands whose forward runs the all-reduces: a failure of either stops the run on every rank."""


def send_alloc(link: EpLink, seq_id: int) -> None:
    """Head: allocate slot ``seq_id`` on every worker (what it held is freed)."""
    link.send_command(seq_id, CMD_ALLOC, 1)


def send_free(link: EpLink, seq_id: int) -> None:
    """Head: free slot ``seq_id`` on every worker."""
    link.send_command(seq_id, CMD_ALLOC, 0)


def recv_alloc(link: EpLink) -> bool:
    """Worker: an alloc's word, ``True`` to allocate (``send_alloc``), ``False`` to free (``send_free``).

    Raises:
        ValueError: the word is neither.
    """
    word = link.recv_word()
    if word not in (0, 1):
        raise ValueError(f"an alloc's word must be 1 (alloc) or 0 (free), got {word}")
    return word == 1


def send_prefill(link: EpLink, seq_id: int, prompt: Sequence[int], start: int, length: int) -> None:
    """Head: the chunk ``prompt[start : start + length]`` of slot ``seq_id``, sent with the whole prompt."""
    link.send_command(seq_id, CMD_PREFILL, length, start, len(prompt), prompt)


def recv_prefill(link: EpLink) -> tuple[list[int], int, int]:
    """Worker: a prefill's follow-ups, as ``send_prefill`` sent them: ``(prompt, start, length)``.

    Raises:
        EpMismatchError: the prompt has another length than announced (and as the link's receives).
    """
    length, start, full_length = link.recv_word(), link.recv_word(), link.recv_word()
    return link.recv_tokens(full_length), start, length


def send_decode(link: EpLink, seq_ids: Sequence[int], tokens: Sequence[int]) -> None:
    """Head: one decode step, slot ``seq_ids[i]`` feeding ``tokens[i]`` (a batched command)."""
    send_batch(link, CMD_DECODE, seq_ids, tokens)


def recv_decode(link: EpLink, slots: Sequence[object | None]) -> tuple[list[int], list[int]]:
    """Worker: a decode step's slot ids and tokens, as ``send_decode`` sent them, the ids checked against ``slots``.

    Raises:
        As [`recv_batch`][metrale_model_engine.batching.recv_batch].
    """
    return recv_batch(link, slots)
