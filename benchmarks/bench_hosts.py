"""Across hosts: a command through ``HostsTransport`` against the flat broadcast to every rank, side by side.

Runs on hosts simulated on this machine (``tests/helpers/hosts.py``: each host its
own network, mount and pid namespace on a bridge; root only), 2 hosts x
``--per-host`` ranks (2 by default), gloo.  Each round sends, in a fresh order,
``--calls`` messages of each case:

* ``flat``: :class:`~metrale_model_engine.torch.TorchTransport` over the whole
  group (a broadcast to every worker);
* ``hosts``: :class:`~metrale_model_engine.torch.HostsTransport` (``"auto"``: the
  head's ring, one broadcast to the other host's leader, its ring);
* ``gloo to N``: a raw broadcast of the same message to N workers, those of the
  other host first (groups of the head and 1, 2 or 3 workers): the cost model's
  network term.

Messages of 3 words (a v2 header) and of 137 words (a batched decode of 64 pairs,
as one message), sent at the transport, where the two paths differ.  A call is
timed from the head's start to the slowest worker holding the message (one
``CLOCK_MONOTONIC`` for every namespace: they share the kernel), with a pause
between calls so that none queues behind another.  And a sync point's round trip,
timed at the head: the sync item out, each worker's acknowledgement back (flat: one
receive per worker; hosts: the head's ring, and one bundle from the other host's
leader, which reads its reader's on their ring).  Prints medians, the ratios paired
by round, and the cost model's predictions for 2 x 8 and 4 x 8 ranks.  No target:
figures, to set beside those predictions.

Run (as root): ``python benchmarks/bench_hosts.py`` (about 20 s here), with
``--per-host 4`` or ``--per-host 8`` on a machine with a core per rank; ``--quick``
for a smoke run.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Final

import torch.distributed as dist

from metrale_model_engine.shm import DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME, ShmTransport
from metrale_model_engine.torch import HostsTransport, TorchTransport, init_group_from_env, open_transport
from metrale_model_engine.wire import Ack, encode_ack

SIZES: Final = {"header": 3, "decode 64 pairs": 137, "sync point": 3}
SYNC: Final = "sync point"
"""The case timed at the head, round trip: the message out, every worker's acknowledgement back."""
ACK: Final = encode_ack(Ack(1, 0, 0, 0, None))
PAUSE: Final = 0.002
"""Seconds between two calls: the workers wait idle, as between a server's steps."""


def serve(out: Path, rounds: int, calls: int, spin: float | None) -> None:
    """One rank's part: every case of every round, in the order the seed gives every rank."""
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    spin_time, max_spin_time = (DEFAULT_SPIN_TIME, DEFAULT_MAX_SPIN_TIME) if spin is None else (spin, spin)
    init_group_from_env(backend="gloo")
    rank = dist.get_rank()
    paths: dict[str, TorchTransport | ShmTransport | HostsTransport] = {
        "flat": open_transport("torch", heartbeat=None),
        "hosts": open_transport("auto", heartbeat=None, spin_time=spin_time, max_spin_time=max_spin_time),
    }
    assert isinstance(paths["hosts"], HostsTransport)
    others = [*range(per_host, 2 * per_host), *range(1, per_host)]  # the other host's workers first
    for receivers in (others[:1], others[:2], others[:3]):
        group = dist.new_group([0, *receivers])
        if rank in (0, *receivers):
            paths[f"gloo to {len(receivers)}"] = TorchTransport(group, heartbeat=None)
    order = random.Random(7)
    times: dict[tuple[str, str], list[list[float]]] = {}
    sends: dict[tuple[str, str], list[list[float]]] = {}  # the head's: how long its send took
    everyone = sorted(
        {(path, size) for path in ("flat", "hosts", "gloo to 1", "gloo to 2", "gloo to 3") for size in SIZES}
        - {(f"gloo to {n}", SYNC) for n in (1, 2, 3)}
    )
    for _ in range(rounds):
        shuffled = everyone[:]
        order.shuffle(shuffled)
        for path, size in shuffled:
            transport = paths.get(path)
            if transport is None:
                continue
            message = array("I", range(SIZES[size])).tobytes()
            samples = times.setdefault((path, size), [])
            stamps, costs = [], []
            for _ in range(calls):
                if rank == 0:
                    time.sleep(PAUSE)
                    stamps.append(time.monotonic())
                    transport.send((message,), 10.0)
                    costs.append(time.monotonic() - stamps[-1])
                    if size == SYNC:
                        for worker in range(1, transport.world_size):
                            while not transport.receive_answers(worker, 10.0):
                                pass
                        stamps[-1] = time.monotonic() - stamps[-1]  # the round trip, at the head alone
                else:
                    transport.receive(10.0)
                    stamps.append(time.monotonic())
                    if size == SYNC:
                        transport.answer(ACK, 10.0)
                        transport.flush_answers(10.0)
            samples.append(stamps)
            sends.setdefault((path, size), []).append(costs)
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps((times, sends)))
    for transport in paths.values():
        transport.close()
    dist.destroy_process_group()


def latencies(
    out: Path, world_size: int
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[float]]]:
    """Per case, each round's median latency (µs): head's start to the slowest worker that took part; and
    each round's median time the head spent in its send (µs)."""
    both = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
    ranks = [times for times, _ in both]
    sends = {case: [1e6 * statistics.median(costs) for costs in rounds] for case, rounds in both[0][1].items()}
    found: dict[tuple[str, str], list[float]] = {}
    for case, rounds in ranks[0].items():
        if case[1] == SYNC:  # the head timed the round trip itself
            found[case] = [1e6 * statistics.median(durations) for durations in rounds]
            continue
        for index, started in enumerate(rounds):
            ends = [ranks[rank][case][index] for rank in range(1, world_size) if case in ranks[rank]]
            per_call = [1e6 * (max(end[call] for end in ends) - started[call]) for call in range(len(started))]
            found.setdefault(case, []).append(statistics.median(per_call))
    return found, sends


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 10 calls")
    parser.add_argument("--per-host", type=int, default=2, help="ranks on each of the 2 hosts (default 2)")
    parser.add_argument("--spin", type=float, help="the rings' spin, fixed (default: learned, as open_transport's)")
    parser.add_argument("--serve", nargs=4, metavar=("OUT", "ROUNDS", "CALLS", "SPIN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        out, rounds, calls, spin = args.serve
        serve(Path(out), int(rounds), int(calls), None if spin == "learned" else float(spin))
        return 0
    import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)

    from helpers.bounded import finish
    from helpers.hosts import SimulatedHosts, exit_codes, unavailable

    why = unavailable()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    rounds, calls = (3, 10) if args.quick else (args.rounds, args.calls)
    per_host = args.per_host
    if per_host < 2:
        print("error: --per-host must be at least 2 (a host of one rank has no ring)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder, SimulatedHosts(2) as hosts:
        out = Path(folder)
        spin = "learned" if args.spin is None else str(args.spin)
        argv = [str(Path(__file__).resolve()), "--serve", str(out), str(rounds), str(calls), spin]
        started = [hosts.ranks(host, per_host, argv) for host in range(2)]
        for process in started:
            code, stdout, stderr = finish(process, 600)
            if code or any(exit_codes(stdout).values()):
                print(stdout, stderr, file=sys.stderr)
                return 1
        found, sends = latencies(out, 2 * per_host)
    report(found, rounds, calls, "learned" if args.spin is None else f"fixed at {args.spin:g} s", per_host)
    report_sends(sends)
    return 0


def report(found: dict[tuple[str, str], list[float]], rounds: int, calls: int, spin: str, per_host: int) -> None:
    print(
        f"2 simulated hosts x {per_host} ranks, gloo, {rounds} rounds x {calls} calls, "
        f"{PAUSE * 1e3:g} ms between calls, the rings' spin {spin}"
    )
    print("medians of the rounds' medians, µs, head's start to the slowest worker holding the message")
    print("(a sync point: the head's round trip, the sync item out and every acknowledgement back)")
    print(f"{'case':<34}{'median':>10}{'p25-p75':>20}")
    for (path, size), samples in sorted(found.items()):
        quartiles = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
        print(f"{path + ', ' + size:<34}{statistics.median(samples):>10.1f}{quartiles[0]:>10.1f}-{quartiles[2]:<9.1f}")
    for size in SIZES:
        paired = [flat / hosts for flat, hosts in zip(found["flat", size], found["hosts", size], strict=True)]
        print(f"{size}: flat / hosts, paired by round: {statistics.median(paired):.2f}")
    network = {n: statistics.median(found[f"gloo to {n}", "header"]) for n in (1, 2, 3)}
    slope = (network[3] - network[1]) / 2
    ring_hop = statistics.median(found["hosts", "header"]) - network[1]
    print(
        f"cost model (header): a gloo broadcast to n remote workers ~ {network[1] - slope:.1f} + {slope:.1f} n µs "
        f"(measured n = 1, 2, 3: {network[1]:.1f}, {network[2]:.1f}, {network[3]:.1f}); "
        f"hosts = broadcast to hosts - 1 leaders + a ring hop ({ring_hop:.1f} µs here)"
    )
    for hosts, ranks in ((2, 8), (4, 8)):
        flat = network[1] + slope * (hosts * ranks - 2)
        hier = network[1] + slope * (hosts - 2) + ring_hop
        print(f"predicted {hosts} x {ranks}: flat {flat:.0f} µs, hosts {hier:.0f} µs, flat / hosts {flat / hier:.1f}x")


def report_sends(sends: dict[tuple[str, str], list[float]]) -> None:
    """The head's own cost of a send (what its scheduler waits for), flat against hosts: no target, a figure."""
    print("the head's time in its send, µs (medians of the rounds' medians), flat / hosts paired by round:")
    for size in ("header", "decode 64 pairs"):
        flat, hosts = sends["flat", size], sends["hosts", size]
        paired = statistics.median(f / h for f, h in zip(flat, hosts, strict=True))
        print(f"  {size}: flat {statistics.median(flat):.1f}, hosts {statistics.median(hosts):.1f}, {paired:.2f}x")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
