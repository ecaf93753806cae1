"""Latency of our broadcasts against the floor and the pickle-based peer, in one run.

Cases, per call:

* headers: v1 and v2 (ours, ``ep_broadcast_cmd_for_seq`` on the head and
  ``ep_worker_step`` on the workers), and a v2 header sent as two one-word
  broadcasts (seq_id, then cmd, as the Rust engine does);
* token arrays of 1, 128, 4,096 and 65,536 tokens through ``ep_broadcast_tokens``,
  from a ``list[int]`` and from an ``array('I')`` (workers get a list), and
  through ``ep_broadcast_tokens_into`` (buffer to buffer);
* the floor: a raw ``torch.distributed.broadcast`` of a preallocated int32 tensor
  of the same number of words; for arrays longer than a frame holds, also the
  "count+floor": two raw broadcasts, a length word then the words, which is what an
  array whose length travels with it costs at the least;
* the peer: ``torch.distributed.broadcast_object_list`` of the same payload.

The backend is NCCL when there is a CUDA device per rank, gloo otherwise.

A sample is ``--calls`` back-to-back calls of one case, timed from the head's start
to the moment the slowest worker has its values (``time.perf_counter`` reads
CLOCK_MONOTONIC, one clock for every process of the machine).  Every round runs
every case once, in a fresh random order, so the cases interleave (A B A B...);
warm-up rounds are dropped.  Prints medians with the 25th-75th percentile spread
and the ratios of the medians ("paired": the median over rounds of ours/floor
within the same round, which cancels drift between rounds), writes the raw figures as JSON and a log-log PNG plot.

    python benchmarks/bench_protocol.py [--quick] [--world-size N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from metrale_model_engine import INLINE_TOKENS, WIRE_VERSION, EpProtocol, SequenceState
from metrale_model_engine.torch import TorchEp, default_backend, run_local

TOKEN_SIZES = (1, 128, 4_096, 65_536)
SEQ_ID, CMD = 3, 7


class BenchModel(TorchEp[SequenceState]):
    """A worker whose commands do nothing: the header path is all that is timed."""

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        return None


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # "ours", "floor", "peer"
    kind: str  # "header", "tokens-list", "tokens-buffer", "tokens-into", "words", "words2"
    words: int  # u32 words per call on the wire (payload size)
    head: Callable[[], object]
    worker: Callable[[], object]


def send_split(model: BenchModel) -> None:
    """The v2 header as two one-word broadcasts, seq_id first."""
    model.ep_broadcast_cmd(SEQ_ID)
    model.ep_broadcast_cmd(CMD)


def receive_split(model: BenchModel) -> tuple[int, int]:
    return model.ep_recv_cmd(), model.ep_recv_cmd()


def broadcast_two(count: torch.Tensor, payload: torch.Tensor) -> None:
    """Two raw broadcasts: a length word, then the payload (what a length-prefixed array needs)."""
    dist.broadcast(count, src=0)
    dist.broadcast(payload, src=0)


def send_object(payload: object) -> object:
    """The peer: one pickled object from rank 0 (workers pass None and get it)."""
    holder = [payload]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def build_cases(rank: int) -> list[Case]:
    v1 = BenchModel(num_slots=8, protocol=EpProtocol.V1)
    v2 = BenchModel(num_slots=8, protocol=EpProtocol.V2)
    slots: list[SequenceState | None] = [None] * 8
    cases = [
        Case(
            "header v1 (ours)",
            "ours",
            "header",
            1,
            lambda: v1.ep_broadcast_cmd_for_seq(SEQ_ID, CMD),
            lambda: v1.ep_worker_step(slots),
        ),
        Case(
            "header v2 (ours)",
            "ours",
            "header",
            2,
            lambda: v2.ep_broadcast_cmd_for_seq(SEQ_ID, CMD),
            lambda: v2.ep_worker_step(slots),
        ),
        Case(
            "header v2, two broadcasts", "ours", "header-split", 2, partial(send_split, v2), partial(receive_split, v2)
        ),
        Case("peer header", "peer", "header", 2, partial(send_object, [SEQ_ID, CMD]), partial(send_object, None)),
    ]
    floor_sizes = sorted({1, 2, *TOKEN_SIZES})
    for words in floor_sizes:
        tensor = torch.zeros(words, dtype=torch.int32)
        raw = partial(dist.broadcast, tensor, src=0)
        cases.append(Case(f"floor {words} words", "floor", "words", words, raw, raw))
    for n in TOKEN_SIZES:
        if n > INLINE_TOKENS:  # the fair floor of an array whose length travels with it
            count = torch.zeros(1, dtype=torch.int32)
            payload = torch.zeros(n, dtype=torch.int32)
            both = partial(broadcast_two, count, payload)
            cases.append(Case(f"floor count+{n} words", "floor", "words2", n, both, both))
    for n in TOKEN_SIZES:
        tokens = [(i * 7919) % 32_000 for i in range(n)]
        buffer = array("I", tokens)
        target = array("I", bytes(4 * n))
        placeholder = range(n)
        receive_list = partial(v2.ep_broadcast_tokens, placeholder)
        cases += [
            Case(
                f"tokens {n} from list (ours)",
                "ours",
                "tokens-list",
                n,
                partial(v2.ep_broadcast_tokens, tokens),
                receive_list,
            ),
            Case(
                f"tokens {n} from buffer (ours)",
                "ours",
                "tokens-buffer",
                n,
                partial(v2.ep_broadcast_tokens, buffer),
                receive_list,
            ),
            Case(
                f"tokens {n} buffer into buffer (ours)",
                "ours",
                "tokens-into",
                n,
                partial(v2.ep_broadcast_tokens_into, buffer),
                partial(v2.ep_broadcast_tokens_into, target),
            ),
            Case(f"peer tokens {n}", "peer", "tokens", n, partial(send_object, tokens), partial(send_object, None)),
        ]
    return cases


def profile_main(rank: int, world_size: int, name: str, calls: int, out: str) -> None:
    """Run one case ``calls`` times under cProfile on every rank; each rank prints its top functions."""
    import cProfile
    import io
    import pstats

    (case,) = [c for c in build_cases(rank) if c.name == name]
    call = case.head if rank == 0 else case.worker
    for _ in range(3):
        call()
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(6)
    role = "head" if rank == 0 else f"worker {rank}"
    Path(out, f"profile-rank{rank}.txt").write_text(f"== {role}: {name}, {calls} calls\n{text.getvalue()}")


def rank_main(rank: int, world_size: int, rounds: int, warmup: int, calls: int, seed: int, out: str) -> None:
    cases = build_cases(rank)
    starts: list[list[int]] = [[] for _ in cases]
    ends: list[list[int]] = [[] for _ in cases]
    order = list(range(len(cases)))
    shuffler = random.Random(seed)  # the same order on every rank
    for round_index in range(warmup + rounds):
        shuffler.shuffle(order)
        for index in order:
            case = cases[index]
            dist.barrier()
            call = case.head if rank == 0 else case.worker
            start = time.perf_counter_ns()
            for _ in range(calls):
                call()
            end = time.perf_counter_ns()
            if round_index >= warmup:
                starts[index].append(start)
                ends[index].append(end)
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, {"starts": starts, "ends": ends})
    if rank != 0:
        return
    per_rank: list[dict[str, list[list[int]]]] = [g for g in gathered if isinstance(g, dict)]
    results = []
    for index, case in enumerate(cases):
        head_starts = per_rank[0]["starts"][index]
        slowest_end = [max(r["ends"][index][i] for r in per_rank[1:]) for i in range(len(head_starts))]
        per_call_us = [(e - s) / calls / 1000 for s, e in zip(head_starts, slowest_end, strict=True)]
        results.append(Result(case.name, case.family, case.kind, case.words, per_call_us).__dict__)
    Path(out, "raw.json").write_text(json.dumps(results))


@dataclass(frozen=True)
class Result:
    name: str
    family: str
    kind: str
    words: int
    samples_us: list[float]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def spread_us(self) -> tuple[float, float]:
        """The 25th and 75th percentiles."""
        q = statistics.quantiles(self.samples_us, n=4, method="inclusive")
        return q[0], q[2]


def report(results: list[Result], meta: dict[str, object], out: Path) -> None:
    by_name = {r.name: r for r in results}

    def med(name: str) -> float:
        return by_name[name].median_us

    rows = [
        (name, "floor 1 words", "peer header", None)
        for name in ("header v1 (ours)", "header v2 (ours)", "header v2, two broadcasts")
    ]
    for n in TOKEN_SIZES:
        for how in ("from list", "from buffer", "buffer into buffer"):
            two = f"floor count+{n} words" if n > INLINE_TOKENS else None
            rows.append((f"tokens {n} {how} (ours)", f"floor {n} words", f"peer tokens {n}", two))
    print(
        f"\n{meta['backend']} x {meta['world_size']} ranks, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['rounds']} rounds x {meta['calls']} calls; medians (p25-p75), microseconds per call"
    )
    print(
        f"{'case':<40}{'ours':>8}{'':>14}{'floor':>9}{'peer':>9}{'ours/floor':>12}{'ours/peer':>11}{'paired':>10}"
        f"{'ours/(count+floor)':>20}"
    )
    table = []
    for name, floor_name, peer_name, two_name in rows:
        ours, floor, peer = med(name), med(floor_name), med(peer_name)
        paired = statistics.median(
            o / f for o, f in zip(by_name[name].samples_us, by_name[floor_name].samples_us, strict=True)
        )
        low, high = by_name[name].spread_us
        spread = f"({low:.0f}-{high:.0f})"
        print(
            f"{name:<40}{ours:>8.1f}{spread:>14}{floor:>9.1f}{peer:>9.1f}{ours / floor:>11.2f}x"
            f"{ours / peer:>10.2f}x{paired:>9.2f}x" + (f"{ours / med(two_name):>19.2f}x" if two_name else "")
        )
        table.append(
            {
                "case": name,
                "ours_us": ours,
                "floor": floor_name,
                "floor_us": floor,
                "peer_us": peer,
                "ours_over_floor": ours / floor,
                "ours_over_peer": ours / peer,
                "paired_ours_over_floor": paired,
                "ours_over_count_plus_floor": ours / med(two_name) if two_name else None,
            }
        )
    split = med("header v2 (ours)") / med("header v2, two broadcasts")
    print(f"header v2 (ours) / header v2 as two broadcasts: {split:.2f}x")
    cases = [
        {**r.__dict__, "median_us": r.median_us, "p25_us": r.spread_us[0], "p75_us": r.spread_us[1]} for r in results
    ]
    document = {"meta": meta, "table": table, "v2_over_two_broadcasts": split, "cases": cases}
    (out / "bench_protocol.json").write_text(json.dumps(document, indent=1))
    plot(results, meta, out / "bench_protocol.png")
    print(f"wrote {out / 'bench_protocol.json'} and {out / 'bench_protocol.png'}")


def plot(results: list[Result], meta: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    lines = [
        ("floor", "words", "raw broadcast (floor)", "k--"),
        ("floor", "words2", "length word + raw broadcast", "k:"),
        ("peer", "tokens", "broadcast_object_list (peer)", "r-o"),
        ("ours", "tokens-list", "ep_broadcast_tokens, list", "b-o"),
        ("ours", "tokens-buffer", "ep_broadcast_tokens, array('I')", "c-s"),
        ("ours", "tokens-into", "ep_broadcast_tokens_into", "g-^"),
    ]
    for family, kind, label, style in lines:
        points = sorted((r.words, r.median_us) for r in results if r.family == family and r.kind == kind)
        axes.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    for r in results:
        if r.kind in ("header", "header-split"):
            axes.scatter([r.words], [r.median_us], marker="x", zorder=3)
            axes.annotate(r.name, (r.words, r.median_us), fontsize=7, xytext=(4, 4), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("payload (u32 words)")
    axes.set_ylabel("median latency per call (µs)")
    axes.set_title(f"{meta['backend']}, {meta['world_size']} ranks, torch {meta['torch']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer rounds: under a minute on 2 cores")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 60, quick 12)")
    parser.add_argument("--calls", type=int, default=None, help="calls per sample (default 30, quick 10)")
    parser.add_argument("--out", default="benchmarks/out", help="folder for the JSON and the PNG")
    parser.add_argument("--profile", metavar="CASE", help="instead: profile one case by name on every rank")
    args = parser.parse_args()
    rounds = args.rounds or (12 if args.quick else 60)
    calls = args.calls or (10 if args.quick else 30)
    warmup = 2
    backend = default_backend(args.world_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        codes = run_local(profile_main, args.world_size, args.profile, calls * 10, str(out), backend=backend)
        for rank in range(args.world_size):
            print((out / f"profile-rank{rank}.txt").read_text())
        raise SystemExit(1 if any(codes) else 0)
    started = time.monotonic()
    codes = run_local(rank_main, args.world_size, rounds, warmup, calls, 1234, str(out), backend=backend, timeout=3000)
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    results = [Result(**r) for r in json.loads((out / "raw.json").read_text())]
    (out / "raw.json").unlink()
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": backend,
        "world_size": args.world_size,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "calls": calls,
        "wire_version": WIRE_VERSION,
        "seconds": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:],
    }
    report(results, meta, out)
    print(f"took {meta['seconds']} s")


if __name__ == "__main__":
    main()
