"""A lost worker, recovered on the head: ``Recovery``, what one recovery did and the time each part took, and
``Recovering``, a [`Server`][metrale_model_engine.reference.Server]'s way through one.

When worker ranks are lost, the run stops ([`RunStopped`][metrale_model_engine.RunStopped]).  A server that
recovers (``on_lost_rank="recover"``) then forms the link again over the ranks left
([`reform_link`][metrale_model_engine.reform.reform_link]: every rank reshards, reading only the slices it did not
hold, and empties its KV cache), fails the requests whose commands a worker reported failing before it went, and
puts every other running request back at the front of the queue with every token it has, its sampler with it, as a
preemption does: admitted again, each prefills its prompt and the tokens it generated on the new group, and its
stream goes on with the token that follows.  Nothing else changes for a request: its tokens, its seed, its stream.

One recovery, four parts, each timed on the head: *detect*, from the start of the step that met the loss to the
stop (the link names the lost rank and how once its exit shows); *re-form*, the link's new epoch; *reload*, the head's
own reshard (each worker reshards at the same time, on its side); *recompute*, from then until every request
carried on has its keys and values back (its last prefill chunk ran).  Once the last part is known, the recovery is
said in one line on the ``metrale_model_engine.reference`` logger (warning level).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...reform import LostRank, Reform
from ..requests import Completion

_LOGGER = logging.getLogger("metrale_model_engine.reference")


@dataclass
class Recovery:
    """One recovery from lost worker ranks, on the head of a [`Server`][metrale_model_engine.reference.Server].

    ``str()`` is its one line: the ranks lost and how, the world sizes, each part's time, the requests carried on
    and those failed.
    """

    epoch: int
    """The link's epoch after it."""
    ranks_before: int
    """Ranks before the loss."""
    world_size: int
    """Ranks after it (the head counts)."""
    lost: tuple[LostRank, ...]
    """The worker ranks lost (their ranks before the loss) and how."""
    detect_s: float
    """From the start of the step that met the loss to the stop."""
    reform_s: float
    """The link's re-form (``Reform.reform_seconds``)."""
    reload_s: float
    """The head's reshard, in its ``ep_reformed``."""
    requeued: tuple[int, ...]
    """The ids of the requests carried on (put back in the queue, to be computed again)."""
    failed: tuple[int, ...]
    """The ids of the requests failed: a worker reported failing their command before it went."""
    stopped_at: float
    """When the run stopped on the head (``time.monotonic()``)."""
    recompute_s: float | None = None
    """From the end of the reload until every request carried on had its keys and values back; ``None`` until then.
    Cut short when another loss comes first (``cut_short``)."""
    cut_short: bool = False
    """Another loss came before the recompute was done: ``recompute_s`` is the time until then."""
    ranks: tuple[int, ...] = ()
    """By rank after it, each rank's rank before the loss (``Reform.ranks``)."""

    def __str__(self) -> str:
        lost = "; ".join(map(str, self.lost)) or "no rank lost"
        recompute = "recompute pending" if self.recompute_s is None else f"recompute {1000 * self.recompute_s:.0f} ms"
        if self.cut_short:
            recompute += " (cut short by the next loss)"
        failed = ", ".join(map(str, self.failed)) or "none"
        return (
            f"recovered from lost workers ({lost}): {self.ranks_before} -> {self.world_size} rank(s) at epoch "
            f"{self.epoch}; detect {1000 * self.detect_s:.0f} ms, re-form {1000 * self.reform_s:.0f} ms, reload "
            f"{1000 * self.reload_s:.0f} ms, {recompute}; {len(self.requeued)} request(s) carried on, failed: {failed}"
        )


class Recovering:
    """A server's recovery in progress: its ``Recovery``, and the requests carried on whose keys and values are not
    back yet (see the module)."""

    def __init__(self, reform: Reform, step_began: float, requeued: list[Completion], failed: list[Completion]) -> None:
        reloaded = time.monotonic()
        self.recovery: Recovery = Recovery(
            epoch=reform.epoch,
            ranks_before=len(reform.ranks) + len(reform.lost),
            world_size=reform.world_size,
            lost=reform.lost,
            detect_s=max(reform.stopped_at - step_began, 0.0),
            reform_s=reform.reform_seconds,
            reload_s=reloaded - reform.formed_at,
            requeued=tuple(completion.request.id for completion in requeued),
            failed=tuple(completion.request.id for completion in failed),
            stopped_at=reform.stopped_at,
            ranks=reform.ranks,
        )
        self._reloaded = reloaded
        self._waiting = {completion.request.id: completion for completion in requeued}

    def back(self, prefilled: set[int]) -> bool:
        """After a step: the requests of ``prefilled`` (ids) have their keys and values back.  Once every request
        carried on has (or ended), the recompute's time is known and the line said: ``True``."""
        for request_id, completion in list(self._waiting.items()):
            if request_id in prefilled or completion.finish_reason is not None:
                del self._waiting[request_id]
        if self._waiting:
            return False
        self._said(cut_short=False)
        return True

    def cut_short(self) -> None:
        """Another loss came first: the recompute's time is until now; say the line."""
        self._said(cut_short=True)

    def _said(self, *, cut_short: bool) -> None:
        self.recovery.recompute_s = time.monotonic() - self._reloaded
        self.recovery.cut_short = cut_short
        _LOGGER.warning("%s", self.recovery)
