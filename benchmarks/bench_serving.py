"""Serving benchmark: the reference model under continuous batching, the command path varied, all else equal.

One workload (default: 32 requests of 64-token prompts, 64 new tokens each, 16
slots) is served by the same server and model over each command path, in rounds,
the paths in a fresh order each round, every rank in one process group:

* ``world 1``: one rank, no command sent (the single-GPU model);
* ``ours shm``: 2 ranks, :class:`~metrale_model_engine.reference.ReferenceLm` over
  a shared-memory link (Metrale's command words, one message per command);
* ``ours gloo``: the same over a link on the gloo group;
* ``peer pickle``: each forward's call, with the allocs and frees before it,
  pickled and sent with ``torch.distributed.broadcast_object_list`` (SGLang's
  ``broadcast_pyobj`` path);
* ``peer shm+event``: the same call pickled into one ``multiprocessing`` shared
  block and a ``multiprocessing.Event`` set per worker (nano-vllm's model runner).

Everything but the command path is shared: the model, the checks, the forward, its
all-reduces (on one gloo group), the server.  The head times each batched decode,
split into protocol (sending the command), collectives (inside the all-reduces) and
compute (the rest).  Beside the paths it reports the model's own decode step at one
rank on ``--device`` (``model_step.py``): the ops it launches and the host waits per
step, on CUDA its times eager and graphed and the GPU's busy time.  Prints a table
and the targets (met or missed), and writes ``bench_serving.json`` and
``bench_serving.png`` to ``--out``.

Run: ``python benchmarks/bench_serving.py`` (about 2 minutes on 2 cores);
``--quick`` for a smoke run (about 20 s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict

import torch
import torch.distributed as dist

from metrale_model_engine import EpLink, run_worker
from metrale_model_engine.reference import (
    LmSlots,
    LmState,
    ReferenceLm,
    Request,
    Server,
    check_decode,
    check_prefill,
)
from metrale_model_engine.torch import open_link, run_group
from metrale_model_engine.transport import SoloTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_step
from output import DEFAULT_OUT, plotting_available, say_written

from peers import ShmEventChannel, ShmEventHandle

PATHS: Final = ("world 1", "ours shm", "ours gloo", "peer pickle", "peer shm+event")
CMD_END_ROUND: Final = 0x0000BEEF
"""The benchmark's own command: the round is over (workers leave their loop, the link stays up)."""
TARGET_SHARE: Final = 0.02
"""The protocol's share of a decode step at the full batch, over shared memory: at most this."""
TARGET_PROTOCOL_US: Final = 25.0
"""The head's protocol time of that step (the decode command's send), median, in microseconds: at most this."""
SOURCE: Final = (Path(__file__).resolve().parents[1] / "LICENSE-APACHE").read_text()


Call = tuple[Any, ...]
"""A peer call: ``("alloc", seq_id)``, ``("free", seq_id)``, ``("prefill", ...)``, ``("decode", ...)``."""
Send = Callable[[list[Call]], None]
Receive = Callable[[], Any]


class RoundResult(TypedDict):
    tokens: int
    wall_s: float
    tokens_per_s: float
    outputs: list[list[int]]
    steps: list[tuple[int, float, float, float]]
    """Each decode step: batch, total, protocol and collectives seconds."""


@dataclass
class Findings:
    paths: dict[str, dict[str, float]]
    ratios: dict[str, float]
    targets: dict[str, tuple[float, bool]]
    outputs_identical: bool


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int
    new_tokens: int
    slots: int
    prefill_chunk: int

    def build(self) -> list[Request]:
        """Prompts cut from the Apache license at spread offsets (real text, so the model stays on it)."""
        step = (len(SOURCE) - self.prompt_tokens) // self.requests
        return [
            Request(i, tuple(SOURCE[i * step : i * step + self.prompt_tokens].encode())[: self.prompt_tokens],
                    self.new_tokens)
            for i in range(self.requests)
        ]  # fmt: skip


class BenchLm(ReferenceLm):
    """The reference model with one more command, the end of a round, so that workers leave their loop."""

    round_over = False

    def ep_run_command(self, seq_id: int, cmd: int, slots: LmSlots) -> None:
        if cmd == CMD_END_ROUND:
            self.round_over = True
        else:
            super().ep_run_command(seq_id, cmd, slots)


class PeerLm(ReferenceLm):
    """The reference model whose head sends each forward as one pickled call (allocs and frees ride along)."""

    def __init__(self, link: EpLink, send: Send | None) -> None:
        super().__init__(link)
        self._peer_send = send
        self._pending: list[tuple[object, ...]] = []

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        slots[seq_id] = LmState(seq_id)
        self._pending.append(("alloc", seq_id))

    def free(self, slots: LmSlots, seq_id: int) -> None:
        slots[seq_id] = None
        self._pending.append(("free", seq_id))

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        state = check_prefill(slots, seq_id, prompt, start, length, self.config)
        self.send_call(("prefill", seq_id, list(prompt), start, length))
        return self.forward_prefill(state, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        states = check_decode(slots, seq_ids, tokens, self.config)
        self.send_call(("decode", list(seq_ids), list(tokens)))
        return self.forward_decode(states, tokens)

    def send_call(self, call: tuple[object, ...]) -> None:
        started = time.perf_counter()
        calls, self._pending = [*self._pending, call], []
        assert self._peer_send is not None, "a worker sends no call"
        self._peer_send(calls)
        self.spent.protocol_s += time.perf_counter() - started

    def serve_calls(self, receive: Receive, slots: LmSlots) -> None:
        """Worker: run calls until the end of the round."""
        while True:
            for call in receive():
                kind = call[0]
                if kind == "end":
                    return
                if kind == "alloc":
                    slots[call[1]] = LmState(call[1])
                elif kind == "free":
                    slots[call[1]] = None
                elif kind == "prefill":
                    _, seq_id, prompt, start, length = call
                    self.forward_prefill(check_prefill(slots, seq_id, prompt, start, length, self.config),
                                         prompt, start, length)  # fmt: skip
                else:
                    _, seq_ids, tokens = call
                    self.forward_decode(check_decode(slots, seq_ids, tokens, self.config), tokens)


def object_list_send(group: dist.ProcessGroup) -> Send:
    def send(calls: list[Call]) -> None:
        dist.broadcast_object_list([calls], group=group, group_src=0)

    return send


def object_list_receive(group: dist.ProcessGroup) -> Receive:
    def receive() -> object:
        box: list[object] = [None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        return box[0]

    return receive


def serve_round(model: ReferenceLm, work: Workload) -> RoundResult:
    """Head: serve the workload once; tokens/s and every decode step's split."""
    server = Server(model, prefill_chunk=work.prefill_chunk)
    started = time.perf_counter()
    done = server.run(work.build())
    wall = time.perf_counter() - started
    tokens = sum(len(c.tokens) for c in done.values())
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "outputs": [done[i].tokens for i in sorted(done)],
        "steps": [(s.batch, s.total_s, s.protocol_s, s.collectives_s) for s in server.decode_steps],
    }


def rank_main(rank: int, world_size: int, work: Workload, rounds: int, handle: ShmEventHandle, out: str) -> None:
    torch.set_num_threads(1)
    shm_link = open_link("shm", num_slots=work.slots)
    gloo_link = open_link("torch", num_slots=work.slots)
    peer_group = dist.new_group(backend="gloo")
    ours = {"ours shm": BenchLm(shm_link), "ours gloo": BenchLm(gloo_link)}
    channel = ShmEventChannel.attach_head(handle) if rank == 0 else ShmEventChannel.attach(handle, rank - 1)
    if rank == 0:
        peers = {
            "peer pickle": PeerLm(shm_link, object_list_send(peer_group)),
            "peer shm+event": PeerLm(shm_link, channel.call),
        }
        solo = ReferenceLm(EpLink(SoloTransport(), num_slots=work.slots))
    else:
        peers = {"peer pickle": PeerLm(shm_link, None), "peer shm+event": PeerLm(shm_link, None)}
    receivers = {"peer pickle": object_list_receive(peer_group), "peer shm+event": channel.receive}
    order = random.Random(7)
    samples: dict[str, list[RoundResult]] = {path: [] for path in PATHS}
    for _ in range(rounds + 1):  # the first round warms up
        paths = list(PATHS)
        order.shuffle(paths)
        for path in paths:
            dist.barrier()
            if path == "world 1":
                if rank == 0:
                    samples[path].append(serve_round(solo, work))
                continue
            slots: LmSlots = [None] * work.slots
            if path in ours:
                model = ours[path]
                if rank == 0:
                    samples[path].append(serve_round(model, work))
                    model.ep_link.send_command(0, CMD_END_ROUND)
                else:
                    model.round_over = False
                    while not model.round_over:
                        model.ep_worker_step(slots)
            else:
                peer = peers[path]
                if rank == 0:
                    samples[path].append(serve_round(peer, work))
                    peer.send_call(("end",))
                else:
                    peer.serve_calls(receivers[path], slots)
    if rank == 0:
        for link in (shm_link, gloo_link):
            link.shutdown_workers()
        Path(out, "samples.json").write_text(json.dumps({path: runs[1:] for path, runs in samples.items()}))
    else:
        for model in ours.values():
            idle: LmSlots = [None] * work.slots
            run_worker(model, idle)
    channel.close()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def analyse(samples: dict[str, list[RoundResult]], work: Workload) -> Findings:
    """Per path: tokens/s, and the decode steps at the full batch split; paired ratios; the targets."""
    reference = samples["world 1"][0]["outputs"]
    same = all(run["outputs"] == reference for runs in samples.values() for run in runs)
    table: dict[str, dict[str, float]] = {}
    for path, runs in samples.items():
        full = [step for run in runs for step in run["steps"] if step[0] == work.slots]
        total, protocol, collectives = (median([step[i] for step in full]) for i in (1, 2, 3))
        table[path] = {
            "tokens_per_s": median([run["tokens_per_s"] for run in runs]),
            "full_batch_steps": len(full),
            "step_ms": total * 1e3,
            "protocol_us": protocol * 1e6,
            "collectives_ms": collectives * 1e3,
            "compute_ms": median([s[1] - s[2] - s[3] for s in full]) * 1e3,
            "protocol_share": sum(s[2] for s in full) / sum(s[1] for s in full) if full else float("nan"),
        }

    def paired(a: str, b: str) -> float:
        """Median over rounds of a's tokens/s over b's (the rounds ran side by side)."""
        pairs = zip(samples[a], samples[b], strict=True)
        return median([x["tokens_per_s"] / y["tokens_per_s"] for x, y in pairs])

    ratios = {
        "ours shm / peer pickle, tokens/s": paired("ours shm", "peer pickle"),
        "ours shm / peer shm+event, tokens/s": paired("ours shm", "peer shm+event"),
        "ours shm / ours gloo, tokens/s": paired("ours shm", "ours gloo"),
        "ours shm / world 1, tokens/s": paired("ours shm", "world 1"),
        "peer pickle / ours shm, protocol time of a full decode step": (
            table["peer pickle"]["protocol_us"] / table["ours shm"]["protocol_us"]
        ),
        "peer shm+event / ours shm, protocol time of a full decode step": (
            table["peer shm+event"]["protocol_us"] / table["ours shm"]["protocol_us"]
        ),
    }
    share = table["ours shm"]["protocol_share"]
    targets = {
        f"ours shm: protocol share of a decode step at batch {work.slots}, at most {TARGET_SHARE:.0%}": (
            share,
            share <= TARGET_SHARE,
        ),
        f"ours shm: the head's protocol time of a decode step at batch {work.slots}, median us, at most "
        f"{TARGET_PROTOCOL_US:g}": (
            table["ours shm"]["protocol_us"],
            table["ours shm"]["protocol_us"] <= TARGET_PROTOCOL_US,
        ),
        "ours shm ahead of peer pickle (tokens/s ratio above 1)": (
            ratios["ours shm / peer pickle, tokens/s"],
            ratios["ours shm / peer pickle, tokens/s"] > 1,
        ),
        "ours shm ahead of peer shm+event (tokens/s ratio above 1)": (
            ratios["ours shm / peer shm+event, tokens/s"],
            ratios["ours shm / peer shm+event, tokens/s"] > 1,
        ),
    }
    return Findings(table, ratios, targets, same)


def report(found: Findings, work: Workload, out: Path, plots: bool) -> None:
    table = found.paths
    shape = f"{work.requests} requests, {work.prompt_tokens}-token prompts, {work.new_tokens} new tokens"
    print(f"\nworkload: {shape}, {work.slots} slots, prefill chunks of {work.prefill_chunk}; at batch {work.slots}:")
    print(f"{'path':<16}{'tokens/s':>10}{'step ms':>9}{'compute ms':>12}{'collect. ms':>13}{'protocol us':>13}"
          f"{'protocol':>10}")  # fmt: skip
    for path, row in table.items():
        print(f"{path:<16}{row['tokens_per_s']:>10.0f}{row['step_ms']:>9.2f}{row['compute_ms']:>12.2f}"
              f"{row['collectives_ms']:>13.2f}{row['protocol_us']:>13.1f}{row['protocol_share']:>9.2%}")  # fmt: skip
    print("\nratios (tokens/s paired by round):")
    for name, value in found.ratios.items():
        print(f"  {name}: {value:.2f}x")
    print(f"outputs identical on every path and round: {found.outputs_identical}")
    for name, (value, met) in found.targets.items():
        print(f"target: {name}: {value:.4g} ({'met' if met else 'MISSED'})")
    if plots:
        plot(table, work, out / "bench_serving.png")


def plot(table: dict[str, dict[str, float]], work: Workload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(names)
    for part, key, colour in (("compute", "compute_ms", "#4C72B0"), ("collectives", "collectives_ms", "#DD8452"),
                              ("protocol", "protocol_us", "#C44E52")):  # fmt: skip
        heights = [table[n][key] / (1e3 if key == "protocol_us" else 1) for n in names]
        left.bar(names, heights, bottom=bottom, label=part, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    left.set_ylabel("ms per decode step (median)")
    left.set_title(f"the head's decode step at batch {work.slots}")
    left.legend()
    right.bar(names, [table[n]["tokens_per_s"] for n in names], color="#55A868")
    right.set_ylabel("generated tokens/s (median of rounds)")
    right.set_title(f"{work.requests} requests x {work.new_tokens} new tokens")
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of a small workload")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5; a warm-up round first)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"where the JSON and PNG go (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the model's own step is measured (default cpu)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    plots = plotting_available()
    work = Workload(32, 64, 64, 16, 16) if not args.quick else Workload(8, 32, 8, 4, 16)
    rounds = 1 if args.quick else args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    channel = ShmEventChannel.create(1, size=1 << 20, context=context)
    try:
        codes = run_group(rank_main, 2, work, rounds, channel.handle, str(args.out), timeout=1800.0)
    finally:
        channel.close()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    samples_path = args.out / "samples.json"
    samples = json.loads(samples_path.read_text())
    samples_path.unlink()
    found = analyse(samples, work)
    torch.set_num_threads(1)
    step = model_step.measure(args.device, work.slots, 50 if args.quick else 300)
    found.targets.update(model_step.targets(step))
    print(f"\nthe model's decode step at one rank, batch {work.slots}, on {args.device}:")
    for name, value in step.items():
        print(f"  {name}: {value:.4g}")
    report(found, work, args.out, plots)
    meta: dict[str, object] = {
        "argv": sys.argv[1:],
        "workload": work.__dict__,
        "rounds": rounds,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "took_s": round(time.monotonic() - started, 1),
    }
    targets = {name: {"value": value, "met": met} for name, (value, met) in found.targets.items()}
    document = {"paths": found.paths, "ratios": found.ratios, "model_step": step, "targets": targets,
                "outputs_identical": found.outputs_identical, "meta": meta}  # fmt: skip
    (args.out / "bench_serving.json").write_text(json.dumps(document, indent=1) + "\n")
    say_written(args.out / "bench_serving.json", *([args.out / "bench_serving.png"] if plots else []))
    print(f"took {meta['took_s']} s")
    if not found.outputs_identical:
        raise SystemExit("the paths generated different tokens: the benchmark is invalid")


if __name__ == "__main__":
    main()
