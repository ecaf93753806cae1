"""The head's side of each command: ``HeadCommands`` checks it, decides the blocks it gains, sends it to the
workers, then runs the same forward as they do, inside ``with link.collective():`` where it makes all-reduces."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .... import EpLink, check_slot
from ...blocks import KvBlocks
from ..checks import check_decode, check_prefill
from ..runner import Chunk, Forwards, LmRunner
from ..slots import LmSlots, LmState, held_state
from ..timing import TimeSpent
from .words import send_alloc, send_decode, send_free, send_prefill


class HeadCommands:
    """The head's alloc, free, prefill and decode over ``link``; its sends' time goes to ``spent.protocol_s``.

    Each checks its arguments against the head's slots before anything is sent (so a
    refused call changes nothing), raises ``RunStopped`` first thing once the run is
    over, and sends one message.  Prefill and decode take the blocks their positions
    need from ``blocks`` (what the slot holds there: reserved ahead by a scheduler, else
    allocated now), send them with the command, then run ``forwards``' forward of the
    command.  With one rank nothing is sent, and nothing paid.
    """

    def __init__(self, link: EpLink, runner: LmRunner, forwards: Forwards, spent: TimeSpent, blocks: KvBlocks) -> None:
        self._link = link
        self._runner = runner
        self._forwards = forwards
        self._spent = spent
        self._blocks = blocks

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Give slot ``seq_id`` a new, empty sequence on every rank (what it held is freed, its blocks with it; a
        reservation made for the free slot is kept)."""
        self._link.raise_if_stopped()
        check_slot(seq_id, slots)
        self._send(send_alloc, seq_id)
        if slots[seq_id] is not None:
            self._blocks.release(seq_id)
        self._runner.new_sequence(slots, seq_id)

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Free slot ``seq_id`` on every rank, and its blocks; ``KeyError`` if it is free."""
        self._link.raise_if_stopped()
        held_state(slots, seq_id)
        self._send(send_free, seq_id)
        self._runner.end_sequence(slots, seq_id)
        self._blocks.release(seq_id)

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Feed ``prompt[start : start + length]`` into slot ``seq_id`` on every rank; the logits after it.

        A new sequence whose reservation found a cached prefix starts after it (``KvBlocks.cached``).
        """
        self._link.raise_if_stopped()
        cached = self._blocks.cached(seq_id) if not held_state(slots, seq_id).length else 0
        state = check_prefill(slots, seq_id, prompt, start, length, self._runner.config, cached=cached)
        gained = self._gained(state, start + length)
        self._send(send_prefill, seq_id, prompt, start, length, cached, gained)
        with self._link.collective():
            self._runner.take_blocks(state, gained, prompt[:cached])
            logits = self._forwards.forward_prefill(state, prompt, start, length)
        self._blocks.filled(seq_id, state.tokens)
        return logits

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step on every rank, slot ``seq_ids[i]`` feeding ``tokens[i]``; the logits, one row each."""
        self._link.raise_if_stopped()
        states = check_decode(slots, seq_ids, tokens, self._runner.config)
        gaining, gained = self._starting_blocks(states)
        self._send(send_decode, seq_ids, tokens, gained)
        with self._link.collective():
            for state, block in zip(gaining, gained, strict=True):
                self._runner.take_blocks(state, [block])
            logits = self._forwards.forward_decode(states, tokens)
        for state in gaining:
            self._blocks.filled(state.seq_id, state.tokens)
        return logits

    def fused(self, slots: LmSlots, chunks: Sequence[Chunk], seq_ids: Sequence[int], tokens: Sequence[int]
              ) -> torch.Tensor:  # fmt: skip
        """One rank: ``chunks`` prefilled and a decode step, in one forward, everything checked before anything
        runs (see ``ReferenceLm.fused_step``)."""
        if self._link.world_size > 1:
            raise RuntimeError(
                "fused_step is the one-rank path: with several ranks (is_ep()) each prefill and decode is a command "
                "of its own"
            )
        named = [seq_id for seq_id, *_ in chunks] + list(seq_ids)
        if len(set(named)) != len(named):
            raise ValueError(f"a fused step names each slot once, got {named}")
        config = self._runner.config
        cached = [self._blocks.cached(seq_id) if not held_state(slots, seq_id).length else 0 for seq_id, *_ in chunks]
        checked = [
            (check_prefill(slots, seq_id, prompt, start, length, config, cached=hit), prompt, start, length)
            for (seq_id, prompt, start, length), hit in zip(chunks, cached, strict=True)
        ]
        states = check_decode(slots, seq_ids, tokens, config) if seq_ids else []
        lacking = sum(self._lacking(state, start + length) for state, _, start, length in checked)
        gaining = self._starting(states)
        self._check_free(lacking + len(gaining))
        for (state, prompt, start, length), hit in zip(checked, cached, strict=True):
            self._runner.take_blocks(state, self._gained(state, start + length), prompt[:hit])
        for state in gaining:
            self._runner.take_blocks(state, self._gained(state, state.length + 1))
        logits = self._runner.fused_step(checked, states, tokens)
        for state in [state for state, *_ in checked] + gaining:
            self._blocks.filled(state.seq_id, state.tokens)
        return logits

    def _gained(self, state: LmState, end: int) -> list[int]:
        """The blocks ``state``'s positions up to ``end`` need beyond its table, taken from its slot's."""
        blocks = self._blocks
        return blocks.table(state.seq_id, blocks.blocks_for(end))[len(state.blocks) :]

    def _lacking(self, state: LmState, end: int) -> int:
        """How many blocks ``state``'s positions up to ``end`` need that its slot does not hold yet."""
        blocks = self._blocks
        return max(0, blocks.blocks_for(end) - max(len(state.blocks), len(blocks.held(state.seq_id))))

    def _starting(self, states: Sequence[LmState]) -> list[LmState]:
        """The sequences whose next position starts a block their table lacks."""
        size = self._blocks.block_size
        return [state for state in states if len(state.blocks) * size <= state.length]

    def _starting_blocks(self, states: Sequence[LmState]) -> tuple[list[LmState], list[int]]:
        """The sequences of a decode step that start a block, and that block of each (all checked free first)."""
        gaining = self._starting(states)
        self._check_free(sum(self._lacking(state, state.length + 1) for state in gaining))
        return gaining, [self._gained(state, state.length + 1)[0] for state in gaining]

    def _check_free(self, lacking: int) -> None:
        """Raise ``RuntimeError`` (nothing changed) unless ``lacking`` blocks are free."""
        if lacking > self._blocks.free:
            blocks = self._blocks
            raise RuntimeError(
                f"the step needs {lacking} more KV block(s) of {blocks.block_size} tokens, but {blocks.free} of the "
                f"{blocks.num_blocks} are free: free a sequence first (a Server preempts one)"
            )

    def _send(self, send: Callable[..., None], *args: object) -> None:
        """``send(link, *args)``, one command to the workers, its time counted as protocol (one rank: nothing)."""
        if self._link.world_size > 1:  # one rank is the single-GPU model (at the start, or all that is left)
            started = time.perf_counter()
            send(self._link, *args)
            self._spent.protocol_s += time.perf_counter() - started
