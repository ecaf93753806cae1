"""``run_worker``: the loop a worker rank runs until the head shuts it down."""

from __future__ import annotations

import logging
from collections.abc import MutableSequence
from dataclasses import dataclass

from .._core.errors import EpCommandFailed, EpCommandRefused, EpReceiveError, RunStopped, error_text
from .._core.reform import DEFAULT_REFORM_TIMEOUT
from .._core.state import S
from .._engine.reform.worker import leave, rejoin
from .linked_ep import LinkedEp
from .model_ep import ModelEp

_LOGGER = logging.getLogger("metrale_model_engine.worker")


@dataclass(frozen=True)
class WorkerSummary:
    """What a worker loop did: commands that ran to the end, and ones that failed.

    The shutdown header is not counted.
    """

    commands_run: int
    commands_failed: int
    reforms: int = 0
    """Re-forms of the link this worker went on through (``LinkedEp.ep_reforms``)."""


def run_worker(
    model: ModelEp[S],
    slots: MutableSequence[S | None],
    *,
    logger: logging.Logger | None = None,
    reform_timeout: float = DEFAULT_REFORM_TIMEOUT,
) -> WorkerSummary:
    """Run ``model.ep_worker_step(slots)`` until it returns ``False`` (shutdown).

    For ranks above 0.  An [`EpCommandFailed`][metrale_model_engine.EpCommandFailed] is logged at error level with
    its cause and the loop goes on (the command was received; the head raised the
    same error).  Any other exception is logged and re-raised, and the process
    should exit: a [`RunStopped`][metrale_model_engine.RunStopped] (the run is over on every rank: a command
    that runs collectives failed, here or elsewhere), an [`EpReceiveError`][metrale_model_engine.EpReceiveError]
    (the link is gone) or anything else a step raised.  ``KeyboardInterrupt`` and
    ``SystemExit`` pass through untouched.

    A model that re-forms ([`LinkedEp.ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms]) goes on instead
    through a ``RunStopped`` or ``EpReceiveError`` whose cause is a lost worker: the
    link rejoins the epoch the head forms next (waiting ``reform_timeout`` seconds at
    most), ``model.ep_reformed(reform, slots)`` takes up the new place, and the loop goes
    on; when none comes (the head ended the run, is gone, or left this rank out), the
    error is re-raised as without re-forms.  A worker that refuses a command
    ([`EpCommandRefused`][metrale_model_engine.EpCommandRefused]) leaves the run, as ever,
    and says so, so that the head does not wait for it.

    Args:
        model: the worker's model; its ``is_ep()`` must be ``True``.
        slots: the worker's slot array, passed to every step.
        logger: where to log; default ``logging.getLogger("metrale_model_engine.worker")``.
        reform_timeout: seconds a worker of a model that re-forms waits for the next epoch.

    Returns:
        The counts of commands run and failed, and of re-forms gone through.

    Raises:
        ValueError: ``model.is_ep()`` is ``False``: its default ``ep_worker_step``
            would return ``True`` forever.
        Exception: whatever a step raised other than [`EpCommandFailed`][metrale_model_engine.EpCommandFailed].

    After it returns (or raises), leave the group: with torch.distributed, call
    ``torch.distributed.destroy_process_group()`` before the process exits.
    ``metrale_model_engine.torch`` also does it from an exit hook when the program
    did not, since a gloo group torn down with the interpreter can abort the process.
    """
    if not model.is_ep():
        raise ValueError(
            f"run_worker() needs a multi-rank model, but {type(model).__name__}.is_ep() "
            "is False: its ep_worker_step would never receive a shutdown"
        )
    log = _LOGGER if logger is None else logger
    reforming = model if isinstance(model, LinkedEp) and model.ep_reforms else None
    run = failed = reforms = 0
    while True:
        try:
            if not model.ep_worker_step(slots):
                return WorkerSummary(commands_run=run, commands_failed=failed, reforms=reforms)
        except EpCommandFailed as error:
            failed += 1
            log.error("command failed, worker stays up: %s", error, exc_info=error)
            continue
        except EpCommandRefused as error:
            log.exception("the run stopped, leaving the loop after %d commands", run + failed)
            if reforming is not None:
                leave(reforming.ep_link, error_text(error))
            raise
        except (RunStopped, EpReceiveError) as error:
            if reforming is None or not _went_on(reforming, slots, error, reform_timeout, log):
                what = "the run stopped" if isinstance(error, RunStopped) else "worker receive failed"
                log.exception("%s, leaving the loop after %d commands", what, run + failed)
                raise
            reforms += 1
            continue
        except Exception:
            log.exception("worker step failed, leaving the loop after %d commands", run + failed)
            raise
        run += 1


def _went_on(
    model: LinkedEp[S], slots: MutableSequence[S | None], error: Exception, timeout: float, log: logging.Logger
) -> bool:
    """Whether ``model``'s link re-formed after ``error`` (its model then took up its new place)."""
    log.warning("%s; the link re-forms", error)
    reform = rejoin(model.ep_link, timeout, log)
    if reform is None:
        return False
    log.info("worker: %s; now rank %d", reform, reform.rank)
    model.ep_reformed(reform, slots)
    return True
