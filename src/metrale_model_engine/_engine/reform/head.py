"""The head's re-form: once workers are lost, it decides who forms the next epoch and forms it, again without any
rank lost meanwhile, all within one bound."""

from __future__ import annotations

import time

from ..._core.checks import check_seconds
from ..._core.errors import EpRoleError, RunStopped, error_text
from ..._core.reform import LostRank, Reform
from ..._core.transport import EpTransport
from ..link import EpLink, renew, side_of


def reform_head(link: EpLink, timeout: object) -> Reform:
    """The head's link, whose run stopped because worker ranks were lost, formed again over the ranks left.

    ``reform_link`` states the contract.

    Raises:
        RunStopped: it cannot re-form (the message says why), or could not within ``timeout``.
        EpRoleError: ``link`` is a worker's.
        TypeError, ValueError: ``timeout`` is not a positive number of seconds.
    """
    limit = check_seconds("timeout", timeout)
    assert limit is not None
    began = time.monotonic()
    if link.rank != 0:
        raise EpRoleError(f"only the head (rank 0) re-forms the link; worker rank {link.rank} rejoins it (run_worker)")
    side, stopped = side_of(link), link.stopped
    why = _cannot(link)
    if why:
        raise RunStopped(
            f"head: the link cannot re-form: {why}", *((stopped.failures, stopped.ranks) if stopped else ())
        )
    assert stopped is not None and side.regroup is not None
    regroup, deadline, stopped_at = side.regroup, began + limit, side.stopped_at or began
    lost = side.gone(link.transport, head=True)
    regroup.wake()
    members = [rank for rank in range(link.world_size) if rank not in lost]
    epoch, attempts = link.epoch, 0
    while True:
        epoch, attempts = epoch + 1, attempts + 1
        members = regroup.survivors(epoch, members, lost, lambda: side.gone(link.transport, head=True), deadline)
        if not lost:  # every worker lives and came: the run stopped for another reason, which a re-form cannot mend
            raise RunStopped(
                f"head: the link cannot re-form: no worker rank was lost (the run stopped: {stopped})",
                stopped.failures,
                stopped.ranks,
            )
        transport: EpTransport | None = None
        try:
            transport = regroup.form(epoch, members, deadline)
            renew(link, transport, epoch, max(deadline - time.monotonic(), 0.001))
        except Exception as error:  # the setup's EpLinkError, a plain transport error, the backend's own
            if transport is not None:
                regroup.abandon(transport)
            if time.monotonic() >= deadline:
                raise RunStopped(
                    f"head: the link could not re-form within {limit:g} s: epoch {epoch} of rank(s) {members} failed "
                    f"to form ({error_text(error)}); lost: {_lost_text(lost)}",
                    stopped.failures,
                    sorted(lost),
                ) from error
            continue
        break
    side.regroup = regroup.carried(transport)
    return Reform(
        epoch=epoch,
        rank=0,
        world_size=len(members),
        ranks=tuple(members),
        lost=tuple(LostRank(rank, how) for rank, how in sorted(lost.items())),
        failures=tuple(failure for failure in stopped.failures if not failure.witness),
        witnesses=tuple(failure for failure in stopped.failures if failure.witness),
        stopped_at=stopped_at,
        began_at=began,
        formed_at=time.monotonic(),
        attempts=attempts,
    )


def _cannot(link: EpLink) -> str:
    """Why ``link`` cannot re-form now, or ``""`` (whether a worker was lost, only its channel can tell)."""
    side = side_of(link)
    if not side.opted_in:
        return "its model does not re-form (LinkedEp.ep_reforms is False): a lost worker ends the run"
    if side.regroup is None:
        return (
            "its transport leaves no way for the ranks to meet again (a link opened with open_link, or over a "
            "ShmTransport, re-forms), or the link was closed"
        )
    if link.stopped is None:
        return "its run did not stop (a re-form follows a RunStopped whose cause is lost workers)"
    if link.workers_shut_down:
        return "its workers were shut down"
    return ""


def _lost_text(lost: dict[int, str]) -> str:
    return "; ".join(str(LostRank(rank, how)) for rank, how in sorted(lost.items()))
