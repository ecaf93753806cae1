"""One rank's slots of the reference model: ``LmState``, the sequence a slot holds, and ``LmSlots``, the array."""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence, Sequence

from ... import SequenceState, check_slot


class LmState(SequenceState):
    """One sequence in its slot: the tokens fed so far, whose keys and values fill positions ``0 .. length - 1``,
    and its block table, the cache blocks that hold those positions in order (``blocks``).

    Two states are equal when their slot, tokens and tables are.
    """

    __slots__ = ("blocks",)

    def __init__(self, seq_id: int, tokens: Iterable[int] = (), blocks: Iterable[int] = ()) -> None:
        super().__init__(seq_id, tokens)
        self.blocks: list[int] = list(blocks)
        """The block table: position ``p`` lives in block ``blocks[p // block_size]``, as the head decided."""

    @property
    def length(self) -> int:
        """Positions of the sequence's KV cache in use: the next token goes at this position."""
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        same = super().__eq__(other)
        return same if same is not True else self.blocks == other.blocks  # type: ignore[attr-defined]

    __hash__ = SequenceState.__hash__  # None: mutable, as its base

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq_id={self.seq_id}, tokens={list(self.tokens)!r}, blocks={self.blocks!r})"


LmSlots = MutableSequence[LmState | None]
"""One rank's slot array for the reference model."""


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
