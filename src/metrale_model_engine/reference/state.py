"""One rank's slots of the reference model: the checks of a command against them, and the digests sync points compare.

[`LmState`][metrale_model_engine.reference.LmState] is a slot's sequence;
[`check_prompt`][metrale_model_engine.reference.check_prompt],
[`check_prefill`][metrale_model_engine.reference.check_prefill] and
[`check_decode`][metrale_model_engine.reference.check_decode] are what the head checks before it sends a command and a
worker before it runs one, so that both refuse the same commands with the same words;
[`kv_digest`][metrale_model_engine.reference.kv_digest] digests the slots' KV bookkeeping for sync points, and
``KvLedger`` makes them deeper.

A deeper sync point: the ranks hold different KV heads, so their caches cannot be
compared with each other; what each rank can prove is that its own cache was not
altered after the write (memory corruption, a kernel that writes outside its slot
or position, a bug that reuses a slot's rows).  ``KvLedger`` keeps, per slot,
an exact digest of the bits each forward wrote (an int64 sum of the values' bit
patterns, reduced on the cache's device: no float rounding, the same in any order),
and ``KvLedger.altered`` recomputes it from the cache at a sync point.  A rank
whose cache differs folds the altered slots into its state digest, so the head's
sync point names it (``EpDivergenceError``).  What it cannot see: a wrong value
computed at the write (the tests compare the sharded logits with one rank's instead).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable, Iterable, MutableSequence, Sequence

import torch

from .. import SequenceState, check_slot
from .._core.namespace import PublicDir, public_dir
from ..batching import check_batch
from .config import LmConfig
from .model import ShardedLm

__all__ = [
    "KvLedger",
    "LmSlots",
    "LmState",
    "check_decode",
    "check_prefill",
    "check_prompt",
    "held_state",
    "kv_digest",
]


__dir__: PublicDir = public_dir(globals(), __all__)


class LmState(SequenceState):
    """One sequence in its slot: the tokens fed so far, whose keys and values fill positions ``0 .. length - 1``."""

    __slots__ = ()

    @property
    def length(self) -> int:
        """Positions of the slot's KV cache in use: the next token goes at this position."""
        return len(self.tokens)


LmSlots = MutableSequence[LmState | None]
"""One rank's slot array for the reference model."""


def kv_digest(slots: Sequence[LmState | None]) -> int:
    """A u64 digest of the KV bookkeeping of ``slots``: which slots are held, and the tokens each has fed.

    Equal on two ranks when both ran the same commands; set as the link's
    ``state_digest``, so sync points compare it.
    """
    low = high = 0
    for seq_id, state in enumerate(slots):
        if state is not None:
            data = array("I", (seq_id, state.length, *state.tokens)).tobytes()
            low, high = zlib.crc32(data, low), zlib.adler32(data, high)
    return (high << 32) | low


def held_state(slots: Sequence[LmState | None], seq_id: int) -> LmState:
    """The state in slot ``seq_id``.

    Raises:
        TypeError, IndexError: as [`check_slot`][metrale_model_engine.check_slot].
        KeyError: the slot is free.
    """
    check_slot(seq_id, slots)
    state = slots[seq_id]
    if state is None:
        raise KeyError(f"slot {seq_id} is free")
    return state


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


_SAME_WIDTH_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bit_sum(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The int64 sum over ``dims`` of ``values``' bit patterns, read as integers of their own width."""
    return values.view(_SAME_WIDTH_INT[values.element_size()]).to(torch.int64).sum(dim=dims)


class KvLedger:
    """Per slot of ``lm``'s cache, the digest of what was written; built off (no cost) until asked for."""

    def __init__(self, lm: ShardedLm) -> None:
        self._attention = [block.attn for block in lm.blocks()]
        device = lm.embed.device
        self.written: torch.Tensor = torch.zeros(lm.num_slots, dtype=torch.int64, device=device)
        """By slot: the digest of every key and value row written since the slot was (re)allocated."""

    def forget(self, slot: int) -> None:
        """The slot holds a new sequence: nothing written yet."""
        self.written[slot] = 0

    def wrote_chunk(self, slot: int, start: int, end: int) -> None:
        """A prefill wrote positions ``start .. end - 1`` of ``slot``: add them, as the cache now holds them."""
        self.written[slot] += self._total(lambda cache: _bit_sum(cache[slot, start:end], (0, 1, 2)))

    def wrote_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode wrote position ``positions[i]`` of ``slots[i]`` for every ``i``: add each row."""
        self.written.index_add_(0, slots, self._total(lambda cache: _bit_sum(cache[slots, positions], (1, 2))))

    def altered(self, lengths: Iterable[tuple[int, int]]) -> list[int]:
        """The slots among ``(slot, length)`` whose cache's first ``length`` positions differ from what was written.

        One reduction over the cache on its device, then one transfer to the host.
        """
        held: Sequence[tuple[int, int]] = list(lengths)
        if not held:
            return []
        device = self.written.device
        slots = torch.tensor([slot for slot, _ in held], device=device)
        ends = torch.tensor([length for _, length in held], device=device)
        span = max(length for _, length in held)  # the positions past every slot's end are not read
        inside = (torch.arange(span, device=device)[None, :] < ends[:, None]).to(torch.int64)  # [n, span]
        found = self._total(lambda cache: (_bit_sum(cache[slots, :span], (2, 3)) * inside).sum(dim=1))
        differ = found != self.written[slots]
        return [slot for (slot, _), bad in zip(held, differ.tolist(), strict=True) if bad]

    def _total(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``reduce`` of every layer's key cache and value cache, summed."""
        total = torch.zeros((), dtype=torch.int64, device=self.written.device)
        for attention in self._attention:
            total = total + reduce(attention.k_cache) + reduce(attention.v_cache)
        return total
