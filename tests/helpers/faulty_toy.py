"""The toy model with the test-only commands that rank programs send to make a worker fail, die or stall."""

from __future__ import annotations

import os
import signal
from collections.abc import MutableSequence
from typing import Final

from metrale_model_engine.toy import ToyModel, ToyState

CMD_CHECK: Final = 50
"""One follow-up word, a rank: the worker of that rank fails the command (0, the head: none fails)."""
CMD_DIE: Final = 51
"""One follow-up word, a rank: the worker of that rank kills itself with SIGKILL."""
CMD_PLACEHOLDER: Final = 52
"""A follow-up word ``n``, then tokens received into an ``n``-token placeholder."""


class FaultyToy(ToyModel):
    """The toy model plus :data:`CMD_CHECK`, :data:`CMD_DIE` and :data:`CMD_PLACEHOLDER`."""

    __slots__ = ()

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[ToyState | None]) -> None:
        link = self.ep_link
        if cmd == CMD_CHECK:
            if link.recv_word() == link.rank:
                raise RuntimeError(f"injected failure on rank {link.rank}")
        elif cmd == CMD_DIE:
            if link.recv_word() == link.rank:
                os.kill(os.getpid(), signal.SIGKILL)
        elif cmd == CMD_PLACEHOLDER:
            placeholder = range(link.recv_word())
            state = slots[seq_id] or ToyState(seq_id)
            state.consume(self.ep_broadcast_tokens(placeholder))
            slots[seq_id] = state
        else:
            super().ep_run_command(seq_id, cmd, slots)
