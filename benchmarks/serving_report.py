"""The serving benchmark's analysis: per path the tokens/s and the decode step's split, paired ratios, the
targets, the table and the figure (``bench_serving.py`` measures; this reads what it measured)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from serving_work import RoundResult, Workload

TARGET_SHARE: Final = 0.02
"""The protocol's share of a decode step at the full batch, over shared memory: at most this."""
TARGET_PROTOCOL_US: Final = 25.0
"""The head's protocol time of that step (the decode command's send), median, in microseconds: at most this."""


@dataclass
class Findings:
    paths: dict[str, dict[str, float]]
    ratios: dict[str, float]
    targets: dict[str, tuple[float, bool]]
    outputs_identical: bool


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
