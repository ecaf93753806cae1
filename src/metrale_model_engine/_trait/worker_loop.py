"""``run_worker``: the loop a worker rank runs until the head shuts it down."""

from __future__ import annotations

import logging
from collections.abc import MutableSequence
from dataclasses import dataclass

from .._core.errors import EpCommandFailed, EpReceiveError, RunStopped
from .._core.state import S
from .model_ep import ModelEp

_LOGGER = logging.getLogger("metrale_model_engine.worker")


@dataclass(frozen=True)
class WorkerSummary:
    """What a worker loop did: commands that ran to the end, and ones that failed.

    The shutdown header is not counted.
    """

    commands_run: int
    commands_failed: int


def run_worker(
    model: ModelEp[S],
    slots: MutableSequence[S | None],
    *,
    logger: logging.Logger | None = None,
) -> WorkerSummary:
    """Run ``model.ep_worker_step(slots)`` until it returns ``False`` (shutdown).

    For ranks above 0.  An [`EpCommandFailed`][metrale_model_engine.EpCommandFailed] is logged at error level with
    its cause and the loop goes on (the command was received; the head raised the
    same error).  Any other exception is logged and re-raised, and the process
    should exit: a [`RunStopped`][metrale_model_engine.RunStopped] (the run is over on every rank: a command
    that runs collectives failed, here or elsewhere), an [`EpReceiveError`][metrale_model_engine.EpReceiveError]
    (the link is gone) or anything else a step raised.  ``KeyboardInterrupt`` and
    ``SystemExit`` pass through untouched.

    Args:
        model: the worker's model; its ``is_ep()`` must be ``True``.
        slots: the worker's slot array, passed to every step.
        logger: where to log; default ``logging.getLogger("metrale_model_engine.worker")``.

    Returns:
        The counts of commands run and failed.

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
    run = failed = 0
    while True:
        try:
            if not model.ep_worker_step(slots):
                return WorkerSummary(commands_run=run, commands_failed=failed)
        except EpCommandFailed as error:
            failed += 1
            log.error("command failed, worker stays up: %s", error, exc_info=error)
            continue
        except RunStopped:
            log.exception("the run stopped, leaving the loop after %d commands", run + failed)
            raise
        except EpReceiveError:
            log.exception("worker receive failed, leaving the loop after %d commands", run + failed)
            raise
        except Exception:
            log.exception("worker step failed, leaving the loop after %d commands", run + failed)
            raise
        run += 1
