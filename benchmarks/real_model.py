"""The main job on a real architecture, against what a user would pick instead, and against the memory wall.

For each family (Mixtral, Qwen3-MoE) the benchmark writes a random checkpoint with
``transformers``' ``save_pretrained`` (about 118 M parameters, 0.5 GB in float32:
hidden 512, 6 layers, 8 experts of 1536, 8 heads, 4 KV heads), then serves one
workload (32 requests, prompts of 8-64 random tokens and 8-64 new tokens each, from
a fixed seed, all arriving at once) four ways, each in a fresh process:

* ``ours, 1 rank``: :class:`~metrale_model_engine.reference.Server`'s continuous
  batching over 16 slots, 2 torch threads;
* ``ours, 2 ranks``: the same over shared memory, 1 thread per rank;
* ``transformers, batched``: ``generate`` on batches of 16 in arrival order,
  left-padded, greedy, each batch running until its longest request ends;
* ``transformers, one at a time``: ``generate`` on each request alone.

Per row: generated tokens per second (the tokens the requests asked for), the
median time to first token (from the arrival of every request), the decode step's
latency at batch 1 (one request alone), and each process's peak resident memory.
Then the roofline: the weight bytes our batch-1 decode step reads (attention,
router, the picked experts, the LM head), per second, against this machine's copy
bandwidth (a 256 MiB ``copy_``).  Compare only within one run: the machine is noisy.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)

from helpers.usage import memory

FAMILIES: Final = ("mixtral", "qwen3_moe")
SHAPE: Final[dict[str, Any]] = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
"""Both families' shared shape; the experts' are added per family."""
EXPERTS: Final[dict[str, dict[str, Any]]] = {
    "mixtral": {"intermediate_size": 1536, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"moe_intermediate_size": 1536, "intermediate_size": 1536, "num_experts": 8,
                  "num_experts_per_tok": 2, "head_dim": 64, "norm_topk_prob": True},
}  # fmt: skip
GOAL_BATCHED: Final = 1.5
"""Ours at 1 rank against transformers' batched tokens/s: at least this."""
GOAL_BANDWIDTH: Final = 0.5
"""Weight bytes our batch-1 decode step reads per second against the copy bandwidth: at least this."""


@dataclass(frozen=True)
class RealWorkload:
    """The requests: ``requests`` of them, prompts and new tokens of ``shortest`` to ``longest`` each, from
    ``seed``; ours serve them over ``slots`` slots, transformers in batches of ``slots``."""

    requests: int = 32
    shortest: int = 8
    longest: int = 64
    slots: int = 16
    seed: int = 0

    def build(self) -> list[tuple[list[int], int]]:
        """``(prompt, max_new_tokens)`` per request, in arrival order."""
        draw = random.Random(self.seed)
        return [
            ([draw.randrange(SHAPE["vocab_size"]) for _ in range(draw.randint(self.shortest, self.longest))],
             draw.randint(self.shortest, self.longest))
            for _ in range(self.requests)
        ]  # fmt: skip


QUICK: Final[dict[str, Any]] = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
                                "moe_intermediate_size": 256, "head_dim": 16}  # fmt: skip
"""A smoke run's smaller shape (a few MB)."""


def write_checkpoint(directory: Path, family: str, quick: bool, **overrides: Any) -> Path:
    """A random ``family`` model of :data:`SHAPE` (:data:`QUICK` for a smoke run; ``overrides`` last), by
    ``save_pretrained``."""
    import transformers

    config_class, model_class = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    torch.manual_seed(0)
    fields = {**SHAPE, **EXPERTS[family], **(QUICK if quick else {}), **overrides}
    if family == "mixtral":
        fields.pop("moe_intermediate_size", None)
        fields.pop("head_dim", None)
    config = config_class(**fields, eos_token_id=None)
    model_class(config).save_pretrained(directory)
    return directory


def ours(rank: int, world_size: int, directory: str, work: RealWorkload, out: str) -> None:
    """A rank of ``ours``: serve the workload (head), or run its commands (worker); save the figures."""
    from metrale_model_engine import EpLink, run_worker
    from metrale_model_engine.reference import LmState, ReferenceLm, Request, Server
    from metrale_model_engine.torch import open_link
    from metrale_model_engine.transport import SoloTransport

    torch.set_num_threads(2 if world_size == 1 else 1)
    link = EpLink(SoloTransport(), num_slots=work.slots) if world_size == 1 else open_link("shm", num_slots=work.slots)
    with ReferenceLm(link, checkpoint=directory) as model:
        if rank:
            slots: list[LmState | None] = [None] * work.slots
            run_worker(model, slots)
            _save(out, rank, peak=memory("VmHWM", default=0))
            return
        requests = [Request(i, tuple(prompt), new) for i, (prompt, new) in enumerate(work.build())]
        Server(model, eos_token_ids=()).run([Request(999, (1, 2, 3), 4)])  # warm-up
        first: dict[int, float] = {}

        def note(request: Request, _: int) -> None:
            first.setdefault(request.id, time.perf_counter())

        server = Server(model, eos_token_ids=(), prefill_chunk=64, on_token=note)
        started = time.perf_counter()
        done = server.run(requests)
        wall = time.perf_counter() - started
        alone = Server(model, eos_token_ids=())
        alone.run([Request(1000, tuple(requests[0].prompt), 64)])
        step_s = statistics.median(step.total_s for step in alone.decode_steps)
        link.shutdown_workers()
        _save(out, rank, tokens_per_s=sum(len(c.tokens) for c in done.values()) / wall,
              ttft_s=statistics.median(first[i] - started for i in range(len(requests))), step_s=step_s,
              outputs=[done[i].tokens for i in range(len(requests))], peak=memory("VmHWM", default=0))  # fmt: skip


class _Clock:
    """A ``generate`` streamer that notes when each step's tokens come (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def theirs(rank: int, world_size: int, directory: str, work: RealWorkload, batched: bool, out: str) -> None:
    """transformers' ``generate`` on the workload, batched (16, left-padded) or one request at a time."""
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    requests = work.build()
    greedy: dict[str, Any] = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, **greedy)  # warm-up
    groups = [requests[i : i + work.slots] for i in range(0, len(requests), work.slots)] if batched else [
        [request] for request in requests
    ]  # fmt: skip
    outputs: list[list[int]] = []
    first: list[float] = []
    per_token: list[float] = []
    started = time.perf_counter()
    for group in groups:
        width = max(len(prompt) for prompt, _ in group)
        ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt, _ in group])
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt, _ in group])
        clock = _Clock()
        longest = max(new for _, new in group)
        with torch.no_grad():
            out_ids = model.generate(ids, attention_mask=mask, max_new_tokens=longest, streamer=clock, **greedy)
        first.extend([clock.times[1] - started] * len(group))
        outputs.extend(out_ids[row, width : width + new].tolist() for row, (_, new) in enumerate(group))
        if len(clock.times) > 2:
            per_token.append((clock.times[-1] - clock.times[1]) / (len(clock.times) - 2))
    wall = time.perf_counter() - started
    _save(out, rank, tokens_per_s=sum(new for _, new in requests) / wall, ttft_s=statistics.median(first),
          step_s=statistics.median(per_token), outputs=outputs, peak=memory("VmHWM", default=0))  # fmt: skip


def _save(out: str, rank: int, **figures: object) -> None:
    import json

    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB float32 ``copy_`` (median of 9), with 2 threads."""
    torch.set_num_threads(2)
    source = torch.rand(64 * 2**20)
    target = torch.empty_like(source)
    times = []
    for _ in range(9):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return source.numel() * source.element_size() / statistics.median(times)


def step_weight_bytes(directory: Path) -> int:
    """The weight bytes one decode step at batch 1 reads: attention, router and norms of every layer, its
    ``top_k`` picked experts, the final norm, the LM head and one embedding row (float32)."""
    from metrale_model_engine.reference import Checkpoint

    config = Checkpoint.open(directory).config
    head = config.head_dim
    attention = (
        config.n_heads + 2 * config.n_kv_heads
    ) * head * config.d_model + config.d_model * config.n_heads * head
    expert = 3 * config.d_model * config.d_expert
    per_layer = attention + config.n_experts * config.d_model + config.top_k * expert + 2 * config.d_model
    head_and_ends = config.vocab_size * config.d_model + 2 * config.d_model  # the LM head, final norm, one row
    return 4 * (config.n_layers * per_layer + head_and_ends)


Row = dict[str, float]
Launch = Callable[..., list[int]]
Way = tuple[Callable[..., None], int, tuple[object, ...]]
WAYS: Final[dict[str, Way]] = {
    "ours, 1 rank": (ours, 1, ()),
    "ours, 2 ranks": (ours, 2, ()),
    "transformers, batched": (theirs, 1, (True,)),
    "transformers, one at a time": (theirs, 1, (False,)),
}
"""Each way: its program, its ranks, its arguments."""


def run_way(launch: Launch, directory: Path, work: RealWorkload, name: str, out: Path) -> tuple[Row, list[list[int]]]:
    """One run of way ``name`` in fresh processes: its figures and its outputs."""
    import json

    program, world_size, extra = WAYS[name]
    out.mkdir()
    codes = launch(program, world_size, str(directory), work, *extra, str(out))
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    head = ranks[0]
    outputs: list[list[int]] = head.pop("outputs")
    row = {key: float(value) for key, value in head.items() if key != "peak"}
    row["peak_mb_per_rank"] = max(rank["peak"] for rank in ranks) / 2**20
    return row, outputs


def measure(launch: Launch, root: Path, quick: bool, rounds: int) -> dict[str, Any]:
    """Every family, every way, in ``rounds`` rounds (the ways in a fresh order each): each figure's median, the
    ratios paired by round, whether every output equals transformers', the roofline and the goals.

    ``launch(program, world_size, *args)`` runs ``program`` in fresh processes and returns their exit codes.
    """
    work = RealWorkload(requests=8, shortest=4, longest=12, slots=4) if quick else RealWorkload()
    shuffle = random.Random(1)
    found: dict[str, Any] = {"rounds": rounds, "workload": work.__dict__, "families": {}}
    bandwidths: list[float] = []
    for family in FAMILIES:
        directory = write_checkpoint(root / family, family, quick)
        runs: dict[str, list[Row]] = {name: [] for name in WAYS}
        outputs: dict[str, list[list[list[int]]]] = {name: [] for name in WAYS}
        for index in range(rounds):
            bandwidths.append(copy_bandwidth())
            for name in shuffle.sample(list(WAYS), len(WAYS)):
                row, generated = run_way(launch, directory, work, name, root / f"{family}-{index}-{len(runs[name])}"
                                         f"-{name.replace(', ', '-').replace(' ', '_')}")  # fmt: skip
                runs[name].append(row)
                outputs[name].append(generated)
        rows = {name: {key: statistics.median(row[key] for row in rounds_of) for key in rounds_of[0]}
                for name, rounds_of in runs.items()}  # fmt: skip
        bandwidth = statistics.median(bandwidths[-rounds:])
        weights = step_weight_bytes(directory)

        ours, alone = runs["ours, 1 rank"], runs["transformers, one at a time"]
        batched = statistics.median(o["tokens_per_s"] / t["tokens_per_s"]
                                    for o, t in zip(ours, runs["transformers, batched"], strict=True))  # fmt: skip
        step = statistics.median(t["step_s"] / o["step_s"] for o, t in zip(ours, alone, strict=True))
        roofline = statistics.median(weights / o["step_s"] / b for o, b in zip(ours, bandwidths[-rounds:], strict=True))
        reference = outputs["transformers, one at a time"][0]
        found["families"][family] = {
            "rows": rows,
            "checkpoint_mb": sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**20,
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "outputs_equal_transformers": all(run == reference for way in ("ours, 1 rank", "ours, 2 ranks")
                                              for run in outputs[way]),
            "step_weight_mb": weights / 2**20,
            "goals": {
                f"1 rank at least {GOAL_BATCHED}x transformers' batched tokens/s": (batched, batched >= GOAL_BATCHED),
                "batch-1 decode step no slower than transformers' (their step / ours)": (step, step >= 1),
                f"batch-1 weight bytes/s at least {GOAL_BANDWIDTH:.0%} of the copy bandwidth": (
                    roofline, roofline >= GOAL_BANDWIDTH),
            },
        }  # fmt: skip
    return found


def report(found: dict[str, Any]) -> None:
    print(f"\nreal architectures, medians of {found['rounds']} rounds (ratios paired by round); 'step ms' is a decode "
          "step at batch 1 (for transformers, batched: one of a batch of 16):")  # fmt: skip
    for family, result in found["families"].items():
        print(f"{family}: {result['checkpoint_mb']:.0f} MB checkpoint; a batch-1 decode step reads "
              f"{result['step_weight_mb']:.1f} MB of weights; this machine copies {result['copy_bandwidth_gb_s']:.1f} "
              "GB/s")  # fmt: skip
        print(f"  {'way':<30}{'tokens/s':>10}{'TTFT ms':>10}{'step ms':>10}{'peak MB/rank':>14}")
        for name, row in result["rows"].items():
            print(f"  {name:<30}{row['tokens_per_s']:>10.0f}{row['ttft_s'] * 1e3:>10.0f}{row['step_s'] * 1e3:>10.2f}"
                  f"{row['peak_mb_per_rank']:>14.0f}")  # fmt: skip
        print(
            f"  outputs equal to transformers' (one at a time) at 1 and 2 ranks: {result['outputs_equal_transformers']}"
        )
        for goal, (value, met) in result["goals"].items():
            print(f"  goal: {goal}: {value:.2f} ({'met' if met else 'MISSED'})")
