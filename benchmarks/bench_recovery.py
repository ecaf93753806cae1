"""A lost worker of the served reference model, timed: the recovery's split, and tokens/s before and after.

The shipped model, and the 118 M Mixtral of ``bench_serving.py`` (``real_model.py``:
written by ``transformers``, skipped without it), each serving the tests' workload
(``tests/helpers/recovery_sessions.py``: four greedy requests and a seeded sampled one
for three slots, ``--new-tokens`` each), in two kinds of loss:

* on this machine, at 4 ranks over shared memory and over torch.distributed (gloo):
  rank 3 kills itself (SIGKILL) in its ``--at``-th decode, and the run goes on at 3 ranks;
* on two simulated hosts of two ranks each (``tests/helpers/hosts.py``: network, mount and
  pid namespaces; a ``HostsTransport``): before the head's ``--at``-th step the other
  host is lost whole, its cable cut (nothing closes: the head learns of it from the
  heartbeats it no longer gets, past ``head_lost_after``) or every process of it killed
  (timed from the kill; the head steps on once they all ended), and the run goes on at
  2 ranks over the head's host's ring.  Simulated hosts need root
  and ``ip``: without them this case is skipped, and the output says why.

Each run's times come from one ``CLOCK_MONOTONIC`` (every process of the machine, simulated
hosts included):

* *detect*: from the loss to the head's stop (which names the ranks and how);
* *re-form*, *reload*, *recompute*: the head's ``Recovery`` (the link's new epoch; the
  head's reshard, reading only the slices it did not hold; until every request carried
  on has its keys and values back);
* *to next token*: from the loss to the next token streamed;
* tokens/s of the whole batch before the loss and after the recompute.

Prints the median and range of each over ``--runs`` runs, per model and kind of loss,
checks that every run's tokens equal a run that lost nothing (one rank, in this process),
and gives a verdict per row: the slowest run's loss to next token against #47's bound,
stated for the shipped model (4 -> 3 ranks on one host: 1 s over shared memory, 2 s over
torch; a lost remote host: ``head_lost_after`` + 1 s), and the load average after each
model's runs.

    python benchmarks/bench_recovery.py [--runs N] [--new-tokens N] [--at N] [--models shipped,118m]
        [--losses shm,torch,host]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import tests_path  # noqa: F401  (tests/ on the path: the programs are the tests')
from metrale_model_engine._host.launch import start_ranks_from_a_server
from metrale_model_engine.torch import run_group

from helpers import recovery_sessions as sessions
from helpers.bounded import finish
from helpers.hosts import SimulatedHosts, exit_codes, unavailable
from helpers.rank_results import load, read_note
from helpers.recovery_host_programs import HEAD_LOST_AFTER

COLUMNS = ("detect", "re-form", "reload", "recompute", "to next token")
BOUNDS_S = {"shm": 1.0, "torch": 2.0, "host cut": HEAD_LOST_AFTER + 1.0, "host killed": HEAD_LOST_AFTER + 1.0}
"""#47's bound from the loss to the next token streamed, per row: at 4 -> 3 ranks on one host per transport, and
for a lost remote host (``head_lost_after`` + 1 s)."""
MODELS = ("shipped", "118m")
LOSSES = ("shm", "torch", "host")
HOST_BOUND_S = 600.0
"""Seconds a simulated host's ranks may take before the run is given up."""

Figures = tuple[list[float], float, float]
"""One run's times of :data:`COLUMNS` in ms, and tokens/s before and after."""


def figures(head: Any, lost_at: float) -> Figures:
    """What the head saved (its one recovery, when each token came) of a run that lost ranks at ``lost_at``."""
    (recovery,) = head["times"]
    came: list[float] = head["came"]
    back = recovery["stopped_at"] + recovery["reform_s"] + recovery["reload_s"] + recovery["recompute_s"]
    before = [t for t in came if t < lost_at]
    after = [t for t in came if t > back]
    split = [recovery["stopped_at"] - lost_at, recovery["reform_s"], recovery["reload_s"], recovery["recompute_s"]]
    split.append(min(t for t in came if t > lost_at) - lost_at)
    return (
        [1000 * value for value in split],
        (len(before) - 1) / (before[-1] - before[0]),
        (len(after) - 1) / (after[-1] - after[0]),
    )


def one_run(kind: str, options: argparse.Namespace, want: dict[int, list[int]], checkpoint: str | None) -> Figures:
    """One loss of rank 3 of 4 over ``kind`` (``shm``, ``torch``) on this machine."""
    with tempfile.TemporaryDirectory() as out:
        plan = {3: ("decode", options.at)}
        codes = run_group(sessions.serve, 4, kind, plan, out, options.new_tokens, checkpoint, timeout=600.0)
        head: Any = load(Path(out), 1).get(0)
        if codes != [0, 0, 0, -9] or head is None or "tokens" not in head:
            raise RuntimeError(f"the run over {kind!r} ended with exit codes {codes}: {head}")
        if head["tokens"] != want:
            raise RuntimeError(f"the run over {kind!r} gave other tokens than a run that lost nothing")
        return figures(head, float(read_note(Path(out), "struck3")["at"]))  # type: ignore[arg-type]


def one_host_run(how: str, options: argparse.Namespace, want: dict[int, list[int]], checkpoint: str | None) -> Figures:
    """One loss of the other of two simulated hosts of two ranks, ``how``: its cable ``cut`` or its processes
    ``killed`` (``helpers.recovery_host_programs``)."""
    with tempfile.TemporaryDirectory() as out, SimulatedHosts(2) as hosts:
        argv = ["-m", "helpers.recovery_host_programs", out, str(options.new_tokens), str(options.at)]
        head_host, other = (hosts.ranks(host, 2, [*argv, checkpoint or "-"]) for host in range(2))
        deadline = time.monotonic() + HOST_BOUND_S
        while not Path(out, "host-please.pkl").exists():
            if time.monotonic() > deadline or head_host.poll() is not None:
                raise RuntimeError(f"the head never reached step {options.at}: {finish(head_host, 1.0)}")
            time.sleep(0.005)
        lost_at = time.monotonic()
        if how == "cut":
            hosts.cut(1)
        else:
            hosts.kill_all(other)  # returns once every process of that host ended: the head steps on after
        Path(out, "host-gone").touch()
        code, stdout, stderr = finish(head_host, HOST_BOUND_S)
        finish(other, HOST_BOUND_S)
        head: Any = load(Path(out), 1).get(0)
        if code or exit_codes(stdout) != {0: 0, 1: 0} or head is None or "tokens" not in head:
            raise RuntimeError(f"the run that lost a host ({how}) ended with {stdout!r}: {stderr}")
        if head["tokens"] != want:
            raise RuntimeError(f"the run that lost a host ({how}) gave other tokens than a run that lost nothing")
        return figures(head, lost_at)


def table(rows: Mapping[str, Callable[[], Figures]], runs: int) -> list[str]:
    """Print one row per loss (``runs`` runs of each); the verdict of each against its bound."""
    print(f"{'loss':<11} " + " ".join(f"{column:<22}" for column in COLUMNS) + " tokens/s before, after")
    verdicts = []
    for name, run in rows.items():
        results = [run() for _ in range(runs)]
        cells = []
        for column in zip(*(split for split, _, _ in results), strict=True):
            cells.append(f"{statistics.median(column):7.1f} ({min(column):.1f}-{max(column):.1f})")
        rates = f"{statistics.median(r[1] for r in results):6.0f}, {statistics.median(r[2] for r in results):6.0f}"
        print(f"{name:<11} " + " ".join(f"{cell:<22}" for cell in cells) + f" {rates}", flush=True)
        slowest = max(split[-1] for split, _, _ in results) / 1000
        within = "within" if slowest <= BOUNDS_S[name] else "OVER"
        verdicts.append(f"{name} {slowest:.2f} s, {within} {BOUNDS_S[name]:g} s")
    return verdicts


def measure(name: str, checkpoint: str | None, options: argparse.Namespace) -> None:
    """Print one model's tables, then the verdicts (#47 states its bounds for the shipped model; another model's
    verdict says so)."""
    want = sessions.unfailed(options.new_tokens, checkpoint)
    verdicts = []
    kinds = [kind for kind in ("shm", "torch") if kind in options.losses]
    if kinds:
        print(f"{name}, 4 -> 3 ranks, rank 3 killed in its decode {options.at}; ms: median (range)")
        rows = {kind: partial(one_run, kind, options, want, checkpoint) for kind in kinds}
        verdicts += table(rows, options.runs)
    why = unavailable()
    if "host" in options.losses and why is not None:
        print(f"{name}: the lost host is skipped: {why}")
    elif "host" in options.losses:
        print(
            f"{name}, 4 -> 2 ranks on 2 simulated hosts, the other host lost before the head's step {options.at} "
            f"(head_lost_after {HEAD_LOST_AFTER:g} s); ms: median (range)"
        )
        lost = {f"host {how}": partial(one_host_run, how, options, want, checkpoint) for how in ("cut", "killed")}
        verdicts += table(lost, options.runs)
    whose = "" if checkpoint is None else " (stated for the shipped model)"
    if verdicts:
        print(f"verdict, loss to next token (slowest of {options.runs} runs) against #47's bounds{whose}: "
              + "; ".join(verdicts))  # fmt: skip
    print(f"load average {' '.join(f'{load:.1f}' for load in os.getloadavg())}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each loss (default 5)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens each request generates (default 48)")
    parser.add_argument(
        "--at", type=int, default=16, help="the decode of rank 3 that it dies in; the head's step before which a host "
        "is lost (default 16)"
    )  # fmt: skip
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"which models, comma-separated (default {','.join(MODELS)})"
    )
    parser.add_argument(
        "--losses", default=",".join(LOSSES), help=f"which losses, comma-separated (default {','.join(LOSSES)})"
    )
    options = parser.parse_args()
    models = options.models.split(",")
    if not set(models) <= set(MODELS):
        parser.error(f"--models: each of {', '.join(MODELS)}, got {options.models!r}")
    options.losses = options.losses.split(",")
    if not set(options.losses) <= set(LOSSES):
        parser.error(f"--losses: each of {', '.join(LOSSES)}, got {','.join(options.losses)!r}")
    start_ranks_from_a_server(["metrale_model_engine.torch"])  # each run's ranks fork from one import of torch
    if "shipped" in models:
        measure("shipped model", None, options)
    if "118m" not in models:
        return
    import real_model

    with tempfile.TemporaryDirectory() as root:
        try:
            checkpoint = real_model.write_checkpoint(Path(root, "mixtral"), "mixtral", quick=False)
        except ImportError as missing:  # transformers writes it
            print(f"the 118 M checkpoint is skipped: {missing}")
            return
        measure(f"118 M Mixtral of bench_serving.py ({checkpoint.name})", str(checkpoint), options)


if __name__ == "__main__":
    main()
