"""A toy multi-rank model with real commands, for the tests and the examples.

``ToyModel`` serves sequences in slots with four commands (alloc, prefill with a
prompt, decode, free).  Its "forward" is a rolling checksum over the tokens, so that
every rank's slot state can be compared by digest.  It runs over any link: shared
memory (``examples/shm_local.py``) or torch.distributed in the multi-rank tests, the
in-memory doubles of [`metrale_model_engine.testing`][metrale_model_engine.testing] in unit tests.

Each head method first checks everything that could fail, then sends the command
in one message (``EpLink.send_command``), then applies it locally; the worker hook
reads the whole command before applying it.  A failure therefore never leaves a
worker half way through a command.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, MutableSequence, Sequence
from typing import ClassVar, Final

from ._core.checks import check_slot
from ._core.namespace import PublicDir, public_dir
from ._core.state import SequenceState
from ._core.tokens import TokenArray, as_u32_buffer
from ._engine.link import EpLink
from ._trait.linked_ep import LinkedEp
from .batching import check_batch, recv_batch, send_batch

__all__ = ["VOCAB_SIZE", "ToyCommand", "ToyModel", "ToySlots", "ToyState", "slots_digest"]
__dir__: PublicDir = public_dir(globals(), __all__)

VOCAB_SIZE: Final[int] = 32_000
_CHECKSUM_MOD: Final[int] = (1 << 61) - 1


class ToyCommand(enum.IntEnum):
    """The toy model's command words (the shutdown word is the protocol's own)."""

    ALLOC = 1
    PREFILL = 2
    DECODE = 3
    FREE = 4
    DECODE_BATCH = 5


class ToyState(SequenceState):
    """A sequence's tokens plus the toy "KV state": a rolling checksum of them."""

    __slots__ = ("checksum",)
    checksum: int
    """The rolling checksum of every token consumed so far (0 for none)."""
    __hash__: ClassVar[None] = None  # mutable, like SequenceState

    def __init__(self, seq_id: int) -> None:
        super().__init__(seq_id)
        self.checksum = 0

    def consume(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` and fold them into [`checksum`][metrale_model_engine.toy.ToyState.checksum]."""
        tokens = list(tokens)
        self.extend(tokens)
        checksum = self.checksum
        for token in tokens:
            checksum = (checksum * 1_000_003 + token + 1) % _CHECKSUM_MOD
        self.checksum = checksum

    def next_token(self) -> int:
        """The token this state's greedy "forward" picks next."""
        return (self.checksum >> 11) % VOCAB_SIZE

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToyState):
            return NotImplemented
        return super().__eq__(other) and self.checksum == other.checksum


ToySlots = MutableSequence[ToyState | None]


class ToyModel(LinkedEp[ToyState]):
    """The toy model: head methods drive a command; workers run it in ``ep_run_command``.

    ``PREFILL`` carries the prompt as one token array and ``DECODE`` the chosen
    token as one follow-up word; ``ALLOC`` and ``FREE`` carry nothing more;
    ``DECODE_BATCH`` is a batched command ([`metrale_model_engine.batching`][metrale_model_engine.batching]): a
    decode step of several slots at once.  Each is one message.

    Args:
        link: the engine to speak through; it must carry ``seq_id`` on the wire
            (the toy serves several slots).

    Raises:
        ValueError: ``link.seq_id_on_wire`` is ``False``: every command would run in slot 0.
    """

    __slots__ = ("ep_link",)
    ep_link: EpLink

    def __init__(self, link: EpLink) -> None:
        if not link.seq_id_on_wire:
            raise ValueError(
                "ToyModel serves several slots, so its headers must carry seq_id: "
                "build its EpLink with seq_id_on_wire=True (the default) or protocol v2"
            )
        self.ep_link = link

    # -- head ----------------------------------------------------------------

    def alloc(self, slots: ToySlots, seq_id: int) -> None:
        """Start a sequence in the free slot ``seq_id`` on every rank."""
        state = _check(slots, seq_id, ToyCommand.ALLOC)
        self.ep_link.send_command(seq_id, ToyCommand.ALLOC)
        _apply(slots, seq_id, ToyCommand.ALLOC, state, ())

    def prefill(self, slots: ToySlots, seq_id: int, prompt: TokenArray) -> None:
        """Feed ``prompt`` to the live sequence ``seq_id`` on every rank.

        The prompt is checked before anything is sent.
        """
        state = _check(slots, seq_id, ToyCommand.PREFILL)
        tokens = as_u32_buffer("prompt", prompt)
        self.ep_link.send_command(seq_id, ToyCommand.PREFILL, tokens)
        _apply(slots, seq_id, ToyCommand.PREFILL, state, memoryview(tokens).tolist())

    def decode(self, slots: ToySlots, seq_id: int) -> int:
        """One decode step of ``seq_id``: the head picks the token, every rank appends it."""
        state = _check(slots, seq_id, ToyCommand.DECODE)
        assert state is not None
        token = state.next_token()
        self.ep_link.send_command(seq_id, ToyCommand.DECODE, token)
        _apply(slots, seq_id, ToyCommand.DECODE, state, (token,))
        return token

    def decode_batch(self, slots: ToySlots, seq_ids: Sequence[int]) -> list[int]:
        """One decode step of every sequence in ``seq_ids`` at once: the tokens the head picked, in order."""
        check_batch(seq_ids, slots)
        states = [slots[seq_id] for seq_id in seq_ids]
        tokens = [state.next_token() for state in states if state is not None]
        send_batch(self.ep_link, ToyCommand.DECODE_BATCH, seq_ids, tokens)
        for state, token in zip(states, tokens, strict=True):
            assert state is not None
            state.consume((token,))
        return tokens

    def free(self, slots: ToySlots, seq_id: int) -> None:
        """End the sequence in slot ``seq_id`` on every rank."""
        state = _check(slots, seq_id, ToyCommand.FREE)
        self.ep_link.send_command(seq_id, ToyCommand.FREE)
        _apply(slots, seq_id, ToyCommand.FREE, state, ())

    # -- worker --------------------------------------------------------------

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[ToyState | None]) -> None:
        """Read the whole command, then apply it to ``slots``."""
        payload: Sequence[int] = ()
        if cmd == ToyCommand.DECODE_BATCH:
            ids, tokens = recv_batch(self.ep_link, slots)
            for seq_id_in_batch, token in zip(ids, tokens, strict=True):
                state = slots[seq_id_in_batch]
                assert state is not None  # recv_batch checked it
                state.consume((token,))
            return
        if cmd == ToyCommand.PREFILL:
            payload = self.ep_link.recv_tokens()
        elif cmd == ToyCommand.DECODE:
            payload = (self.ep_link.recv_word(),)
        elif cmd not in (ToyCommand.ALLOC, ToyCommand.FREE):
            raise ValueError(f"unknown command word {cmd} for ToyModel (seq_id={seq_id})")
        command = ToyCommand(cmd)
        _apply(slots, seq_id, command, _check(slots, seq_id, command), payload)


def _check(slots: ToySlots, seq_id: int, cmd: ToyCommand) -> ToyState | None:
    """Raise unless ``cmd`` can run in ``slots[seq_id]``; return the slot's state."""
    check_slot(seq_id, slots)
    state = slots[seq_id]
    if cmd is ToyCommand.ALLOC:
        if state is not None:
            raise ValueError(f"alloc: slot {seq_id} is already in use")
    elif state is None:
        raise KeyError(f"{cmd.name.lower()}: slot {seq_id} is free")
    return state


def _apply(slots: ToySlots, seq_id: int, cmd: ToyCommand, state: ToyState | None, payload: Sequence[int]) -> None:
    """Apply a command that ``_check`` passed (``state`` is what it returned)."""
    if cmd is ToyCommand.ALLOC:
        slots[seq_id] = ToyState(seq_id)
    elif cmd is ToyCommand.FREE:
        slots[seq_id] = None
    else:
        assert state is not None
        state.consume(payload)


def slots_digest(slots: Sequence[ToyState | None]) -> str:
    """A short hex digest of every slot's state; equal on ranks that agree."""
    hasher = hashlib.sha256()
    for state in slots:
        if state is None:
            hasher.update(b"-;")
        else:
            hasher.update(repr((state.seq_id, state.checksum, list(state.tokens))).encode())
    return hasher.hexdigest()[:16]
