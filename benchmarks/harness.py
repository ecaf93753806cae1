"""The measuring harness of the protocol benchmark: interleaved rounds, a readiness page, idle gaps.

A call is timed from the head's start until the slowest worker holds the values
(``time.perf_counter_ns`` reads CLOCK_MONOTONIC, one clock for every process of the
machine).  Before each call the head waits until every worker has said, through a
shared page, that it is about to receive, then waits the case's gap (0 for
back-to-back calls): so a call never queues behind the previous one, and a worker's
wait, after a gap as long as a server's step, is part of what is measured.  A round
runs ``calls`` calls of every case, the cases in a fresh random order, and its
sample for a case is the median of those calls; warm-up rounds are dropped.
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)

from helpers.usage import IdleSampler

LINE = 64


@dataclass(frozen=True)
class Case:
    """One measured operation: what the head does, what each worker does, and the idle gap before it."""

    name: str
    family: str  # "gloo", "shm", "floor", "peer", "local"
    kind: str
    words: int  # u32 words of payload per call
    head: Callable[[], object]
    worker: Callable[[], object]
    gap_s: float = 0.0


@dataclass
class Samples:
    """Per case, per round: the head's call starts and durations; each worker's call ends."""

    starts: list[list[list[int]]] = field(default_factory=list)
    heads: list[list[list[int]]] = field(default_factory=list)


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
        """Return once every worker has announced ``call``."""
        words = self._words
        while any(words[w] < call for w in self._workers):
            os.sched_yield()


def pause(seconds: float) -> None:
    """Wait ``seconds`` on the head: a sleep for the bulk, a busy wait for the last half millisecond."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.0005)
    while time.perf_counter() < deadline:
        pass


def run_rounds(
    rank: int, cases: list[Case], ready: Ready, *, rounds: int, warmup: int, calls: int, seed: int
) -> Samples:
    """Every case ``calls`` times per round, in a fresh order each round (the same on every rank)."""
    samples = Samples([[] for _ in cases], [[] for _ in cases])
    order = list(range(len(cases)))
    shuffler = random.Random(seed)
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
                    pause(case.gap_s)
                    start = time.perf_counter_ns()
                    case.head()
                    durations.append(time.perf_counter_ns() - start)
                    stamps.append(start)
                else:
                    ready.announce(rank, call_number)
                    case.worker()
                    stamps.append(time.perf_counter_ns())
            if round_index >= warmup:
                samples.starts[index].append(stamps)
                samples.heads[index].append(durations)
    return samples


def idle_probe(rank: int, case: Case, idle_s: float, window_s: float) -> dict[str, float]:
    """A worker's CPU over ``window_s`` after ``idle_s`` without a message, then the wake-up (one call of ``case``)."""
    dist.barrier()
    if rank == 0:
        time.sleep(idle_s + window_s + 0.2)
        start = time.perf_counter_ns()
        case.head()
        return {"sent_ns": start, "published_ns": time.perf_counter_ns()}
    sampler = IdleSampler(idle_s, window_s)
    case.worker()
    received = time.perf_counter_ns()
    return {"cpu_fraction": sampler.share(), "received_ns": received}


@dataclass(frozen=True)
class Result:
    """A case's per-round medians, in microseconds: latency to the slowest worker, and the head's own time."""

    name: str
    family: str
    kind: str
    words: int
    gap_s: float
    samples_us: list[float]
    head_us: list[float]
    delivery_us: list[float]
    """Per round: from the end of the head's call (the message published) to the slowest worker holding it."""

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def head_median_us(self) -> float:
        return statistics.median(self.head_us)

    @property
    def delivery_median_us(self) -> float:
        return statistics.median(self.delivery_us)

    @property
    def spread_us(self) -> tuple[float, float]:
        """The 25th and 75th percentiles."""
        q = statistics.quantiles(self.samples_us, n=4, method="inclusive")
        return q[0], q[2]


def results(cases: list[Case], per_rank: list[Samples], calls: int) -> list[Result]:
    """Each case's result from every rank's samples (the head's starts, the slowest worker's ends)."""
    found = []
    for index, case in enumerate(cases):
        samples, head_samples, delivery_samples = [], [], []
        for round_index, head_starts in enumerate(per_rank[0].starts[index]):
            durations = per_rank[0].heads[index][round_index]
            if case.family == "local":
                latencies, deliveries = durations, [0] * len(durations)
            else:
                ends = [max(p.starts[index][round_index][k] for p in per_rank[1:]) for k in range(calls)]
                latencies = [end - start for start, end in zip(head_starts, ends, strict=True)]
                deliveries = [latency - took for latency, took in zip(latencies, durations, strict=True)]
            samples.append(statistics.median(latencies) / 1000)
            head_samples.append(statistics.median(durations) / 1000)
            delivery_samples.append(statistics.median(deliveries) / 1000)
        found.append(
            Result(case.name, case.family, case.kind, case.words, case.gap_s, samples, head_samples, delivery_samples)
        )
    return found


def ready_page(out: Path, world_size: int) -> Path:
    """A zeroed file for :class:`Ready`."""
    path = out / "ready.bin"
    path.write_bytes(bytes(LINE * world_size))
    return path
