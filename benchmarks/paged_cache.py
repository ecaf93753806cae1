"""The paged KV cache against the reservation it replaced, and against ``transformers``' own paged batching.

Every side runs alone in a fresh process (``paged_side.py``) at one rank and one torch
thread, the sides of a comparison back to back, with the same KV memory; each prints
its process's peak resident set and the load average around it.  The checkpoints are
``real_model``'s random Mixtral of about 118 M parameters (float32: 12,288 bytes of KV a
position), one with ``max_position_embeddings`` 32,768 and one with today's 256:

* (a) many short requests on the 32,768-position context: a paged pool of
  ``reserved`` slots' worth of whole contexts, against the old per-slot reservation of
  that memory, which holds ``reserved`` sequences at once (emulated: ``kv_memory=None``
  with ``reserved`` slots reserves exactly that memory); the sequences decoded at once,
  and tokens/s;
* (b) requests sharing a system prompt: the median time to first token with prefix caching, on a cold
  cache (the target) and with the system prompt served once before (as a server has seen it), and without;
* (c) today's workload (``real_model.RealWorkload``, 16 slots, 256 positions): tokens/s of
  the paged pool (``kv_memory`` the bytes of every slot's whole context), of
  ``kv_memory=None``, and of the build before the paged cache (its contiguous per-slot
  cache: commit ``--contiguous-commit``, extracted with ``git archive``; left out, with a
  line, where git cannot), all over the 16 slots the contiguous cache holds;
* (d) the same workload and KV bytes, ours against ``transformers``' continuous batching over
  its paged cache, each free to run every request at once (the bytes hold them all): the paged
  pool over as many slots as requests, ``transformers`` with as many requests a batch, pages
  of ``PagedWork.page`` positions and ``PagedWork.batch_tokens`` tokens a forward; and, for
  the runs before, both at 16 a batch (``transformers``' pages of 256: one request each).

Each target is printed met or missed with its ratio.  ``measure`` runs them, ``report`` prints them
(``bench_serving.py --part paged`` calls both).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import real_model
from paged_side import SideSpec

HERE: Final = Path(__file__).resolve().parent
CONTIGUOUS_COMMIT: Final = "a0eb253"
"""The last build with the contiguous per-slot KV cache (before the paged cache was merged)."""
TARGETS: Final = {"concurrent": 4.0, "short_tokens_per_s": 2.0, "ttft": 3.0, "contiguous": 0.95, "transformers": 1.5}


@dataclass(frozen=True)
class PagedWork:
    """The part's sizes (``FULL`` or ``QUICK``)."""

    long_context: int = 32_768
    reserved: int = 4
    """(a): the slots the old reservation of the KV memory holds."""
    short_requests: int = 32
    short_prompt: tuple[int, int] = (32, 128)
    short_new: tuple[int, int] = (32, 128)
    short_slots: int = 32
    shared_requests: int = 64
    system_prompt: int = 1024
    user_prompt: tuple[int, int] = (16, 64)
    shared_new: int = 8
    shared_slots: int = 16
    shared_context: int = 2048
    page: int = 16
    """(d): transformers' page, in positions (its cache then holds every request at once, as ours)."""
    batch_tokens: int = 1024
    """(d): transformers' most tokens a forward (its default 8,192 sizes a mask of 400 MB here)."""


FULL: Final = PagedWork()
QUICK: Final = PagedWork(long_context=4096, short_requests=16, short_slots=16, short_prompt=(16, 48),
                         short_new=(16, 48), shared_requests=8, system_prompt=128, shared_slots=4,
                         shared_context=512)  # fmt: skip


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def run_side(spec: SideSpec, out: Path, name: str, pythonpath: str | None = None) -> dict[str, Any]:
    """One side in a fresh process (``paged_side.py``): its figures, with the load average before and after."""
    slug = name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
    spec_path, out_path = out / f"{slug}.spec.json", out / f"{slug}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    before = load()
    done = subprocess.run([sys.executable, str(HERE / "paged_side.py"), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{name}: exit code {done.returncode}\n{done.stderr[-4000:]}")
    figures: dict[str, Any] = json.loads(out_path.read_text())
    figures.update(load_before=before, load_after=load())
    print(f"  {name}: {figures['tokens_per_s']:.1f} tokens/s, TTFT {figures['ttft_s'] * 1e3:.0f} ms, peak "
          f"{figures['peak_bytes'] / 2**20:.0f} MiB (load {before:.1f} -> {figures['load_after']:.1f})",
          flush=True)  # fmt: skip
    return figures


def contiguous_source(root: Path, commit: str) -> str | None:
    """The ``src`` of ``commit`` extracted under ``root`` (for ``PYTHONPATH``), or ``None`` (said why) without git."""
    target = root / "contiguous"
    target.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", commit, "src"], capture_output=True,
                                 timeout=120, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"  no contiguous build: git archive {commit} failed ({error}); (c) compares kv_memory=None alone")
        return None
    return str(target / "src")


def _draw(seed: int, count: int, prompt: tuple[int, int], new: tuple[int, int]) -> list[tuple[list[int], int]]:
    draw = random.Random(seed)
    vocab = real_model.SHAPE["vocab_size"]
    return [([draw.randrange(vocab) for _ in range(draw.randint(*prompt))], draw.randint(*new)) for _ in range(count)]


def _fit(requests: list[tuple[list[int], int]], kv_memory: int, per_position: int) -> dict[str, int]:
    """The KV memory, the longest request (prompt and new tokens) and how many of it the pool's blocks of 16 hold."""
    longest = max(len(prompt) + new for prompt, new in requests)
    return {"kv_memory": kv_memory, "longest_request": longest,
            "pool_holds": kv_memory // (16 * per_position) // -(-longest // 16)}  # fmt: skip


def _ratio(name: str, value: float, goal: float) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": goal, "met": value >= goal}


Sides = dict[str, tuple[SideSpec, str | None]]
"""A comparison's sides: each its spec, and the ``PYTHONPATH`` of its build (``None``: this one)."""


def compare(sides: Sides, rounds: int, out: Path, order: random.Random) -> dict[str, Any]:
    """Every side once a round, in a fresh order each round: per side its figures' medians over the rounds and each
    round's figures (``runs``); ``outputs_equal``: whether every side's tokens, in every round, equal the first's."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for index in range(rounds):
        for name in order.sample(list(sides), len(sides)):
            spec, pythonpath = sides[name]
            runs[name].append(run_side(spec, out, f"{name}, round {index + 1}", pythonpath))
    reference = runs[next(iter(sides))][0]["outputs"]
    found: dict[str, Any] = {"outputs_equal": all(run.pop("outputs") == reference for r in runs.values() for run in r)}
    for name, figures in runs.items():
        found[name] = {key: statistics.median(run[key] for run in figures) for key in figures[0]}
        found[name]["runs"] = figures
    return found


def paired(found: dict[str, Any], a: str, b: str, key: str) -> float:
    """The median over rounds of side ``a``'s ``key`` over side ``b``'s (the rounds ran side by side)."""
    pairs = zip(found[a]["runs"], found[b]["runs"], strict=True)
    return float(statistics.median(x[key] / y[key] for x, y in pairs))


def measure(root: Path, quick: bool, rounds: int, contiguous_commit: str = CONTIGUOUS_COMMIT) -> dict[str, Any]:
    """Every comparison in ``rounds`` rounds, its sides in a fresh order each; the figures, ratios paired by round,
    and the verdicts (see the module)."""
    work = QUICK if quick else FULL
    long_dir = real_model.write_checkpoint(root / "long", "mixtral", quick, max_position_embeddings=work.long_context)
    today_dir = real_model.write_checkpoint(root / "today", "mixtral", quick)
    shape = {**real_model.SHAPE, **(real_model.QUICK if quick else {})}
    per_position = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
        shape["hidden_size"] // shape["num_attention_heads"]) * 4  # fmt: skip
    out = root / "sides"
    out.mkdir()
    order = random.Random(5)
    base: SideSpec = {"way": "ours", "checkpoint": str(long_dir), "max_seq_len": work.long_context, "slots": 1,
                      "kv_memory": None, "prefix_caching": True, "prefill_chunk": 256, "page_size": 256,
                      "max_batch_tokens": None, "threads": 1, "warm": [[1, 2, 3]], "requests": []}  # fmt: skip
    found: dict[str, Any] = {"work": asdict(work), "rounds": rounds, "bytes_per_position": per_position,
                             "load_start": load()}  # fmt: skip

    print(f"\n(a) {work.short_requests} short requests, context {work.long_context:,}, KV memory of {work.reserved} "
          "whole contexts:")  # fmt: skip
    kv_memory = work.reserved * work.long_context * per_position
    short: SideSpec = {**base, "requests": _draw(1, work.short_requests, work.short_prompt, work.short_new)}
    found["short"] = compare({"reservation": ({**short, "slots": work.reserved, "kv_memory": None}, None),
                              "paged pool": ({**short, "slots": work.short_slots, "kv_memory": kv_memory}, None)},
                             rounds, out, order)  # fmt: skip
    found["short"].update(_fit(short["requests"], kv_memory, per_position))

    print(f"\n(b) {work.shared_requests} requests sharing a {work.system_prompt:,}-token system prompt:")
    draw = random.Random(2)
    system = [draw.randrange(shape["vocab_size"]) for _ in range(work.system_prompt)]
    shared: SideSpec = {**base, "max_seq_len": work.shared_context, "slots": work.shared_slots,
              "kv_memory": work.shared_slots * work.shared_context * per_position, "warm": [system + [7] * 16],
              "requests": [(system + prompt, work.shared_new) for prompt, _ in
                           _draw(3, work.shared_requests, work.user_prompt, (1, 1))]}  # fmt: skip
    unshared = [(system[0] + 1) % shape["vocab_size"]] * (work.system_prompt + 16)  # no block of the system prompt
    cold: SideSpec = {**shared, "warm": [unshared]}  # the kernels warmed, nothing of the requests' cached
    found["shared"] = compare({"prefix caching, cold cache": (cold, None),
                               "no prefix caching": ({**shared, "prefix_caching": False}, None),
                               "prefix caching, served before": (shared, None)},
                              rounds, out, order)  # fmt: skip

    today = real_model.RealWorkload(requests=8, shortest=4, longest=12, slots=4) if quick else real_model.RealWorkload()
    kv_today = today.slots * shape["max_position_embeddings"] * per_position
    print(f"\n(c, d) today's workload ({today.requests} requests, {today.slots} slots), KV memory {kv_today:,} bytes:")
    same: SideSpec = {**base, "checkpoint": str(today_dir), "max_seq_len": shape["max_position_embeddings"],
                      "slots": today.slots, "kv_memory": kv_today, "prefill_chunk": 64,
                      "requests": today.build()}  # fmt: skip
    free, apart = f"{today.requests} slots", f"{today.slots} a batch"
    theirs: SideSpec = {**same, "way": "transformers", "slots": today.requests, "page_size": work.page,
                        "max_batch_tokens": work.batch_tokens}  # fmt: skip
    sides: Sides = {"paged pool": (same, None), "kv_memory=None": ({**same, "kv_memory": None}, None),
                    f"paged pool, {free}": ({**same, "slots": today.requests}, None),
                    f"transformers, {today.requests} a batch": (theirs, None),
                    f"transformers, {apart}": ({**same, "way": "transformers"}, None)}  # fmt: skip
    source = contiguous_source(root, contiguous_commit)
    if source is not None:
        sides[f"contiguous ({contiguous_commit})"] = ({**same, "prefix_caching": None}, source)
    found["today"] = compare(sides, rounds, out, order)
    found["today"].update(_fit(same["requests"], kv_today, per_position))
    versus = f"contiguous ({contiguous_commit})" if source is not None else "kv_memory=None"

    found["load_end"] = load()
    found["verdicts"] = [
        _ratio(f"(a) sequences decoded at once, paged / reservation, at least {TARGETS['concurrent']:g}x",
               paired(found["short"], "paged pool", "reservation", "most_concurrent"), TARGETS["concurrent"]),
        _ratio(f"(a) tokens/s, paged / reservation, at least {TARGETS['short_tokens_per_s']:g}x",
               paired(found["short"], "paged pool", "reservation", "tokens_per_s"), TARGETS["short_tokens_per_s"]),
        _ratio(f"(b) median TTFT, without / with prefix caching (cold cache), at least {TARGETS['ttft']:g}x",
               paired(found["shared"], "no prefix caching", "prefix caching, cold cache", "ttft_s"), TARGETS["ttft"]),
        _ratio(f"(c) tokens/s, paged pool / {versus}, at least {TARGETS['contiguous']:g}x",
               paired(found["today"], "paged pool", versus, "tokens_per_s"), TARGETS["contiguous"]),
        _ratio(f"(d) tokens/s, ours / transformers' continuous batching, {today.requests} a batch, at least "
               f"{TARGETS['transformers']:g}x", paired(found["today"], f"paged pool, {free}",
               f"transformers, {today.requests} a batch", "tokens_per_s"), TARGETS["transformers"]),
    ]  # fmt: skip
    whole = paired(found["today"], "paged pool", "kv_memory=None", "tokens_per_s")
    served = paired(found["shared"], "no prefix caching", "prefix caching, served before", "ttft_s")
    found["ratios"] = {"(b) median TTFT, without / with prefix caching (system prompt served before)": served,
                       "(c) paged pool / kv_memory=None, tokens/s": whole,
                       f"(d) ours / transformers, {apart} (its pages of 256), tokens/s":
                           paired(found["today"], "paged pool", f"transformers, {apart}", "tokens_per_s")}  # fmt: skip
    return found


def report(found: dict[str, Any]) -> None:
    mib = 2**20
    short = found["short"]
    print(f"\npaged KV cache, medians of {found['rounds']} round(s), ratios paired by round (one rank, one thread; "
          f"load average {found['load_start']:.1f} at the start, {found['load_end']:.1f} at the end):")  # fmt: skip
    for part, label in (("short", "(a)"), ("today", "(c/d)")):
        fit = found[part]
        print(f"{label} KV memory {fit['kv_memory'] / mib:,.0f} MiB: {fit['pool_holds']:,} sequences of the longest "
              f"request ({fit['longest_request']} tokens) fit the pool")  # fmt: skip
    print(f"  {'side':<36}{'tokens/s':>9}{'TTFT ms':>9}{'at once':>8}{'steps':>7}{'step ms':>9}{'KV MiB':>8}"
          f"{'peak MiB':>9}{'hits':>7}")  # fmt: skip
    for part, label in (("short", "(a)"), ("shared", "(b)"), ("today", "(c/d)")):
        for name, side in found[part].items():
            if not isinstance(side, dict):
                continue
            kv = f"{side['kv_bytes'] / mib:.0f}" if side["kv_bytes"] >= 0 else "?"
            at_once = f"{side['most_concurrent']:.0f}" if side["most_concurrent"] >= 0 else "-"
            print(f"  {label + ' ' + name:<36}{side['tokens_per_s']:>9.1f}{side['ttft_s'] * 1e3:>9.0f}{at_once:>8}"
                  f"{side['steps']:>7.0f}{side['step_s'] * 1e3:>9.1f}{kv:>8}{side['peak_bytes'] / mib:>9.0f}"
                  f"{side['hit_tokens']:>7.0f}")  # fmt: skip
    print(f"outputs equal within each comparison, every round: (a) {short['outputs_equal']}, (b) "
          f"{found['shared']['outputs_equal']}, (c/d) {found['today']['outputs_equal']}")  # fmt: skip
    for name, value in found["ratios"].items():
        print(f"ratio: {name}: {value:.2f}x")
    for verdict in found["verdicts"]:
        print(f"target: {verdict['name']}: {verdict['value']:.2f}x ({'met' if verdict['met'] else 'MISSED'})")
