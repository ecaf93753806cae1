"""What every rank checks of a command against its own slots before anything runs.

The head checks a command before it sends it, and a worker before it runs it, with the
same functions, so that both refuse the same commands with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...batching import check_batch
from ..config import LmConfig
from .slots import LmState, held_state


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
    slots: Sequence[LmState | None], seq_id: int, prompt: Sequence[int], start: int, length: int, config: LmConfig
) -> LmState:
    """Check a prefill chunk against ``slots`` before anything runs; return the slot's state.

    The chunk ``prompt[start : start + length]`` must follow what the slot holds
    (``start == state.length``), be non-empty, end within the prompt, and the prompt
    must fit ``max_seq_len`` and the vocabulary.

    Raises:
        IndexError: ``seq_id`` is out of range.
        KeyError: the slot is free.
        TypeError, ValueError: the chunk or the prompt is wrong (the message says how).
    """
    state = held_state(slots, seq_id)
    for name, value in (("start", start), ("length", length)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if length < 1 or start + length > len(prompt):
        raise ValueError(f"chunk {start} ..< {start + length} is not a non-empty part of a {len(prompt)}-token prompt")
    if start != state.length:
        raise ValueError(f"chunk starts at {start}, but slot {seq_id} holds {state.length} tokens: chunks go in order")
    check_prompt(prompt, config)
    return state


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
