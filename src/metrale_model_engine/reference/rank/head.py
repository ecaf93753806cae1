"""The head's side of each command: ``HeadCommands`` checks it, sends it to the workers, then runs the same forward
as they do, inside ``with link.collective():`` where it makes all-reduces."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ... import EpLink, check_slot
from .checks import check_decode, check_prefill
from .commands import send_alloc, send_decode, send_free, send_prefill
from .runner import Forwards, LmRunner
from .slots import LmSlots, held_state
from .timing import TimeSpent


class HeadCommands:
    """The head's alloc, free, prefill and decode over ``link``; its sends' time goes to ``spent.protocol_s``.

    Each checks its arguments against the head's slots before anything is sent (so a
    refused call changes nothing), raises ``RunStopped`` first thing once the run is
    over, and sends one message.  Prefill and decode then run ``forwards``' forward of
    the command.  With one rank nothing is sent, and nothing paid.
    """

    def __init__(self, link: EpLink, runner: LmRunner, forwards: Forwards, spent: TimeSpent) -> None:
        self._link = link
        self._runner = runner
        self._forwards = forwards
        self._spent = spent

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        """Give slot ``seq_id`` a new, empty sequence on every rank (what it held is freed)."""
        self._link.raise_if_stopped()
        check_slot(seq_id, slots)
        self._send(send_alloc, seq_id)
        self._runner.new_sequence(slots, seq_id)

    def free(self, slots: LmSlots, seq_id: int) -> None:
        """Free slot ``seq_id`` on every rank; ``KeyError`` if it is free."""
        self._link.raise_if_stopped()
        held_state(slots, seq_id)
        self._send(send_free, seq_id)
        self._runner.end_sequence(slots, seq_id)

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        """Feed ``prompt[start : start + length]`` into slot ``seq_id`` on every rank; the logits after it."""
        self._link.raise_if_stopped()
        state = check_prefill(slots, seq_id, prompt, start, length, self._runner.config)
        self._send(send_prefill, seq_id, prompt, start, length)
        with self._link.collective():
            return self._forwards.forward_prefill(state, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step on every rank, slot ``seq_ids[i]`` feeding ``tokens[i]``; the logits, one row each."""
        self._link.raise_if_stopped()
        states = check_decode(slots, seq_ids, tokens, self._runner.config)
        self._send(send_decode, seq_ids, tokens)
        with self._link.collective():
            return self._forwards.forward_decode(states, tokens)

    def _send(self, send: Callable[..., None], *args: object) -> None:
        """``send(link, *args)``, one command to the workers, its time counted as protocol (one rank: nothing)."""
        if self._link.world_size > 1:  # one rank is the single-GPU model (at the start, or all that is left)
            started = time.perf_counter()
            send(self._link, *args)
            self._spent.protocol_s += time.perf_counter() - started
