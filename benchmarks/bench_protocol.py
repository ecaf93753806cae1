"""Latency of our broadcasts, over gloo and over shared memory, against floors and peers, in one run.

Families of cases, each per call:

* ours over gloo (``transport="torch"``): headers v1 and v2, a v2 header sent as two
  one-word broadcasts, token arrays of 1, 128, 4,096 and 65,536 tokens from a
  ``list[int]``, from an ``array('I')`` (workers get a list) and buffer to buffer;
* ours over shared memory (``transport="shm"``): the v2 header, one follow-up word,
  and token arrays of every size, list and buffer to buffer;
* floors: a raw ``torch.distributed.broadcast`` of a preallocated int32 tensor of as
  many words (and, past a frame, a length word then the words), and a local
  ``memoryview`` copy of the same bytes on the head (what shared memory costs at
  the least);
* peers, what a Python engine would pick for the job: gloo's
  ``broadcast_object_list`` (pickle, two broadcasts), a ``multiprocessing.Queue``
  per worker (pickle, a pipe and a feeder thread) and a ``multiprocessing.Pipe``
  per worker (pickle over a pipe; token buffers with ``send_bytes`` and
  ``recv_bytes_into``, no pickle).

A call is timed from the head's start until the slowest worker holds the values
(``time.perf_counter`` reads CLOCK_MONOTONIC, one clock for every process of the
machine).  Before each call the head waits until every worker has said, through a
shared page, that it is about to receive, so a call never queues behind the
previous one and a worker's wait is part of what is measured.  A round runs
``--calls`` calls of every case, the cases in a fresh random order (A B A B...), and
its sample for a case is the median of those calls; warm-up rounds are dropped.
The head's own time per call is kept too ("head cost").  After the rounds, an idle
probe: a worker on shared memory waits 1 s, its CPU is read (``getrusage``, in the
worker) over the next 3 s, then a header wakes it.

Prints medians with the 25th-75th percentile spread and the ratios of the medians
("paired": the median over rounds of the per-round ratio, which cancels drift),
then every target; writes the raw figures as JSON and a log-log PNG plot.

    python benchmarks/bench_protocol.py [--quick] [--world-size N] [--out DIR]
    python benchmarks/bench_protocol.py --profile "header v2 (shm)"
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import resource
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from metrale_model_engine import INLINE_TOKENS, WIRE_VERSION, EpProtocol, SequenceState
from metrale_model_engine.shm import DEFAULT_SPIN_TIME
from metrale_model_engine.torch import TorchEp, TransportKind, default_backend, run_local

TOKEN_SIZES = (1, 128, 4_096, 65_536)
SEQ_ID, CMD = 3, 7
BURST = 8
LINE = 64
IDLE_S, WINDOW_S = 1.0, 3.0


class BenchModel(TorchEp[SequenceState]):
    """A worker whose commands do nothing: the header path is all that is timed."""

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        return None


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # "gloo", "shm", "floor", "peer", "local"
    kind: str  # "header", "word", "tokens-list", "tokens-buffer", "tokens-into", "words", "words2", "copy"
    words: int  # u32 words per call on the wire (payload size)
    head: Callable[[], object]
    worker: Callable[[], object]


@dataclass(frozen=True)
class Peers:
    """One queue and one pipe per worker, made by the parent and handed to every rank."""

    queues: list[object]
    pipes: list[tuple[Connection, Connection]]


def send_split(model: BenchModel) -> None:
    """The v2 header as two one-word broadcasts, seq_id first."""
    model.ep_broadcast_cmd(SEQ_ID)
    model.ep_broadcast_cmd(CMD)


def receive_split(model: BenchModel) -> tuple[int, int]:
    return model.ep_recv_word(), model.ep_recv_word()


def send_words(model: BenchModel) -> None:
    """A burst of follow-up words, back to back: the head's cost per word when the ring has room."""
    for _ in range(BURST):
        model.ep_broadcast_cmd(CMD)


def receive_words(model: BenchModel) -> None:
    for _ in range(BURST):
        model.ep_recv_word()


def broadcast_two(count: torch.Tensor, payload: torch.Tensor) -> None:
    """Two raw broadcasts: a length word, then the payload (what a length-prefixed array needs)."""
    dist.broadcast(count, src=0)
    dist.broadcast(payload, src=0)


def send_object(payload: object) -> object:
    """The gloo peer: one pickled object from rank 0 (workers pass None and get it)."""
    holder = [payload]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def put_all(queues: list[object], payload: object) -> None:
    for queue in queues:
        queue.put(payload)  # type: ignore[attr-defined]


def send_all(pipes: list[Connection], payload: object) -> None:
    for pipe in pipes:
        pipe.send(payload)


def send_bytes_all(pipes: list[Connection], payload: array[int]) -> None:
    for pipe in pipes:
        pipe.send_bytes(payload)


def build_cases(rank: int, peers: Peers) -> list[Case]:
    def model(protocol: EpProtocol, transport: TransportKind) -> BenchModel:
        return BenchModel(num_slots=8, protocol=protocol, transport=transport)

    v1, v2, shm = model(EpProtocol.V1, "torch"), model(EpProtocol.V2, "torch"), model(EpProtocol.V2, "shm")
    slots: list[SequenceState | None] = [None] * 8
    queues, pipes = peers.queues, [send for _, send in peers.pipes]
    mine_q = peers.queues[rank - 1] if rank else None
    mine_p = peers.pipes[rank - 1][0] if rank else None
    header = [SEQ_ID, CMD]
    cases = [
        Case("header v1 (gloo)", "gloo", "header", 1, partial(v1.ep_broadcast_cmd_for_seq, SEQ_ID, CMD),
             partial(v1.ep_worker_step, slots)),
        Case("header v2 (gloo)", "gloo", "header", 2, partial(v2.ep_broadcast_cmd_for_seq, SEQ_ID, CMD),
             partial(v2.ep_worker_step, slots)),
        Case("header v2, two broadcasts (gloo)", "gloo", "header-split", 2, partial(send_split, v2),
             partial(receive_split, v2)),
        Case("header v2 (shm)", "shm", "header", 2, partial(shm.ep_broadcast_cmd_for_seq, SEQ_ID, CMD),
             partial(shm.ep_worker_step, slots)),
        Case("word (shm)", "shm", "word", 1, partial(shm.ep_broadcast_cmd, CMD), shm.ep_recv_word),
        Case(f"{BURST} words in a row (shm)", "shm", "burst", BURST, partial(send_words, shm),
             partial(receive_words, shm)),
        Case("peer object_list header", "peer", "header", 2, partial(send_object, header), partial(send_object, None)),
        Case("peer queue header", "peer", "header", 2, partial(put_all, queues, header),
             mine_q.get if mine_q is not None else int),  # type: ignore[attr-defined]
        Case("peer pipe header", "peer", "header", 2, partial(send_all, pipes, header),
             mine_p.recv if mine_p is not None else int),
    ]  # fmt: skip
    for words in sorted({1, 2, *TOKEN_SIZES}):
        tensor = torch.zeros(words, dtype=torch.int32)
        raw = partial(dist.broadcast, tensor, src=0)
        cases.append(Case(f"floor {words} words", "floor", "words", words, raw, raw))
    for n in TOKEN_SIZES:
        if n > INLINE_TOKENS:  # the fair floor of an array whose length travels with it
            count, payload = torch.zeros(1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
            both = partial(broadcast_two, count, payload)
            cases.append(Case(f"floor count+{n} words", "floor", "words2", n, both, both))
    for n in TOKEN_SIZES:
        tokens = [(i * 7919) % 32_000 for i in range(n)]
        buffer, target, copy = array("I", tokens), array("I", bytes(4 * n)), array("I", bytes(4 * n))
        source, destination = memoryview(buffer), memoryview(copy)
        cases += [
            Case(f"tokens {n} from list (gloo)", "gloo", "tokens-list", n, partial(v2.ep_broadcast_tokens, tokens),
                 partial(v2.ep_recv_tokens, n)),
            Case(f"tokens {n} from buffer (gloo)", "gloo", "tokens-buffer", n, partial(v2.ep_broadcast_tokens, buffer),
                 partial(v2.ep_recv_tokens, n)),
            Case(f"tokens {n} buffer into buffer (gloo)", "gloo", "tokens-into", n,
                 partial(v2.ep_broadcast_tokens_into, buffer), partial(v2.ep_recv_tokens_into, target)),
            Case(f"tokens {n} from list (shm)", "shm", "tokens-list", n, partial(shm.ep_broadcast_tokens, tokens),
                 partial(shm.ep_recv_tokens, n)),
            Case(f"tokens {n} buffer into buffer (shm)", "shm", "tokens-into", n,
                 partial(shm.ep_broadcast_tokens_into, buffer), partial(shm.ep_recv_tokens_into, target)),
            Case(f"memoryview copy {n} words", "local", "copy", n,
                 partial(destination.__setitem__, slice(None), source), int),
            Case(f"peer object_list tokens {n}", "peer", "tokens-list", n, partial(send_object, tokens),
                 partial(send_object, None)),
            Case(f"peer queue tokens {n}", "peer", "tokens-list", n, partial(put_all, queues, tokens),
                 mine_q.get if mine_q is not None else int),  # type: ignore[attr-defined]
            Case(f"peer pipe tokens {n}", "peer", "tokens-list", n, partial(send_all, pipes, tokens),
                 mine_p.recv if mine_p is not None else int),
            Case(f"peer pipe bytes {n}", "peer", "tokens-into", n, partial(send_bytes_all, pipes, buffer),
                 partial(mine_p.recv_bytes_into, target) if mine_p is not None else int),
        ]  # fmt: skip
    return cases


class Ready:
    """A shared page where each worker says which call it is about to receive."""

    def __init__(self, path: str, world_size: int) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), LINE * world_size)
        self._words = memoryview(self._map).cast("Q")
        self._workers = [LINE // 8 * rank for rank in range(1, world_size)]

    def announce(self, rank: int, call: int) -> None:
        self._words[LINE // 8 * rank] = call

    def wait_for_all(self, call: int) -> None:
        """Return once every worker has announced ``call`` (or, in a local case, run past it)."""
        words = self._words
        while any(words[w] < call for w in self._workers):
            os.sched_yield()


def rank_main(
    rank: int, world_size: int, rounds: int, warmup: int, calls: int, seed: int, peers: Peers, out: str
) -> None:
    cases = build_cases(rank, peers)
    ready = Ready(str(Path(out, "ready.bin")), world_size)
    starts: list[list[list[int]]] = [[] for _ in cases]  # per round: head: call starts; workers: call ends
    heads: list[list[list[int]]] = [[] for _ in cases]  # per round: head: call durations
    order = list(range(len(cases)))
    shuffler = random.Random(seed)  # the same order on every rank
    call_number = 0
    for round_index in range(warmup + rounds):
        shuffler.shuffle(order)
        for index in order:
            case = cases[index]
            dist.barrier()
            if os.environ.get("BENCH_TRACE"):
                print(f"rank {rank} round {round_index}: {case.name}", flush=True)
            stamps, durations = [], []
            for _ in range(calls):
                call_number += 1
                if rank == 0:
                    ready.wait_for_all(call_number)
                    start = time.perf_counter_ns()
                    case.head()
                    durations.append(time.perf_counter_ns() - start)
                    stamps.append(start)
                else:
                    ready.announce(rank, call_number)
                    case.worker()
                    stamps.append(time.perf_counter_ns())
            if round_index >= warmup:
                starts[index].append(stamps)
                heads[index].append(durations)
    idle = idle_probe(rank, cases)
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, {"stamps": starts, "heads": heads, "idle": idle})
    if rank != 0:
        return
    per_rank: list[dict[str, list[list[list[int]]]]] = [g for g in gathered if isinstance(g, dict)]
    results = []
    for index, case in enumerate(cases):
        samples, head_samples = [], []
        for r, head_starts in enumerate(per_rank[0]["stamps"][index]):
            durations = per_rank[0]["heads"][index][r]
            if case.family == "local":
                latencies = durations
            else:
                ends = [max(p["stamps"][index][r][k] for p in per_rank[1:]) for k in range(calls)]
                latencies = [e - s for s, e in zip(head_starts, ends, strict=True)]
            samples.append(statistics.median(latencies) / 1000)
            head_samples.append(statistics.median(durations) / 1000)
        results.append(Result(case.name, case.family, case.kind, case.words, samples, head_samples).__dict__)
    Path(out, "raw.json").write_text(json.dumps({"results": results, "idle": [g["idle"] for g in per_rank]}))


def idle_probe(rank: int, cases: list[Case]) -> dict[str, float]:
    """Shared memory: a worker's CPU over WINDOW_S after IDLE_S without a message, then the wake-up."""
    (case,) = [c for c in cases if c.name == "header v2 (shm)"]
    dist.barrier()
    if rank == 0:
        time.sleep(IDLE_S + WINDOW_S + 0.2)
        start = time.perf_counter_ns()
        case.head()
        return {"sent_ns": start}
    samples: list[float] = []

    def sample() -> None:
        time.sleep(IDLE_S)
        for _ in range(2):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            samples.append(usage.ru_utime + usage.ru_stime)
            time.sleep(WINDOW_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    case.worker()
    received = time.perf_counter_ns()
    sampler.join()
    return {"cpu_fraction": (samples[1] - samples[0]) / WINDOW_S, "received_ns": received}


def profile_main(rank: int, world_size: int, name: str, calls: int, peers: Peers, out: str) -> None:
    """Run one case ``calls`` times under cProfile on every rank; each rank writes its top functions."""
    import cProfile
    import io
    import pstats

    (case,) = [c for c in build_cases(rank, peers) if c.name == name]
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
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    role = "head" if rank == 0 else f"worker {rank}"
    Path(out, f"profile-rank{rank}.txt").write_text(f"== {role}: {name}, {calls} calls\n{text.getvalue()}")


@dataclass(frozen=True)
class Result:
    name: str
    family: str
    kind: str
    words: int
    samples_us: list[float]
    head_us: list[float]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def head_median_us(self) -> float:
        return statistics.median(self.head_us)

    @property
    def spread_us(self) -> tuple[float, float]:
        """The 25th and 75th percentiles."""
        q = statistics.quantiles(self.samples_us, n=4, method="inclusive")
        return q[0], q[2]


def report(results: list[Result], idle: list[dict[str, float]], meta: dict[str, object], out: Path) -> None:
    by_name = {r.name: r for r in results}

    def med(name: str) -> float:
        return by_name[name].median_us

    def paired(name: str, other: str) -> float:
        return statistics.median(
            a / b for a, b in zip(by_name[name].samples_us, by_name[other].samples_us, strict=True)
        )

    print(
        f"\n{meta['backend']} x {meta['world_size']} ranks, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['rounds']} rounds x {meta['calls']} calls; medians (p25-p75), microseconds per call"
    )
    print(f"{'case':<44}{'latency':>9}{'':>16}{'head cost':>11}")
    for result in sorted(results, key=lambda r: (r.family, r.kind, r.words, r.name)):
        low, high = result.spread_us
        spread = f"({low:.1f}-{high:.1f})"
        print(f"{result.name:<44}{result.median_us:>9.1f}{spread:>16}{result.head_median_us:>11.2f}")

    table = []
    print(f"\n{'gloo case':<40}{'ours':>8}{'floor':>9}{'peer':>9}{'ours/floor':>12}{'paired':>9}{'ours/peer':>11}"
          f"{'ours/(count+floor)':>20}")  # fmt: skip
    gloo_rows = [(name, "floor 1 words", "peer object_list header", None) for name in
                 ("header v1 (gloo)", "header v2 (gloo)", "header v2, two broadcasts (gloo)")]  # fmt: skip
    for n in TOKEN_SIZES:
        for how in ("from list", "from buffer", "buffer into buffer"):
            two = f"floor count+{n} words" if n > INLINE_TOKENS else None
            gloo_rows.append((f"tokens {n} {how} (gloo)", f"floor {n} words", f"peer object_list tokens {n}", two))
    for name, floor_name, peer_name, two_name in gloo_rows:
        ours, floor, peer = med(name), med(floor_name), med(peer_name)
        two = ours / med(two_name) if two_name else None
        print(f"{name:<40}{ours:>8.1f}{floor:>9.1f}{peer:>9.1f}{ours / floor:>11.2f}x{paired(name, floor_name):>8.2f}x"
              f"{ours / peer:>10.2f}x" + (f"{two:>19.2f}x" if two else ""))  # fmt: skip
        table.append({"case": name, "ours_us": ours, "floor_us": floor, "peer_us": peer,
                      "ours_over_floor": ours / floor, "paired_ours_over_floor": paired(name, floor_name),
                      "ours_over_peer": ours / peer, "ours_over_count_plus_floor": two})  # fmt: skip

    print(f"\n{'shm case':<40}{'ours':>8}{'gloo floor':>12}{'queue':>9}{'pipe':>9}{'object_list':>13}{'ours/gloo':>11}"
          f"{'queue/ours':>12}{'pipe/ours':>11}")  # fmt: skip
    shm_rows = [("header v2 (shm)", "floor 2 words", "header")]
    for n in TOKEN_SIZES:
        shm_rows += [(f"tokens {n} from list (shm)", f"floor {n} words", f"tokens {n}"),
                     (f"tokens {n} buffer into buffer (shm)", f"floor {n} words", f"tokens {n}")]  # fmt: skip
    for name, floor_name, peer in shm_rows:
        ours, floor = med(name), med(floor_name)
        queue, pipe, objects = med(f"peer queue {peer}"), med(f"peer pipe {peer}"), med(f"peer object_list {peer}")
        if "into" in name:
            pipe = med(f"peer pipe bytes {peer.split()[-1]}")
        print(f"{name:<40}{ours:>8.1f}{floor:>12.1f}{queue:>9.1f}{pipe:>9.1f}{objects:>13.1f}{ours / floor:>10.3f}x"
              f"{queue / ours:>11.1f}x{pipe / ours:>10.1f}x")  # fmt: skip
        table.append({"case": name, "ours_us": ours, "floor_us": floor, "queue_us": queue, "pipe_us": pipe,
                      "object_list_us": objects, "ours_over_floor": ours / floor})  # fmt: skip

    header, floor1 = med("header v2 (shm)"), med("floor 1 words")
    slowest_peer = min(med(f"peer {p} header") for p in ("queue", "pipe", "object_list"))
    copy = med("memoryview copy 65536 words")
    into = med("tokens 65536 buffer into buffer (shm)")
    wakes = [(idle[0]["sent_ns"], w["received_ns"], w["cpu_fraction"]) for w in idle[1:]]
    targets = {
        "header v2 (shm) / gloo floor (1 word), at most 0.05": header / floor1,
        "header v2 (shm) / gloo floor, paired": paired("header v2 (shm)", "floor 1 words"),
        "fastest peer header / header v2 (shm), at least 5": slowest_peer / header,
        "head cost of ep_broadcast_cmd (shm) us, at most 3": by_name["word (shm)"].head_median_us,
        "head cost of ep_broadcast_cmd (shm) us, in a burst": by_name[f"{BURST} words in a row (shm)"].head_median_us
        / BURST,
        "head cost of ep_broadcast_cmd_for_seq (shm) us": by_name["header v2 (shm)"].head_median_us,
        "tokens 65536 into (shm) / memoryview copy 256 KiB, at most 2": into / copy,
        "tokens 65536 into (shm) / copy, paired": paired(
            "tokens 65536 buffer into buffer (shm)", "memoryview copy 65536 words"
        ),
        "idle worker CPU, % of a core over 3 s after 1 s idle, at most 2": 100 * max(w[2] for w in wakes),
        "wake-up after that idle, us, at most 1000": max(w[1] - w[0] for w in wakes) / 1000,
    }
    print()
    for what, value in targets.items():
        print(f"target: {what}: {value:.3f}")
    cases = [{**r.__dict__, "median_us": r.median_us, "head_median_us": r.head_median_us, "p25_us": r.spread_us[0],
              "p75_us": r.spread_us[1]} for r in results]  # fmt: skip
    document = {"meta": meta, "table": table, "targets": targets, "idle": idle, "cases": cases}
    (out / "bench_protocol.json").write_text(json.dumps(document, indent=1))
    plot(results, meta, out / "bench_protocol.png")
    print(f"wrote {out / 'bench_protocol.json'} and {out / 'bench_protocol.png'}")


def plot(results: list[Result], meta: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    lines = [
        ("floor", "words", "raw gloo broadcast (floor)", "k--"),
        ("local", "copy", "memoryview copy on the head", "k:"),
        ("peer", "tokens-list", "", "r-o"),
        ("gloo", "tokens-list", "ours over gloo, list", "b-o"),
        ("gloo", "tokens-into", "ours over gloo, buffer into buffer", "c-s"),
        ("shm", "tokens-list", "ours over shm, list", "m-o"),
        ("shm", "tokens-into", "ours over shm, buffer into buffer", "g-^"),
    ]
    for family, kind, label, style in lines:
        chosen = [r for r in results if r.family == family and r.kind == kind]
        groups = {r.name.rsplit(" ", 1)[0] if family == "peer" else label: [] for r in chosen}
        for r in chosen:
            groups[r.name.rsplit(" ", 1)[0] if family == "peer" else label].append((r.words, r.median_us))
        for group, points in groups.items():
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], style if family != "peer" else "-o",
                      label=group, alpha=0.8 if family == "peer" else 1.0)  # fmt: skip
    for r in results:
        if r.kind in ("header", "header-split"):
            axes.scatter([r.words], [r.median_us], marker="x", zorder=3)
            axes.annotate(r.name, (r.words, r.median_us), fontsize=6, xytext=(4, 4), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("payload (u32 words)")
    axes.set_ylabel("median latency per call (µs)")
    axes.set_title(f"{meta['backend']}, {meta['world_size']} ranks, torch {meta['torch']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def make_peers(world_size: int) -> Peers:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    return Peers(
        [context.Queue() for _ in range(world_size - 1)], [context.Pipe(duplex=False) for _ in range(world_size - 1)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about a minute on 2 cores")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 40, quick 6)")
    parser.add_argument("--calls", type=int, default=None, help="calls per case and round (default 30, quick 10)")
    parser.add_argument("--out", default="benchmarks/out", help="folder for the JSON and the PNG")
    parser.add_argument("--profile", metavar="CASE", help="instead: profile one case by name on every rank")
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.quick else 40)
    calls = args.calls or (10 if args.quick else 30)
    warmup = 2
    backend = default_backend(args.world_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = make_peers(args.world_size)
    if args.profile:
        codes = run_local(profile_main, args.world_size, args.profile, calls * 10, peers, str(out), backend=backend)
        for rank in range(args.world_size):
            print((out / f"profile-rank{rank}.txt").read_text())
        raise SystemExit(1 if any(codes) else 0)
    (out / "ready.bin").write_bytes(bytes(LINE * args.world_size))
    started = time.monotonic()
    codes = run_local(
        rank_main, args.world_size, rounds, warmup, calls, 1234, peers, str(out), backend=backend, timeout=3000
    )
    (out / "ready.bin").unlink()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    raw = json.loads((out / "raw.json").read_text())
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
        "spin_time_s": DEFAULT_SPIN_TIME,
        "seconds": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:],
    }
    report([Result(**r) for r in raw["results"]], raw["idle"], meta, out)
    print(f"took {meta['seconds']} s")


if __name__ == "__main__":
    main()
