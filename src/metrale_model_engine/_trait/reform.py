"""``reform_link``: the head forms its model's link again over the ranks left once worker ranks are lost."""

from __future__ import annotations

from collections.abc import MutableSequence

from .._core.errors import RunStopped, error_text
from .._core.reform import DEFAULT_REFORM_TIMEOUT, Reform
from .._core.state import S
from .._engine.reform.head import reform_head
from .linked_ep import LinkedEp


def reform_link(
    model: LinkedEp[S], slots: MutableSequence[S | None], *, timeout: float = DEFAULT_REFORM_TIMEOUT
) -> Reform:
    """Head: once the run stopped because worker ranks were lost, form ``model``'s link again over the ranks left.

    For a model that opted in ([`LinkedEp.ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms]), on the
    [`RunStopped`][metrale_model_engine.RunStopped] its link raised: the head ends every
    worker's wait on the old group, finds who is left (the workers of its host by their
    processes, those of other hosts by their word or their silence), tells them the
    members of the next epoch, and they form a new transport (a new ring on one host, a
    new group through the old one's store across hosts, the leaders chosen again), the
    ranks renumbered in their order, the head 0; the setup agreement carries the new
    epoch.  A rank lost meanwhile makes it begin again without that rank; with no worker
    left, the head goes on alone (the single-GPU model).  Then ``model.ep_reformed(reform,
    slots)``.  The workers left rejoin by themselves
    ([`run_worker`][metrale_model_engine.run_worker]); one that the re-form left out, or
    that waited ``timeout`` for it in vain, ends as it would have.

    ``model.ep_link`` is the same link, in its new epoch.  Requests: fail those whose
    commands ``reform.failures`` names (a worker reported failing them before it went);
    ``reform.witnesses`` only saw another rank's failure.

    Args:
        model: the head's model (rank 0).
        slots: the head's slot array, passed to ``ep_reformed``.
        timeout: seconds the whole re-form may take (default
            [`DEFAULT_REFORM_TIMEOUT`][metrale_model_engine.reform.DEFAULT_REFORM_TIMEOUT]).

    Returns:
        What the re-form made of the head's link: the new epoch and world size, the
        ranks lost and how, the workers' reports, the times (``str()``: one line).

    Raises:
        RunStopped: it cannot re-form, in one line saying why (the model does not opt in,
            no worker was lost, the transport leaves no way, the workers were shut down),
            or it did not form within ``timeout``, or the head's ``ep_reformed`` failed
            (the link is closed then); the run stays stopped.
        EpRoleError: called on a worker.
        TypeError, ValueError: ``timeout`` is not a positive number of seconds.
    """
    reform = reform_head(model.ep_link, timeout)
    try:
        model.ep_reformed(reform, slots)
    except Exception as error:
        model.ep_link.close()
        raise RunStopped(
            f"head: the link re-formed at epoch {reform.epoch}, but the head's ep_reformed failed: "
            f"{error_text(error)}; the link is closed"
        ) from error
    return reform
