"""The slot type: the per-sequence state that one slot of a rank holds."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from typing_extensions import TypeVar

from .words import check_u32, u32_values


class SequenceState:
    """Model-agnostic state of one sequence: its slot's ``seq_id`` and its tokens.

    Every rank keeps one slot array (``list[S | None]``, sized to
    ``--max-batch-size``); a model that needs device state (a KV cache, positions)
    subclasses this class and adds its own fields.  ``seq_id`` and every token are
    u32 words and are checked like them (``TypeError`` / ``ValueError`` naming the
    argument).  Two states are equal when their class, ``seq_id`` and tokens are.

    Args:
        seq_id: the slot index this state lives in.
        tokens: the token ids the sequence has consumed so far (copied).
    """

    __slots__ = ("__weakref__", "_seq_id", "_tokens")

    def __init__(self, seq_id: int, tokens: Iterable[int] = ()) -> None:
        self._seq_id = check_u32("seq_id", seq_id)
        self._tokens: list[int] = []
        self.extend(tokens)

    @property
    def seq_id(self) -> int:
        """The slot index this state lives in."""
        return self._seq_id

    @property
    def tokens(self) -> Sequence[int]:
        """The token ids consumed so far, oldest first (a read-only view)."""
        return self._tokens

    def append(self, token: int) -> None:
        """Record one consumed token; raises like [`check_u32`][metrale_model_engine.check_u32] for ``token``."""
        self._tokens.append(check_u32("token", token))

    def extend(self, tokens: Iterable[int]) -> None:
        """Record consumed tokens in order; nothing is recorded if one is invalid.

        Raises like [`check_u32`][metrale_model_engine.check_u32] for the first bad token, named ``tokens[i]``.
        """
        values = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
        self._tokens.extend(u32_values("tokens", values))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, SequenceState)
        return self._seq_id == other._seq_id and self._tokens == other._tokens

    __hash__: ClassVar[None] = None  # type: ignore[assignment]  # mutable: equal states may change

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq_id={self._seq_id}, tokens={self._tokens!r})"


S = TypeVar("S", bound=SequenceState, default=SequenceState)
"""The slot type of a model: [`SequenceState`][metrale_model_engine.SequenceState] or the model's own subclass."""
