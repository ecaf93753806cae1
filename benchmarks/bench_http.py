"""The HTTP server against the server a user would pick instead: ours at 1 rank and ``transformers serve``,
with and without ``--continuous-batching``, driven by one load generator, side by side in one run.

The checkpoint is ``bench_serving.py``'s 118 M Mixtral (``real_model.write_checkpoint``, with 512
positions) and a tokenizer of one character per id (``helpers.chars``), so a prompt of N random ids is
a text of N characters that both servers encode to the same N ids.  The workload: 64 requests,
prompts of 32-256 tokens and 32-128 new tokens each, from a fixed seed, greedy, streamed through the
official ``openai`` async client, all at once and then arriving at a Poisson rate (``--rate``).
Per server and arrival: generated tokens per second (every request's tokens over the wall time from
the first request to the last token), time to first token and time between tokens (median and p99).
Ours also runs the same all-at-once workload through ``Server`` in one process, without HTTP: the
HTTP layer's cost.  Targets: ours at least 2x ``transformers serve``'s tokens/s (its better mode), a
lower p99 time to first token, and the HTTP layer costing at most 5% of tokens/s.  Each server runs
in a fresh process with 2 torch threads; compare only within one run (these machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)
from output import DEFAULT_OUT, plotting_available, say_written
from real_model import write_checkpoint

from helpers.chars import text_of, write_char_tokenizer

GOAL_THROUGHPUT: Final = 2.0
GOAL_HTTP: Final = 0.95
MAX_POSITIONS: Final = 512
THREADS: Final = "2"


@dataclass(frozen=True)
class Load:
    """The requests: prompts of ``prompt_tokens`` and ``new_tokens`` tokens (each a range, both ends included),
    drawn from ``seed``."""

    requests: int = 64
    prompt_tokens: tuple[int, int] = (32, 256)
    new_tokens: tuple[int, int] = (32, 128)
    seed: int = 0

    def build(self, vocab: int) -> list[tuple[list[int], int]]:
        draw = random.Random(self.seed)
        return [
            ([draw.randrange(vocab) for _ in range(draw.randint(*self.prompt_tokens))], draw.randint(*self.new_tokens))
            for _ in range(self.requests)
        ]


QUICK_LOAD: Final = Load(requests=8, prompt_tokens=(8, 32), new_tokens=(8, 16))


@dataclass
class Run:
    """One server under one arrival pattern."""

    server: str
    arrival: str
    tokens_per_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        def pick(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

        return {
            "tokens_per_s": self.tokens_per_s,
            "ttft_median_s": pick(self.ttft_s, 0.5), "ttft_p99_s": pick(self.ttft_s, 0.99),
            "itl_median_s": pick(self.itl_s, 0.5), "itl_p99_s": pick(self.itl_s, 0.99),
        }  # fmt: skip


async def drive(port: int, model: str, requests: list[tuple[list[int], int]], rate: float | None) -> Run:
    """Send every request (at once, or at a Poisson ``rate`` per second), stream each, time it."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    run = Run("", "all at once" if rate is None else f"Poisson {rate:g}/s")
    gaps = random.Random(1)
    counts = [0] * len(requests)
    texts = [""] * len(requests)

    async def one(index: int, delay: float) -> float:
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
                    last = now
        return time.perf_counter()

    delays, at = [], 0.0
    for _ in requests:
        delays.append(at)
        at += 0.0 if rate is None else gaps.expovariate(rate)
    started = time.perf_counter()
    ends = await asyncio.gather(*(one(index, delay) for index, delay in enumerate(delays)))
    run.tokens_per_s = sum(count or len(text) for count, text in zip(counts, texts, strict=True)) / (
        max(ends) - started
    )
    run.texts = texts
    await client.close()
    return run


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start(command: list[str], port: int, limit: float = 600.0) -> subprocess.Popen[bytes]:
    """Start a server and wait until it answers ``/v1/models``."""
    import urllib.request

    environment = {**os.environ, "OMP_NUM_THREADS": THREADS}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stderr.read().decode()[-2000:] if process.stderr else ""
            raise RuntimeError(f"{command[:3]} exited {process.returncode}: {said}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"{command[:3]} did not answer in {limit} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve_and_drive(
    name: str, command: list[str], port: int, model: str, requests: list[tuple[list[int], int]], rate: float
) -> list[Run]:
    process = start(command, port)
    try:
        warm = [(prompt, 8) for prompt, _ in requests[:8]]
        asyncio.run(drive(port, model, warm, None))
        runs = [asyncio.run(drive(port, model, requests, None)), asyncio.run(drive(port, model, requests, rate))]
    finally:
        stop(process)
    for run in runs:
        run.server = name
    return runs


IN_PROCESS = """
import json, sys, time, torch
from metrale_model_engine import EpLink
from metrale_model_engine.reference import ReferenceLm, Request, Server
from metrale_model_engine.transport import SoloTransport
torch.set_num_threads(int(sys.argv[3]))
work = json.loads(sys.argv[2])
model = ReferenceLm(EpLink(SoloTransport(), num_slots=len(work)), checkpoint=sys.argv[1])
requests = [Request(i, tuple(prompt), new) for i, (prompt, new) in enumerate(work)]
Server(model, prefill_chunk=64).run(requests)  # warm-up: the same workload once
started = time.perf_counter()
done = Server(model, prefill_chunk=64).run(requests)
print(json.dumps(sum(len(c.tokens) for c in done.values()) / (time.perf_counter() - started)))
"""


def in_process(directory: Path, requests: list[tuple[list[int], int]]) -> float:
    """Tokens/s of ``Server`` driven in one process, the same workload all at once."""
    argv = [sys.executable, "-c", IN_PROCESS, str(directory), json.dumps(requests), THREADS]
    out = subprocess.run(
        argv, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": THREADS}
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model and 8 short requests")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (default 2)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"where the JSON and PNG go (default {DEFAULT_OUT})"
    )
    args = parser.parse_args()
    plots = plotting_available()
    args.out.mkdir(parents=True, exist_ok=True)
    load = QUICK_LOAD if args.quick else Load()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as temporary:
        directory = write_checkpoint(Path(temporary), "mixtral", args.quick, max_position_embeddings=MAX_POSITIONS)
        config = json.loads((directory / "config.json").read_text())
        write_char_tokenizer(directory, config["vocab_size"])
        requests = load.build(config["vocab_size"])
        model = str(directory)  # transformers serve names the model by the path it was given; ours is told so
        port = free_port()
        ours = [sys.executable, "-m", "metrale_model_engine.serve", "--model", str(directory), "--port", str(port),
                "--world-size", "1", "--threads", THREADS, "--slots", str(load.requests), "--prefill-chunk", "64",
                "--max-waiting", str(load.requests), "--served-model-name", model]  # fmt: skip
        theirs = [str(Path(sys.executable).parent / "transformers"), "serve", str(directory), "--port", str(port),
                  "--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]  # fmt: skip
        runs = serve_and_drive("ours, 1 rank", ours, port, model, requests, args.rate)
        runs += serve_and_drive("transformers serve --continuous-batching", [*theirs, "--continuous-batching"],
                                port, model, requests, args.rate)  # fmt: skip
        runs += serve_and_drive("transformers serve", theirs, port, model, requests, args.rate)
        direct = in_process(directory, requests)
    report(runs, direct, load, args, time.monotonic() - started, plots)


def report(runs: list[Run], direct: float, load: Load, args: argparse.Namespace, took: float, plots: bool) -> None:
    rows = {(run.server, run.arrival): run.summary() for run in runs}
    (shortest, longest), (least, most) = load.prompt_tokens, load.new_tokens
    print(f"{load.requests} requests, prompts {shortest}-{longest} tokens, {least}-{most} new")
    print(f"{'server':42} {'arrival':16} {'tokens/s':>9} {'TTFT med':>9} {'TTFT p99':>9} {'ITL med':>8} {'ITL p99':>8}")
    for (server, arrival), row in rows.items():
        print(f"{server:42} {arrival:16} {row['tokens_per_s']:9.1f} {row['ttft_median_s']:8.2f}s "
              f"{row['ttft_p99_s']:8.2f}s {row['itl_median_s'] * 1e3:6.1f}ms "
              f"{row['itl_p99_s'] * 1e3:6.1f}ms")  # fmt: skip
    print(f"{'ours, Server in one process (no HTTP)':42} {'all at once':16} {direct:9.1f}")
    same = all(run.texts == runs[0].texts for run in runs[:2])
    print(f"ours gives the same text all at once and at a Poisson rate: {same}")
    verdicts = []
    for arrival in ("all at once", f"Poisson {args.rate:g}/s"):
        ours = rows[("ours, 1 rank", arrival)]
        best = max((rows[(s, arrival)] for s in ("transformers serve --continuous-batching", "transformers serve")),
                   key=lambda row: row["tokens_per_s"])  # fmt: skip
        ratio = ours["tokens_per_s"] / best["tokens_per_s"]
        verdicts.append((f"{arrival}: ours / transformers serve's better mode, tokens/s: {ratio:.2f}x "
                         f"(target >= {GOAL_THROUGHPUT}x)", ratio >= GOAL_THROUGHPUT))  # fmt: skip
        lower = ours["ttft_p99_s"] < best["ttft_p99_s"]
        verdicts.append((f"{arrival}: p99 time to first token, ours {ours['ttft_p99_s']:.2f} s against "
                         f"{best['ttft_p99_s']:.2f} s (target: lower)", lower))  # fmt: skip
    http = rows[("ours, 1 rank", "all at once")]["tokens_per_s"] / direct
    verdicts.append((f"the HTTP layer: {http:.3f} of Server's tokens/s in one process (target >= {GOAL_HTTP})",
                     http >= GOAL_HTTP))  # fmt: skip
    for line, met in verdicts:
        print(f"{line} ({'met' if met else 'missed'})")
    document = {
        "load": asdict(load), "rate": args.rate,
        "rows": [{"server": s, "arrival": a, **row} for (s, a), row in rows.items()],
        "in_process_tokens_per_s": direct, "verdicts": [{"line": line, "met": met} for line, met in verdicts],
        "meta": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                 "took_s": round(took, 1), "quick": args.quick},
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
    servers = sorted({server for server, _ in rows}, key=lambda s: not s.startswith("ours"))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "ttft_p99_s", "p99 TTFT (s)"),
                             (axes[2], "itl_median_s", "median time between tokens (s)")):  # fmt: skip
        width = 0.8 / len(servers)
        for offset, server in enumerate(servers):
            values = [rows[(server, arrival)][key] for arrival in arrivals]
            axis.bar([i + offset * width for i in range(len(arrivals))], values, width, label=server)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(arrivals))], arrivals)
        axis.set_title(label)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


if __name__ == "__main__":
    main()
