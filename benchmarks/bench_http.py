"""The HTTP server against the server a user would pick instead: ours at 1 rank and ``transformers serve``,
with and without ``--continuous-batching``, driven by one load generator, side by side in one run; and ours
against its own ``Server`` driven in one process, without HTTP.

The checkpoint is ``bench_serving.py``'s 118 M Mixtral (``real_model.write_checkpoint``, float32, with 512
positions and no end-of-sequence id, so every request generates all its tokens) and a tokenizer of one
character per id (``helpers.chars``), so a prompt of N random ids is a text of N characters that both servers
encode to the same N ids.  The workload: 64 requests, prompts of 32-256 tokens and 32-128 new tokens each, from
a fixed seed, greedy, streamed through the official ``openai`` async client, all at once and then arriving
at a Poisson rate (``--rate``).  Every side is warm (the same 8 short requests first), serves the same
requests at the same concurrency (``--slots``, default the 64 requests: every request is admitted at once),
and runs in a fresh process with ``--threads`` torch threads (``OMP_NUM_THREADS`` for ``transformers serve``).
Ours runs with ``--no-prefix-caching``: its rounds send the same prompts to the same process again, which
with the cache on would prefill only in the first round.

Per side and arrival: generated tokens per second (every request's tokens over the wall time from the first
request to the last token), time to first token and time between tokens (median and p99), and the CPU seconds
the server's processes spent per 1,000 tokens (from ``/proc``: what the machine's load does not change much).
``ours, Server in process`` is the same start as the HTTP server's (its command line, ``--ours-arg`` included,
and its ``Server``), with rank 0 stepping ``Server`` itself (``http_in_process.py``); its rounds alternate with
the HTTP server's (``--rounds``), both warm, and the HTTP layer's cost is the median of the paired ratios, of
tokens/s (wall clock: the load generator, on the same machine, takes its CPU from the HTTP side alone) and of
tokens per CPU second of the server's processes (what the HTTP layer itself costs).  Targets: ours at least 2x
``transformers serve``'s tokens/s (its better mode) all at once, a lower p99 time to first token at both
arrivals, and the HTTP layer costing at most 5% of tokens/s.  Compare only within one run (these machines are
noisy; the load average is printed before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)
from http_in_process import WARM_UP
from output import DEFAULT_OUT, plotting_available, say_written
from real_model import write_checkpoint

from helpers.chars import text_of, write_char_tokenizer

GOAL_THROUGHPUT: Final = 2.0
GOAL_HTTP: Final = 0.95
MAX_POSITIONS: Final = 512
OURS: Final = "ours, 1 rank (HTTP)"
IN_PROCESS: Final = "ours, Server in process"
THEIRS_CB: Final = "transformers serve --continuous-batching"
THEIRS: Final = "transformers serve"
ALL_AT_ONCE: Final = "all at once"
SETTINGS: Final = ("Paged cache initialized", "attn_implementation", "max_batch_tokens", "num_blocks")
"""What ``transformers serve``'s log says of how it batches, kept for the report."""
Requests = list[tuple[list[int], int]]


@dataclass(frozen=True)
class Load:
    """The requests: prompts of ``prompt_tokens`` and ``new_tokens`` tokens (each a range, both ends included),
    drawn from ``seed``."""

    requests: int = 64
    prompt_tokens: tuple[int, int] = (32, 256)
    new_tokens: tuple[int, int] = (32, 128)
    seed: int = 0

    def build(self, vocab: int) -> Requests:
        draw = random.Random(self.seed)
        return [
            ([draw.randrange(vocab) for _ in range(draw.randint(*self.prompt_tokens))], draw.randint(*self.new_tokens))
            for _ in range(self.requests)
        ]


QUICK_LOAD: Final = Load(requests=8, prompt_tokens=(8, 32), new_tokens=(8, 16))


@dataclass
class Run:
    """One side under one arrival pattern, one round."""

    server: str
    arrival: str
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    threads: int = 0
    """The server's OS threads at the end of the run."""
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")

    def summary(self) -> dict[str, float]:
        def pick(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

        return {
            "tokens_per_s": self.tokens_per_s, "tokens": self.tokens, "wall_s": self.wall_s,
            "cpu_s_per_1k_tokens": 1000 * self.cpu_s / self.tokens if self.tokens else float("nan"),
            "ttft_median_s": pick(self.ttft_s, 0.5), "ttft_p99_s": pick(self.ttft_s, 0.99),
            "itl_median_s": pick(self.itl_s, 0.5), "itl_p99_s": pick(self.itl_s, 0.99),
        }  # fmt: skip


def arrivals(count: int, rate: float | None) -> list[float]:
    """When each request is sent, from the start: all at once (``None``), or at a Poisson ``rate`` per second."""
    gaps = random.Random(1)
    delays, at = [], 0.0
    for _ in range(count):
        delays.append(at)
        at += 0.0 if rate is None else gaps.expovariate(rate)
    return delays


async def drive(port: int, model: str, requests: Requests, delays: Sequence[float], name: str, arrival: str) -> Run:
    """Send every request at its delay, stream each, time it."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    run = Run(name, arrival)
    counts = [0] * len(requests)
    texts = [""] * len(requests)
    last_token = 0.0

    async def one(index: int, delay: float) -> None:
        nonlocal last_token
        await asyncio.sleep(delay)
        prompt, new = requests[index]
        sent = time.perf_counter()
        last = None
        stream = await client.completions.create(
            model=model, prompt=text_of(prompt), max_tokens=new, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                counts[index] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    texts[index] += choice.text
                    if last is None:
                        run.ttft_s.append(now - sent)
                    else:
                        run.itl_s.append(now - last)
                    last = last_token = now

    started = time.perf_counter()
    await asyncio.gather(*(one(index, delay) for index, delay in enumerate(delays)))
    run.wall_s = last_token - started
    run.tokens = sum(count or len(text) for count, text in zip(counts, texts, strict=True))
    run.texts = texts
    await client.close()
    return run


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) of process ``pid`` and its live descendants, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(fields[11]) + int(fields[12])) / tick for fields in _stats(_tree(pid)).values())


def os_threads(pid: int) -> int:
    """The threads of process ``pid`` and its live descendants (torch's, the event loop's, the scheduler's...)."""
    return sum(int(fields[17]) for fields in _stats(_tree(pid)).values())


def _tree(pid: int) -> set[int]:
    """``pid`` and its live descendants."""
    parents = {member: int(fields[1]) for member, fields in _stats(int(entry) for entry in os.listdir("/proc")
                                                                   if entry.isdigit()).items()}  # fmt: skip
    tree, grown = {pid}, True
    while grown:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        grown = bool(more)
        tree |= more
    return tree


def _stats(pids: Iterable[int]) -> dict[int, list[str]]:
    """Each live process's ``/proc/PID/stat`` fields after its name (field 3 of ``proc(5)`` first)."""
    stats = {}
    for pid in pids:
        try:
            stats[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
    return stats


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def started(command: list[str], threads: int, log: Path, limit: float = 900.0) -> Iterator[subprocess.Popen[bytes]]:
    """A server process, once it answers ``/v1/models``; SIGTERM at the end (killed after 60 s).  Its output goes
    to ``log`` (``transformers``' at the info level: its paged cache's settings)."""
    import urllib.request

    port = command[command.index("--port") + 1]
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_VERBOSITY": "info"}
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + limit
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:3]} exited {process.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{command[:3]} did not answer in {limit} s") from None
                time.sleep(0.5)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def http_run(process: subprocess.Popen[bytes], port: int, model: str, name: str, requests: Requests,
             rate: float | None) -> Run:  # fmt: skip
    """One workload through a running server, its CPU time counted."""
    arrival = ALL_AT_ONCE if rate is None else f"Poisson {rate:g}/s"
    before = cpu_seconds(process.pid)
    run = asyncio.run(drive(port, model, requests, arrivals(len(requests), rate), name, arrival))
    run.cpu_s = cpu_seconds(process.pid) - before
    run.threads = os_threads(process.pid)
    return said(run)


def said(run: Run) -> Run:
    """``run``, once a line to standard error says it (a long run shows its progress)."""
    row = run.summary()
    print(f"  {run.server}, {run.arrival}: {row['tokens_per_s']:.1f} tokens/s, p99 TTFT {row['ttft_p99_s']:.2f} s, "
          f"{row['cpu_s_per_1k_tokens']:.1f} CPU s per 1k tokens; load average {os.getloadavg()[0]:.1f}",
          file=sys.stderr, flush=True)  # fmt: skip
    return run


def warm(port: int, model: str) -> None:
    warm_up = [(list(prompt), new) for prompt, new in WARM_UP]
    asyncio.run(drive(port, model, warm_up, [0.0] * len(warm_up), "warm-up", ALL_AT_ONCE))


class InProcess:
    """``http_in_process.py`` over the server's options: a warm ``Server``, one workload a line."""

    def __init__(self, options: list[str], threads: int, log: Path) -> None:
        script = str(Path(__file__).with_name("http_in_process.py"))
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self._log = log.open("wb")
        self.process = subprocess.Popen([sys.executable, script, *options], env=environment, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True)  # fmt: skip
        assert self.process.stdout is not None
        if (said := self.process.stdout.readline().strip()) != "ready":
            raise RuntimeError(f"the in-process side said {said!r}: {log.read_text()[-2000:]}")

    def run(self, requests: Requests, rate: float | None) -> Run:
        assert self.process.stdin is not None and self.process.stdout is not None
        before = cpu_seconds(self.process.pid)
        self.process.stdin.write(json.dumps({"requests": requests, "delays": arrivals(len(requests), rate)}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        run = Run(IN_PROCESS, ALL_AT_ONCE if rate is None else f"Poisson {rate:g}/s", wall_s=answer["wall_s"])
        run.cpu_s = cpu_seconds(self.process.pid) - before
        run.threads = os_threads(self.process.pid)
        for times in answer["times"]:
            run.tokens += len(times)
            run.ttft_s.append(times[0])
            run.itl_s += [later - earlier for earlier, later in itertools.pairwise(times)]
        return said(run)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.close()
        self.process.wait(120)
        self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model and 8 short requests")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (default 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="paired rounds of ours, HTTP and in process (default 2; 1 with --quick)")  # fmt: skip
    parser.add_argument("--slots", type=int, default=None, help="our server's --slots (default: the requests)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every side (default 2)")
    parser.add_argument("--ours-arg", action="append", default=[], metavar="ARG",
                        help="one more option of our server, both sides (--ours-arg=--dtype=bfloat16)")  # fmt: skip
    parser.add_argument("--skip-theirs", action="store_true", help="ours only (HTTP and in process)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where the JSON and PNG go (default {DEFAULT_OUT})")  # fmt: skip
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    plots = plotting_available()
    args.out.mkdir(parents=True, exist_ok=True)
    load = QUICK_LOAD if args.quick else Load()
    load_before = os.getloadavg()
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as temporary:
        directory = write_checkpoint(Path(temporary), "mixtral", args.quick, max_position_embeddings=MAX_POSITIONS)
        config = json.loads((directory / "config.json").read_text())
        write_char_tokenizer(directory, config["vocab_size"])
        requests = load.build(config["vocab_size"])
        model = str(directory)  # transformers serve names the model by the path it was given; ours is told so
        slots = args.slots or load.requests
        # no prefix caching: every round sends the same prompts again
        options = ["--model", str(directory), "--world-size", "1", "--threads", str(args.threads), "--slots",
                   str(slots), "--prefill-chunk", "64", "--max-waiting", str(load.requests), "--no-prefix-caching",
                   "--served-model-name", model, *args.ours_arg]  # fmt: skip
        logs = Path(temporary) / "logs"
        logs.mkdir()
        runs, settings = serve_ours(options, args, requests, model, logs)
        if not args.skip_theirs:
            theirs, settings[THEIRS_CB] = serve_theirs(directory, args, requests, logs, continuous=True)
            runs += theirs
            runs += serve_theirs(directory, args, requests, logs, continuous=False)[0]
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "load_before": load_before,
            "load_after": os.getloadavg(), "took_s": round(time.monotonic() - began, 1), "quick": args.quick,
            "threads": args.threads, "slots": slots, "ours_args": args.ours_arg, "settings": settings}  # fmt: skip
    report(runs, load, args, meta, plots)


def serve_ours(options: list[str], args: argparse.Namespace, requests: Requests, model: str,
               logs: Path) -> tuple[list[Run], dict[str, str]]:  # fmt: skip
    """Ours over HTTP (all at once, in rounds alternating with the in-process side, then at the Poisson rate)."""
    port = free_port()
    command = [sys.executable, "-m", "metrale_model_engine.serve", *options, "--port", str(port)]
    runs: list[Run] = []
    with started(command, args.threads, logs / "ours.log") as process:
        warm(port, model)
        direct = InProcess(options, args.threads, logs / "in_process.log")
        try:
            for _ in range(args.rounds):
                runs.append(direct.run(requests, None))
                runs.append(http_run(process, port, model, OURS, requests, None))
            runs.append(http_run(process, port, model, OURS, requests, args.rate))
            runs.append(direct.run(requests, args.rate))
        finally:
            direct.close()
    first = (logs / "ours.log").read_text().splitlines()[0]
    return runs, {OURS: first}


def serve_theirs(directory: Path, args: argparse.Namespace, requests: Requests, logs: Path,
                 continuous: bool) -> tuple[list[Run], str]:  # fmt: skip
    """``transformers serve`` (with ``--continuous-batching`` or without), all at once then at the rate."""
    port = free_port()
    name = THEIRS_CB if continuous else THEIRS
    command = [str(Path(sys.executable).parent / "transformers"), "serve", str(directory), "--port", str(port),
               "--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32", "--log-level", "info"]  # fmt: skip
    log = logs / f"theirs{'_cb' if continuous else ''}.log"
    with started([*command, "--continuous-batching"] if continuous else command, args.threads, log) as process:
        warm(port, str(directory))
        runs = [http_run(process, port, str(directory), name, requests, rate) for rate in (None, args.rate)]
    said = [line for line in log.read_text().splitlines() if any(word in line for word in SETTINGS)]
    return runs, " | ".join(line.strip()[-200:] for line in said[:4])


def medians(runs: list[Run]) -> dict[tuple[str, str], dict[str, float]]:
    """Each side and arrival's summary, the median over its rounds."""
    grouped: dict[tuple[str, str], list[dict[str, float]]] = {}
    for run in runs:
        grouped.setdefault((run.server, run.arrival), []).append(run.summary())
    return {key: {name: statistics.median(s[name] for s in summaries) for name in summaries[0]}
            for key, summaries in grouped.items()}  # fmt: skip


def report(runs: list[Run], load: Load, args: argparse.Namespace, meta: dict[str, object], plots: bool) -> None:
    rows = medians(runs)
    (shortest, longest), (least, most) = load.prompt_tokens, load.new_tokens
    print(f"{load.requests} requests, prompts {shortest}-{longest} tokens, {least}-{most} new; {meta['slots']} "
          f"slots, {args.threads} torch threads; load average before {meta['load_before']}, after "
          f"{meta['load_after']}")  # fmt: skip
    print(f"{'side':42} {'arrival':13} {'tokens/s':>9} {'TTFT med':>9} {'TTFT p99':>9} {'ITL med':>8} {'ITL p99':>8} "
          f"{'CPU s/1k tok':>12}")  # fmt: skip
    for (server, arrival), row in rows.items():
        print(f"{server:42} {arrival:13} {row['tokens_per_s']:9.1f} {row['ttft_median_s']:8.2f}s "
              f"{row['ttft_p99_s']:8.2f}s {row['itl_median_s'] * 1e3:6.1f}ms {row['itl_p99_s'] * 1e3:6.1f}ms "
              f"{row['cpu_s_per_1k_tokens']:12.1f}")  # fmt: skip
    rounds = [run.texts for run in runs if run.server == OURS and run.arrival == ALL_AT_ONCE]
    differ = sum(any(texts[index] != rounds[0][index] for texts in rounds) for index in range(len(rounds[0])))
    print(f"ours over HTTP, all at once: {differ} of {len(rounds[0])} requests' greedy texts differ between its "
          f"{len(rounds)} rounds (each round batches the requests as they arrived over HTTP)")  # fmt: skip
    threads = {run.server: run.threads for run in runs}
    print(f"OS threads of each server's processes ({args.threads} torch threads each): "
          + ", ".join(f"{side} {count}" for side, count in threads.items()))  # fmt: skip
    paired_runs = runs[: 2 * args.rounds]
    paired = [(http.tokens_per_s / direct.tokens_per_s, http.cpu_s / direct.cpu_s)
              for direct, http in zip(paired_runs[0::2], paired_runs[1::2], strict=True)]  # fmt: skip
    verdicts = []
    http = statistics.median(ratio for ratio, _ in paired)
    cpu = statistics.median(ratio for _, ratio in paired)
    verdicts.append((f"the HTTP layer, wall clock: {http:.3f} of Server's tokens/s in process, median of "
                     f"{len(paired)} paired rounds {[round(r, 3) for r, _ in paired]} (target >= {GOAL_HTTP}; the "
                     "load generator's CPU counts against the HTTP side alone)", http >= GOAL_HTTP))  # fmt: skip
    verdicts.append((f"the HTTP layer, the server's CPU: {1 / cpu:.3f} of Server's tokens per CPU second in process, "
                     f"median of {len(paired)} paired rounds {[round(1 / r, 3) for _, r in paired]} (target >= "
                     f"{GOAL_HTTP})", 1 / cpu >= GOAL_HTTP))  # fmt: skip
    if not args.skip_theirs:
        for arrival in (ALL_AT_ONCE, f"Poisson {args.rate:g}/s"):
            ours = rows[(OURS, arrival)]
            best = max((rows[(side, arrival)] for side in (THEIRS_CB, THEIRS)), key=lambda row: row["tokens_per_s"])
            ratio = ours["tokens_per_s"] / best["tokens_per_s"]
            if arrival == ALL_AT_ONCE:
                verdicts.append((f"{arrival}: ours / transformers serve's better mode, tokens/s: {ratio:.2f}x "
                                 f"(target >= {GOAL_THROUGHPUT}x)", ratio >= GOAL_THROUGHPUT))  # fmt: skip
            else:
                print(f"{arrival}: ours / transformers serve's better mode, tokens/s: {ratio:.2f}x (no target: "
                      "below saturation both serve the offered load)")  # fmt: skip
            lower = ours["ttft_p99_s"] < best["ttft_p99_s"]
            verdicts.append((f"{arrival}: p99 time to first token, ours {ours['ttft_p99_s']:.2f} s against "
                             f"{best['ttft_p99_s']:.2f} s (target: lower)", lower))  # fmt: skip
    for line, met in verdicts:
        print(f"{line} ({'met' if met else 'missed'})")
    for side, said in dict(meta["settings"]).items():  # type: ignore[call-overload]
        print(f"{side}: {said or '(its log, at the info level, names none of its settings)'}")
    document = {
        "load": asdict(load), "rate": args.rate, "rounds": args.rounds,
        "rows": [{"server": s, "arrival": a, **row} for (s, a), row in rows.items()],
        "runs": [{"server": r.server, "arrival": r.arrival, **r.summary()} for r in runs],
        "verdicts": [{"line": line, "met": met} for line, met in verdicts], "meta": {**meta, "os_threads": threads},
    }  # fmt: skip
    path = args.out / "bench_http.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    written = [path]
    if plots:
        written.append(plot(rows, args.out / "bench_http.png"))
    say_written(*written)


def plot(rows: dict[tuple[str, str], dict[str, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrivals = sorted({arrival for _, arrival in rows})
    servers = sorted({server for server, _ in rows}, key=lambda s: (not s.startswith("ours"), s))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "ttft_p99_s", "p99 TTFT (s)"),
                             (axes[2], "itl_median_s", "median time between tokens (s)")):  # fmt: skip
        width = 0.8 / len(servers)
        for offset, server in enumerate(servers):
            values = [rows.get((server, arrival), {}).get(key, float("nan")) for arrival in arrivals]
            axis.bar([i + offset * width for i in range(len(arrivals))], values, width, label=server)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(arrivals))], arrivals)
        axis.set_title(label)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    main()
