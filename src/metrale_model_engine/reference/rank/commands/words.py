"""The reference model's command words, Metrale's, and each command's wire layout: one send/receive pair per
command, which the head and the workers share.

* ``CMD_ALLOC`` (``0xFFFFFFF1``) and one word: 1 allocates slot ``seq_id`` (a slot that
  was held is freed first: ``send_alloc``), 0 frees it (``send_free``); ``recv_alloc``
  reads which.  No collective.
* ``CMD_PREFILL`` (``0xFFFFFFF0``): words ``chunk_len``, ``chunk_start``, ``full_len``,
  then the whole prompt (``full_len`` tokens) as one token array, then the word
  ``cached`` and the block-table entries the chunk gains, as a token array
  (``send_prefill``, ``recv_prefill``); the chunk ``prompt[chunk_start : chunk_start +
  chunk_len]`` goes into the slot's KV cache, after the ``chunk_start`` tokens it holds
  already.  ``cached`` is 0 but in the first chunk of a sequence whose first blocks hold
  a cached prefix: the slot then holds ``prompt[:cached]`` at once, in the first
  ``cached / block_size`` of the entries, and the chunk starts there.  The entries are
  the blocks the chunk's positions need beyond the table's, the cached ones first.  A
  prompt of ``L`` tokens in chunks of ``c`` costs ``L * ceil(L / c)`` tokens on the wire.
* ``CMD_DECODE`` (``0xFFFFFFE0``): a batched command: a count, the slot ids and one
  token per slot as two token arrays, as
  [`send_batch`][metrale_model_engine.batching.send_batch] sends them, then the
  block-table entries the step gains as a token array: one block, in batch order, for
  each slot whose next position starts a block its table lacks (``send_decode``,
  ``recv_decode``); each slot feeds its token.

Prefill and decode run the forward's all-reduces on every rank (``COLLECTIVE_COMMANDS``).
The head decides every entry (``KvBlocks``); a worker only checks them (``checks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .... import EpLink
from ....batching import check_batch

CMD_PREFILL: Final = 0xFFFFFFF0
"""A prefill chunk: ``chunk_len``, ``chunk_start``, ``full_len``, the whole prompt, ``cached``, the blocks gained."""
CMD_ALLOC: Final = 0xFFFFFFF1
"""Allocate (word 1; a held slot is freed first) or free (word 0) slot ``seq_id``."""
CMD_DECODE: Final = 0xFFFFFFE0
"""A batched decode step: a count, the slot ids, one token per slot, the blocks gained."""
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


def send_prefill(
    link: EpLink, seq_id: int, prompt: Sequence[int], start: int, length: int, cached: int, blocks: Sequence[int]
) -> None:
    """Head: the chunk ``prompt[start : start + length]`` of slot ``seq_id``, sent with the whole prompt, the tokens
    found ``cached`` and the block-table entries it gains."""
    link.send_command(seq_id, CMD_PREFILL, length, start, len(prompt), prompt, cached, blocks)


def recv_prefill(link: EpLink) -> tuple[list[int], int, int, int, list[int]]:
    """Worker: a prefill's follow-ups, as ``send_prefill`` sent them: ``(prompt, start, length, cached, blocks)``.

    Raises:
        EpMismatchError: the prompt has another length than announced (and as the link's receives).
    """
    length, start, full_length = link.recv_word(), link.recv_word(), link.recv_word()
    prompt = link.recv_tokens(full_length)
    return prompt, start, length, link.recv_word(), link.recv_tokens()


def send_decode(link: EpLink, seq_ids: Sequence[int], tokens: Sequence[int], blocks: Sequence[int]) -> None:
    """Head: one decode step, slot ``seq_ids[i]`` feeding ``tokens[i]``, and the blocks it gains (see the module)."""
    link.send_command(0, CMD_DECODE, len(seq_ids), seq_ids, tokens, blocks)


def recv_decode(link: EpLink, slots: Sequence[object | None]) -> tuple[list[int], list[int], list[int]]:
    """Worker: a decode step's slot ids, tokens and blocks gained, as ``send_decode`` sent them; everything is read
    before the ids are checked against ``slots``.

    Raises:
        EpMismatchError: the follow-ups are not a count, two arrays of that count and one more array.
        IndexError, ValueError, KeyError: as [`check_batch`][metrale_model_engine.batching.check_batch].
    """
    count = link.recv_word()
    seq_ids, tokens, blocks = link.recv_tokens(count), link.recv_tokens(count), link.recv_tokens()
    check_batch(seq_ids, slots)
    return seq_ids, tokens, blocks
