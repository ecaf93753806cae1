"""What every rank checks of a command against its own slots before anything runs.

The head checks a command before it sends it, and a worker before it runs it, with the
same functions, so that both refuse the same commands with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ...batching import check_batch
from ..config import LmConfig
from .slots import LmState, held_state


class Pool(NamedTuple):
    """The shape of every rank's KV cache: ``num_blocks`` blocks of ``block_size`` positions."""

    num_blocks: int
    block_size: int


def check_prompt(prompt: Sequence[int], config: LmConfig, *, where: str = "") -> None:
    """Check that ``prompt`` fits ``max_seq_len`` and holds ints of the vocabulary; ``where`` prefixes the message.

    Raises:
        TypeError: a token is not an int.
        ValueError: the prompt is too long, or a token is outside the vocabulary.
    """
    if len(prompt) > config.max_seq_len:
        raise ValueError(f"{where}the prompt has {len(prompt)} tokens, more than max_seq_len={config.max_seq_len}")
    _check_tokens(f"{where}prompt", prompt, config.vocab_size)


def _check_tokens(name: str, tokens: Sequence[int], vocab_size: int) -> None:
    for index, token in enumerate(tokens):
        if type(token) is not int:
            raise TypeError(f"{name}[{index}] must be an int, got {type(token).__name__} {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name}[{index}]={token} is outside the vocabulary (0 ..= {vocab_size - 1})")


def check_prefill(
    slots: Sequence[LmState | None],
    seq_id: int,
    prompt: Sequence[int],
    start: int,
    length: int,
    config: LmConfig,
    *,
    cached: int = 0,
) -> LmState:
    """Check a prefill chunk against ``slots`` before anything runs; return the slot's state.

    The chunk ``prompt[start : start + length]`` must follow what the slot holds
    (``start == state.length``), be non-empty, end within the prompt, and the prompt
    must fit ``max_seq_len`` and the vocabulary.  ``cached`` (default 0): the leading
    tokens of the prompt that the sequence's first blocks hold already (a prefix found
    cached, which the chunk adopts): only the first chunk of a slot that holds nothing
    finds one, and starts after it (``start == cached``).

    Raises:
        IndexError: ``seq_id`` is out of range.
        KeyError: the slot is free.
        TypeError, ValueError: the chunk or the prompt is wrong (the message says how).
    """
    state = held_state(slots, seq_id)
    for name, value in (("start", start), ("length", length), ("cached", cached)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if length < 1 or start + length > len(prompt):
        raise ValueError(f"chunk {start} ..< {start + length} is not a non-empty part of a {len(prompt)}-token prompt")
    if cached and state.length:
        raise ValueError(f"slot {seq_id} holds {state.length} tokens: only its first chunk may find a cached prefix, "
                         f"got cached={cached}")  # fmt: skip
    if start != state.length + cached:
        found = f" and finds {cached} cached" if cached else ""
        raise ValueError(
            f"chunk starts at {start}, but slot {seq_id} holds {state.length} tokens{found}: chunks go in order"
        )
    check_prompt(prompt, config)
    return state


def check_blocks(state: LmState, blocks: Sequence[int], end: int, pool: Pool, *, cached: int = 0) -> None:
    """Check the block-table entries a prefill gives ``state``'s sequence, before anything runs: exactly those its
    positions up to ``end`` lack, each a block of ``pool`` that its table does not hold yet; ``cached`` (the tokens
    of a prefix found cached) a whole number of blocks.

    Raises:
        ValueError: the entries are not those (the message says how).
    """
    lacking = max(0, -(-end // pool.block_size) - len(state.blocks))
    if len(blocks) != lacking:
        raise ValueError(
            f"slot {state.seq_id}'s table holds {len(state.blocks)} block(s) of {pool.block_size} positions, so "
            f"positions up to {end - 1} need {lacking} more, but the command gives {len(blocks)}"
        )
    if cached % pool.block_size:
        raise ValueError(f"cached={cached} is not a whole number of blocks of {pool.block_size} positions")
    _check_entries("blocks", blocks, state.blocks, pool)


def check_decode_blocks(states: Sequence[LmState], blocks: Sequence[int], pool: Pool) -> list[LmState]:
    """Check the block-table entries a decode step gives its sequences, before anything runs: one block, in batch
    order, to each sequence whose next position starts a block its table lacks; return those sequences.

    Raises:
        ValueError: the entries are not those (the message says how).
    """
    gaining = [state for state in states if len(state.blocks) * pool.block_size <= state.length]
    if len(blocks) != len(gaining):
        raise ValueError(
            f"a decode step gives {len(blocks)} block(s), but {len(gaining)} of its sequences start a block: "
            f"slot(s) {[state.seq_id for state in gaining]}"
        )
    _check_entries("blocks", blocks, [block for state in gaining for block in state.blocks], pool)
    return gaining


def _check_entries(name: str, blocks: Sequence[int], held: Sequence[int], pool: Pool) -> None:
    """Each of ``blocks`` an int in the pool, named once, and none of ``held``."""
    for index, block in enumerate(blocks):
        if type(block) is not int:
            raise TypeError(f"{name}[{index}] must be an int, got {type(block).__name__} {block!r}")
        if not 0 <= block < pool.num_blocks:
            raise ValueError(f"{name}[{index}]={block} is out of range (0 ..= {pool.num_blocks - 1})")
    if len({*blocks, *held}) != len(blocks) + len(held):
        raise ValueError(f"{name} {list(blocks)} name a block twice, or one the table holds already ({list(held)})")


def check_decode(
    slots: Sequence[LmState | None], seq_ids: Sequence[int], tokens: Sequence[int], config: LmConfig
) -> list[LmState]:
    """Check a decode step against ``slots`` before anything runs; return the states, in batch order.

    Every id must index a held slot that has fed at least one token and has room
    for one more (``length < max_seq_len``); ids distinct; one token per id, in the
    vocabulary.

    Raises:
        IndexError, KeyError, ValueError: as [`check_batch`][metrale_model_engine.batching.check_batch].
        TypeError, ValueError: a token or a slot's length is wrong (the message says which).
    """
    if not seq_ids:
        raise ValueError("a decode step needs at least one sequence")
    if len(tokens) != len(seq_ids):
        raise ValueError(f"a decode step needs one token per sequence: {len(seq_ids)} ids, {len(tokens)} tokens")
    check_batch(seq_ids, slots)
    _check_tokens("tokens", tokens, config.vocab_size)
    states = [held_state(slots, seq_id) for seq_id in seq_ids]
    for state in states:
        if not 0 < state.length < config.max_seq_len:
            raise ValueError(
                f"slot {state.seq_id} holds {state.length} tokens: a decode needs 1 ..= {config.max_seq_len - 1}"
            )
    return states
