"""A lost worker, timed: from its death to the head's ``RunStopped`` (detect), and the link's re-form (re-form).

4 ranks of the tests' tensor-parallel MLP (``tests/helpers/reform_sessions.py``) over
shared memory and over torch.distributed (gloo), on this machine; rank 3 is killed
(SIGKILL) at one of two points:

* ``hook``: in its command's hook, while the head and the others wait in the
  all-reduce (the collective fails as its sockets close);
* ``sync``: while the head waits at a sync point (its pidfd, or the broadcast).

Each run's times come from one ``CLOCK_MONOTONIC`` (``time.monotonic()`` in every
process): *detect* from the kill to the head's stop (the stop names the rank and how,
which waits for its exit to show), *re-form* from the head's ``reform_link`` to the
new link's setup agreement on the head (the workers' ``ep_reformed`` run meanwhile),
4 -> 3 ranks.  The time between the two is the head's own (its program's reaction),
not the link's.  Prints the median and range of each, per transport and point.  The
model's part of a recovery (reloading slices, recomputing KV) is not in these.

    python benchmarks/bench_reform.py [--runs N]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
from pathlib import Path
from typing import Any

import tests_path  # noqa: F401  (tests/ on the path: the programs are the tests')
from metrale_model_engine._host.launch import start_ranks_from_a_server
from metrale_model_engine.torch import run_group

from helpers.rank_results import load
from helpers.reform_sessions import losses


def one_run(kind: str, point: str) -> tuple[float, float]:
    """One loss of rank 3 of 4 at ``point`` over ``kind``: (detect, re-form) in seconds."""
    with tempfile.TemporaryDirectory() as out:
        codes = run_group(losses, 4, kind, {2: (point, 3)}, 3, out, timeout=120.0)
        if codes != [0, 0, 0, -9]:
            raise RuntimeError(f"the run over {kind!r} ended with exit codes {codes}")
        head: Any = load(Path(out), 1)[0]
        struck = pickle.loads((Path(out) / "struck3.pkl").read_bytes())["at"]
    (reform,) = head["reforms"]
    stopped, began, formed = reform["times"]
    return stopped - struck, formed - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each case (default 5)")
    runs = parser.parse_args().runs
    start_ranks_from_a_server(["metrale_model_engine.torch"])  # each run's ranks fork from one import of torch
    print(f"{'transport':<9} {'point':<5} {'detect ms (median, range)':<28} {'re-form ms (median, range)':<28}")
    for kind in ("shm", "torch"):
        for point in ("hook", "sync"):
            times = [one_run(kind, point) for _ in range(runs)]
            cells = []
            for column in zip(*times, strict=True):
                ms = [1000 * value for value in column]
                cells.append(f"{statistics.median(ms):7.1f} ({min(ms):.1f}-{max(ms):.1f})")
            print(f"{kind:<9} {point:<5} {cells[0]:<28} {cells[1]:<28}", flush=True)


if __name__ == "__main__":
    main()
