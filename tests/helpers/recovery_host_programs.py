"""The reference model served across simulated hosts, one host lost whole: ``python -m helpers.recovery_host_programs
OUT [NEW_TOKENS GOES CHECKPOINT]``.

Two hosts of two ranks under :mod:`helpers.host_launch` (``auto``: a ``HostsTransport``,
rank 2 leading the other host).  The head serves the recovery tests' workload
(:data:`helpers.recovery_sessions.WORKLOAD`: four greedy requests and a seeded sampled
one for three slots; ``NEW_TOKENS`` each, default :data:`helpers.recovery_sessions.NEW_TOKENS`)
with ``Server``'s default ``on_lost_rank="recover"``; the shipped model, or ``CHECKPOINT``'s
(``-``: the shipped one).  Before step ``GOES`` (default :data:`HOST_GOES`) it asks the
test to kill the other host whole or cut its cable (it notes ``host-please``; the test
loses the host, then creates ``host-gone``): the step that follows meets the loss, the
link forms again over the head's own host (2 ranks, its ring) and every request carries
on.  Every rank saves what it saw (:mod:`helpers.rank_results`); the head also when each
token came (``time.monotonic()``, one clock for every simulated host).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from metrale_model_engine import run_worker
from metrale_model_engine.reference import LmSlots, ReferenceLm, Server
from metrale_model_engine.torch import init_group_from_env, open_link

from helpers.rank_results import note, save, wait_for_file
from helpers.recovery_sessions import NEW_TOKENS, PREFILL_CHUNK, QUIET, SLOTS, TIMEOUT, WORKLOAD, served

HOST_GOES = 4
"""The step before which the test kills the other host: requests are in flight (prefilled, decoding)."""
HEAD_LOST_AFTER = 5.0


def main(out: str, new_tokens: int = NEW_TOKENS, goes: int = HOST_GOES, checkpoint: str | None = None) -> None:
    torch.set_num_threads(1)
    init_group_from_env(backend="gloo")
    link = open_link("auto", num_slots=SLOTS, command_timeout=TIMEOUT, head_lost_after=HEAD_LOST_AFTER)
    model = ReferenceLm(link, checkpoint=checkpoint)
    origin, first = link.rank, type(link.transport).__name__
    if link.rank:
        slots: LmSlots = [None] * SLOTS
        summary = run_worker(model, slots, logger=QUIET, reform_timeout=TIMEOUT)
        save(out, origin, reforms=summary.reforms, transports=[first, type(link.transport).__name__])
        link.close()
        return
    came: list[float] = []
    server = Server(model, prefill_chunk=PREFILL_CHUNK, sync_every=1, on_token=lambda *_: came.append(time.monotonic()))
    for request in WORKLOAD:
        server.submit(dataclasses.replace(request, max_new_tokens=new_tokens))
    while server.busy:
        if server.steps + 1 == goes and not (Path(out) / "host-gone").exists():
            note(out, "host-please", at=time.monotonic())
            gone = wait_for_file(Path(out) / "host-gone", timeout=60.0)
            assert gone, "the test never killed the other host"
        server.step()
    server.shutdown()
    save(out, 0, **served(server), came=came, transports=[first, type(link.transport).__name__])
    link.close()


if __name__ == "__main__":
    if len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        out, new_tokens, goes, checkpoint = sys.argv[1:5]
        main(out, int(new_tokens), int(goes), None if checkpoint == "-" else checkpoint)
