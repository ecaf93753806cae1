"""A worker's part of a re-form: once its epoch ended, it joins the epoch the head forms, or ends as before."""

from __future__ import annotations

import logging
import time

from ..._core.checks import check_seconds
from ..._core.errors import error_text
from ..._core.reform import LostRank, Reform
from ..._core.transport import EpTransport
from ..link import EpLink, renew, shut_epoch, side_of

_LOGGER = logging.getLogger("metrale_model_engine.worker")


def rejoin(link: EpLink, timeout: object, logger: logging.Logger | None = None) -> Reform | None:
    """A worker's link, whose epoch ended (the run stopped, or its receive failed), in the epoch the head forms next.

    It closes its epoch, ends its waits on the old group, and waits up to ``timeout``
    seconds for the head to form the next epoch; it joins it if it is one of its
    members, else (or when the head ended the run, is gone, or formed none in time)
    it returns ``None``, having logged why: the worker then ends as it would have.
    An epoch that fails to form as it joins (a rank lost meanwhile) is followed to the next,
    or ends it as above; either way it first closes its end of that epoch and ends its
    waits there, as the head does when it abandons one, so that a member blocked on this
    rank in the epoch's setup agreement goes on at once rather than at the bound.

    Raises:
        TypeError, ValueError: ``timeout`` is not a positive number of seconds.
    """
    limit = check_seconds("timeout", timeout)
    assert limit is not None
    log = _LOGGER if logger is None else logger
    side, rank, world_size, who = side_of(link), link.rank, link.world_size, f"worker rank {link.rank}"
    regroup = side.regroup if side.opted_in else None
    if regroup is None:
        return None
    began = time.monotonic()
    deadline = began + limit
    regroup.wake()
    shut_epoch(link)
    stopped_at = side.stopped_at
    epoch, attempts = link.epoch + 1, 0
    while True:
        attempts += 1
        try:
            epoch, members = regroup.join(epoch, rank, lambda: side.gone(link.transport, head=False), deadline)
        except Exception as error:  # noqa: BLE001  (a plain transport error: the head is gone, or formed none in time)
            log.warning("%s: the link does not re-form: %s", who, error_text(error))
            return None
        if not members:
            log.warning("%s: the head ended the run: the link does not re-form", who)
            return None
        if rank not in members:
            log.warning("%s: epoch %d of the link formed without this rank (of ranks %s)", who, epoch, members)
            return None
        transport: EpTransport | None = None
        try:
            transport = regroup.attach(epoch, members, rank, deadline)
            renew(link, transport, epoch, max(deadline - time.monotonic(), 0.001))
        except Exception as error:  # noqa: BLE001  (a rank lost meanwhile: the head forms the next epoch)
            if transport is not None:
                transport.close()
            regroup.wake()  # as the head's abandon: the members waiting on this rank go on, as at its death
            if time.monotonic() >= deadline:
                log.warning("%s: epoch %d of the link did not form in time: %s", who, epoch, error_text(error))
                return None
            epoch += 1
            continue
        break
    side.regroup = regroup.carried(transport)
    return Reform(
        epoch=epoch,
        rank=link.rank,
        world_size=link.world_size,
        ranks=tuple(members),
        lost=tuple(LostRank(old, "") for old in range(world_size) if old not in members),
        failures=(),
        witnesses=(),
        stopped_at=stopped_at,
        began_at=began,
        formed_at=time.monotonic(),
        attempts=attempts,
    )


def leave(link: EpLink, why: str) -> None:
    """Worker: it leaves the run for ``why`` (it refused a command) and joins no re-form; the head need not wait."""
    side = side_of(link)
    if side.opted_in and side.regroup is not None:
        try:
            side.regroup.leave(link.rank, why)
        except Exception as error:  # noqa: BLE001  (best effort: the head finds it gone all the same)
            _LOGGER.debug("worker rank %d could not say that it leaves: %s", link.rank, error)
