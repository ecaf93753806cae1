"""A run whose model re-forms, across simulated hosts: ``python -m helpers.reform_host_programs OUT``.

Two hosts of two ranks under :mod:`helpers.host_launch` (``auto``: a ``HostsTransport``,
rank 2 leading the other host).  Rank 2 kills itself in its hook at step 2: the link
forms again over ranks 0, 1 and 3, and the other host is led by rank 3, now rank 2
of 3.  Before step 4 the head asks the test to kill the other host whole (it notes
``host-please``; the test kills the host, then creates ``host-gone``): the head
finds its rank silent and goes on with rank 1 alone, over its own host's ring.
Every rank saves what it saw (:mod:`helpers.rank_results`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from metrale_model_engine import RunStopped, run_worker
from metrale_model_engine.reform import reform_link
from metrale_model_engine.torch import init_group_from_env, open_link

from helpers.rank_results import note, save, wait_for_file
from helpers.reform_sessions import QUIET, TIMEOUT, Sharded, Slots, expected, reform_fields

STEPS = 6
HOST_GOES = 4
"""The step before which the test kills the other host."""
HEAD_LOST_AFTER = 5.0


def main(out: str) -> None:
    torch.set_num_threads(1)
    init_group_from_env(backend="gloo")
    link = open_link("auto", num_slots=2, command_timeout=TIMEOUT, head_lost_after=HEAD_LOST_AFTER)
    model = Sharded(link, {2: ("hook", 2)}, out)
    transports = [type(link.transport).__name__]
    slots: Slots = [None, None]
    if link.rank:
        summary = run_worker(model, slots, logger=QUIET, reform_timeout=TIMEOUT)
        save(out, model.origin, summary=summary, reforms=model.reforms, transport=type(link.transport).__name__)
        link.close()
        return
    outs, stops, reforms = [], [], []
    step = 1
    while step <= STEPS:
        if step == HOST_GOES and not (Path(out) / "host-gone").exists():
            note(out, "host-please", at=time.monotonic())
            gone = wait_for_file(Path(out) / "host-gone", timeout=60.0)
            assert gone, "the test never killed the other host"
        try:
            result = model.forward(step)
            assert result == expected(step), (step, result)
            outs.append(result)
            step += 1
        except RunStopped as stopped:
            stops.append(str(stopped))
            reforms.append(reform_fields(reform_link(model, slots, timeout=TIMEOUT)))
            transports.append(type(link.transport).__name__)
    link.shutdown_workers()
    save(out, 0, outs=outs, stops=stops, reforms=reforms, transports=transports)
    link.close()


if __name__ == "__main__":
    main(sys.argv[1])
