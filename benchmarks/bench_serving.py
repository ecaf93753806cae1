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

Then the main job on real architectures against ``transformers``' own ``generate``
(``real_model.py``: a random Mixtral and Qwen3-MoE of about 118 M parameters, at 1
and 2 ranks, with the roofline of a batch-1 decode step), when ``transformers`` is
installed (the ``test-torch`` extra).

Then the paged KV cache (``paged_cache.py``): against the per-slot reservation it replaced
(many short requests on a 32,768-position context; today's workload against the build
before it), prefix caching on and off (requests sharing a system prompt), and against
``transformers``' own continuous batching over its paged cache; each at equal KV memory,
with the peak memory of each side and the targets' verdicts, written to
``paged_cache.json`` (when ``transformers`` is installed).

Run: ``python benchmarks/bench_serving.py`` (about 5 minutes on 2 cores, and the paged
part's several more; ``--part protocol``, ``--part real`` or ``--part paged`` for one of
them); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from metrale_model_engine import EpLink, run_worker
from metrale_model_engine.reference import (
    LmSlots,
    LmState,
    ReferenceLm,
    Server,
    check_decode,
    check_prefill,
)
from metrale_model_engine.torch import open_link, run_group
from metrale_model_engine.transport import SoloTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_step
import paged_cache
import real_model
from output import DEFAULT_OUT, plotting_available, say_written
from serving_report import analyse, report
from serving_work import RoundResult, Workload

from peers import ShmEventChannel, ShmEventHandle

PATHS: Final = ("world 1", "ours shm", "ours gloo", "peer pickle", "peer shm+event")
CMD_END_ROUND: Final = 0x0000BEEF
"""The benchmark's own command: the round is over (workers leave their loop, the link stays up)."""


Call = tuple[Any, ...]
"""A peer call: ``("alloc", seq_id)``, ``("free", seq_id)``, ``("prefill", ...)``, ``("decode", ...)``."""
Send = Callable[[list[Call]], None]
Receive = Callable[[], Any]


class BenchLm(ReferenceLm):
    """The reference model with one more command, the end of a round, so that workers leave their loop."""

    round_over = False

    def ep_run_command(self, seq_id: int, cmd: int, slots: LmSlots) -> None:
        if cmd == CMD_END_ROUND:
            self.round_over = True
        else:
            super().ep_run_command(seq_id, cmd, slots)


class PeerLm(ReferenceLm):
    """The reference model whose head sends each forward as one pickled call (allocs and frees ride along, and
    the block-table entries the forward's sequences gain, decided by the head's ``kv_blocks``)."""

    def __init__(self, link: EpLink, send: Send | None) -> None:
        super().__init__(link)
        self._peer_send = send
        self._pending: list[tuple[object, ...]] = []

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        slots[seq_id] = LmState(seq_id)
        self._pending.append(("alloc", seq_id))

    def free(self, slots: LmSlots, seq_id: int) -> None:
        slots[seq_id] = None
        self.kv_blocks.release(seq_id)
        self._pending.append(("free", seq_id))

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        state = check_prefill(slots, seq_id, prompt, start, length, self.config)
        blocks = self.kv_blocks.table(seq_id, self.kv_blocks.blocks_for(start + length))[len(state.blocks) :]
        self.send_call(("prefill", seq_id, list(prompt), start, length, blocks))
        state.blocks.extend(blocks)
        return self.forward_prefill(state, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        states = check_decode(slots, seq_ids, tokens, self.config)
        grown = {s.seq_id: self.kv_blocks.table(s.seq_id, s.length // self.pool.block_size + 1)[len(s.blocks) :]
                 for s in states}  # fmt: skip
        self.send_call(("decode", list(seq_ids), list(tokens), grown))
        for state in states:
            state.blocks.extend(grown[state.seq_id])
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
                    _, seq_id, prompt, start, length, blocks = call
                    state = check_prefill(slots, seq_id, prompt, start, length, self.config)
                    state.blocks.extend(blocks)
                    self.forward_prefill(state, prompt, start, length)
                else:
                    _, seq_ids, tokens, grown = call
                    states = check_decode(slots, seq_ids, tokens, self.config)
                    for state in states:
                        state.blocks.extend(grown[state.seq_id])
                    self.forward_decode(states, tokens)


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
                    with model.ep_link.collective():  # its forward is empty: the peers' forwards that follow on
                        model.ep_link.empty_forward()  # this link's group are no command's
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


def protocol_part(args: argparse.Namespace, plots: bool) -> dict[str, object]:
    """The command paths side by side on the reference model, and its own decode step: printed, and as JSON."""
    work = Workload(32, 64, 64, 16, 16) if not args.quick else Workload(8, 32, 8, 4, 16)
    rounds = 1 if args.quick else args.rounds
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
    if not found.outputs_identical:
        raise SystemExit("the paths generated different tokens: the benchmark is invalid")
    targets = {name: {"value": value, "met": met} for name, (value, met) in found.targets.items()}
    return {"paths": found.paths, "ratios": found.ratios, "model_step": step, "targets": targets,
            "outputs_identical": found.outputs_identical, "workload": work.__dict__, "rounds": rounds}  # fmt: skip


def real_part(args: argparse.Namespace) -> dict[str, object]:
    """Both families against transformers (``real_model``), when transformers is installed: printed, and as JSON."""
    if importlib.util.find_spec("transformers") is None:
        print("\ntransformers is not installed (pip install -e '.[test-torch]'): no real architecture measured")
        return {}
    with tempfile.TemporaryDirectory(prefix="metrale-real-") as root:
        rounds = 1 if args.quick else args.real_rounds
        found = real_model.measure(lambda *call: run_group(*call, timeout=1800.0), Path(root), args.quick, rounds)
    real_model.report(found)
    return found


def paged_part(args: argparse.Namespace) -> None:
    """The paged KV cache's comparisons (``paged_cache``), when transformers is installed: printed, and written to
    ``paged_cache.json``."""
    if importlib.util.find_spec("transformers") is None:
        print("\ntransformers is not installed (pip install -e '.[test-torch]'): the paged cache is not measured")
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="metrale-paged-") as root:
        found = paged_cache.measure(
            Path(root), args.quick, 1 if args.quick else args.paged_rounds, args.contiguous_commit
        )
    paged_cache.report(found)
    found["meta"] = {"argv": sys.argv[1:], "torch": torch.__version__, "cpus": os.cpu_count(),
                     "took_s": round(time.monotonic() - started, 1)}  # fmt: skip
    (args.out / "paged_cache.json").write_text(json.dumps(found, indent=1) + "\n")
    say_written(args.out / "paged_cache.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of a small workload")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5; a warm-up round first)")
    parser.add_argument(
        "--real-rounds", type=int, default=3, help="rounds of the real architectures (default 3; each way once a round)"
    )
    parser.add_argument(
        "--part",
        choices=["all", "protocol", "real", "paged"],
        default="all",
        help="the command paths on the reference model, the real architectures, the paged KV cache, or all (default)",
    )
    parser.add_argument(
        "--paged-rounds", type=int, default=2, help="rounds of the paged cache's comparisons (default 2)"
    )
    parser.add_argument(
        "--contiguous-commit",
        default=paged_cache.CONTIGUOUS_COMMIT,
        help=f"the build before the paged cache, for the paged part (default {paged_cache.CONTIGUOUS_COMMIT})",
    )
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
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    document: dict[str, object] = {}
    if args.part in ("all", "protocol"):
        document.update(protocol_part(args, plots))
    if args.part in ("all", "real"):
        document["real_model"] = real_part(args)
    if args.part in ("all", "paged"):
        paged_part(args)
    if args.part == "paged":
        return
    document["meta"] = {
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "took_s": round(time.monotonic() - started, 1),
    }
    (args.out / "bench_serving.json").write_text(json.dumps(document, indent=1) + "\n")
    drawn = [args.out / "bench_serving.png"] if plots and args.part != "real" else []
    say_written(args.out / "bench_serving.json", *drawn)
    print(f"took {document['meta']['took_s']} s")  # type: ignore[index]


if __name__ == "__main__":
    main()
