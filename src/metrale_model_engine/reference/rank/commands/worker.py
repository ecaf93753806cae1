"""A worker's side of each command: ``WorkerHook`` receives it whole, checks it against the worker's own slots,
and runs the forward the head runs (the body of ``ReferenceLm.ep_run_command``)."""

from __future__ import annotations

from collections.abc import Sequence

from .... import EpLink
from ..checks import check_blocks, check_decode, check_decode_blocks, check_prefill
from ..runner import Forwards, LmRunner
from ..slots import LmSlots, LmState, held_state
from .words import CMD_ALLOC, CMD_DECODE, CMD_PREFILL, recv_alloc, recv_decode, recv_prefill


class WorkerHook:
    """Runs the reference model's commands as they reach a worker over ``link``; ``forwards`` runs their forwards.

    A prefill or decode that fails here in any way stops the run (they are the model's
    collective commands); a bad alloc or free fails as an ordinary command.  The block-table
    entries a command carries are the head's decision: checked, then followed.
    """

    def __init__(self, link: EpLink, runner: LmRunner, forwards: Forwards) -> None:
        self._link = link
        self._runner = runner
        self._forwards = forwards

    def check_slots(self, slots: Sequence[LmState | None]) -> None:
        """Raise ``ValueError`` unless ``slots`` has the link's slot count (a command for a slot this rank lacks could
        not even reach the hook, and the head would wait in its forward)."""
        if len(slots) != self._link.num_slots:
            raise ValueError(f"slots has {len(slots)} entries, but the link has num_slots={self._link.num_slots}")

    def run(self, seq_id: int, cmd: int, slots: LmSlots) -> bool:
        """Read command ``cmd`` whole, check it against ``slots``, run it; ``False`` for a word of no command here.

        Raises:
            What the receive, the checks (``check_prefill``, ``check_decode``, ``check_blocks``,
            ``check_decode_blocks``, ``held_state``) or the forward raise.
        """
        config, runner = self._runner.config, self._runner
        if cmd == CMD_DECODE:
            seq_ids, tokens, blocks = recv_decode(self._link, slots)
            states = check_decode(slots, seq_ids, tokens, config)
            for state, block in zip(check_decode_blocks(states, blocks, runner.pool), blocks, strict=True):
                runner.take_blocks(state, [block])
            self._forwards.forward_decode(states, tokens)
        elif cmd == CMD_PREFILL:
            prompt, start, length, cached, blocks = recv_prefill(self._link)
            state = check_prefill(slots, seq_id, prompt, start, length, config, cached=cached)
            check_blocks(state, blocks, start + length, runner.pool, cached=cached)
            runner.take_blocks(state, blocks, prompt[:cached])
            self._forwards.forward_prefill(state, prompt, start, length)
        elif cmd == CMD_ALLOC:
            if recv_alloc(self._link):
                runner.new_sequence(slots, seq_id)
            else:
                held_state(slots, seq_id)
                runner.end_sequence(slots, seq_id)
        else:
            return False
        return True
