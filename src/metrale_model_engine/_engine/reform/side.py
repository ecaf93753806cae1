"""``ReformSide``: what a link keeps across its epochs for its re-forms."""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..._core.reform import Reformable, Regroup
from ..._core.transport import EpTransport, NamesLostRanks
from ..._host.liveness import ended_processes


class ReformSide:
    """A link's side of its re-forms, kept across its epochs (``EpLink`` builds one; plain attributes).

    A model opts in (``LinkedEp.ep_reforms``): the link then keeps a re-form channel
    (``regroup``: the one its launcher offered, else its transport's own), which
    outlives each epoch's transport, and its head stops the run on a lost worker
    wherever it finds one.  A link whose model did not opt in keeps nothing of this.
    """

    __slots__ = ("local", "opted_in", "regroup", "stopped_at")

    def __init__(self, local: Mapping[int, int]) -> None:
        self.opted_in = False
        """The model opted in to re-forms."""
        self.regroup: Regroup | None = None
        """The channel of the re-forms: offered by the launcher (``offer``), else the transport's at the opt-in."""
        self.local = dict(local)
        """The pid of every worker of this rank's host, by rank, in the epoch now (the setup exchange's)."""
        self.stopped_at = 0.0
        """When this epoch's run stopped or its receive failed here (``time.monotonic()``); 0 while it goes on."""

    def offer(self, regroup: Regroup) -> None:
        """Keep ``regroup`` as the channel (the launcher's, which knows more than the transport); close one held."""
        if self.regroup is not None:
            self.regroup.close()
        self.regroup = regroup

    def opt_in(self, transport: EpTransport) -> None:
        """The model opted in: keep a channel (the offered one, else ``transport``'s own, if it offers one)."""
        self.opted_in = True
        if self.regroup is None and isinstance(transport, Reformable):
            self.regroup = transport.regroup()

    def gone(self, transport: EpTransport, head: bool) -> dict[int, str]:
        """The worker ranks of the epoch known gone, each with how: those of this rank's host whose process ended,
        and on the ``head`` those ``transport`` found lost (silent past ``head_lost_after``)."""
        gone = ended_processes(self.local)
        if head and isinstance(transport, NamesLostRanks):
            for rank, seconds in transport.lost_ranks().items():
                gone.setdefault(rank, f"fell silent: no heartbeat for {seconds:.1f} s, past head_lost_after")
        return gone

    def stopped(self) -> None:
        """This epoch's run stopped here (the first time counts)."""
        if not self.stopped_at:
            self.stopped_at = time.monotonic()

    def release(self, head: bool) -> None:
        """The link's owner closed it: no re-form comes (the head says so to the workers waiting); let go."""
        regroup, self.regroup = self.regroup, None
        if regroup is None:
            return
        try:
            if head and self.opted_in:
                regroup.end()
        finally:
            regroup.close()
