"""One rank's slots of the reference model: ``LmState``, the sequence a slot holds, and ``LmSlots``, the array."""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence

from ... import SequenceState, check_slot


class LmState(SequenceState):
    """One sequence in its slot: the tokens fed so far, whose keys and values fill positions ``0 .. length - 1``."""

    __slots__ = ()

    @property
    def length(self) -> int:
        """Positions of the slot's KV cache in use: the next token goes at this position."""
        return len(self.tokens)


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
