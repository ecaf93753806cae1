"""Cost of the trait's single-GPU defaults against plain methods, side by side.

Each default is timed against a plain method of the same signature that returns
the same constant; the two are measured in alternating rounds in one run and the
best round of each is compared.  Also times the default ``ep_broadcast_tokens``
with 1 token and with 1,000,000 tokens.  Run: ``python benchmarks/bench_defaults.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import timeit
from collections.abc import MutableSequence

from metrale_model_engine import ModelEp, SequenceState


class SingleGpu(ModelEp):
    """Inherits every default."""


class Plain:
    """The floor: the same signatures, the same constants, no checks."""

    __slots__ = ()

    def ep_worker_step(self, slots: MutableSequence[SequenceState | None]) -> bool:
        return True

    def is_ep(self) -> bool:
        return False

    def ep_broadcast_cmd(self, cmd: int) -> None:
        return None

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        return None

    def ep_protocol_v2(self) -> bool:
        return False

    def ep_broadcast_tokens(self, tokens: list[int]) -> list[int]:
        return []


CALLS = {
    "ep_worker_step(slots)": "m.ep_worker_step(slots)",
    "is_ep()": "m.is_ep()",
    "ep_broadcast_cmd(7)": "m.ep_broadcast_cmd(7)",
    "ep_broadcast_cmd_for_seq(3, 7)": "m.ep_broadcast_cmd_for_seq(3, 7)",
    "ep_protocol_v2()": "m.ep_protocol_v2()",
    "ep_broadcast_tokens(1 token)": "m.ep_broadcast_tokens(one)",
}


def time_ns(stmt: str, model: object, number: int, names: dict[str, object]) -> float:
    """Nanoseconds per execution of ``stmt`` with ``m`` bound to ``model``."""
    return timeit.Timer(stmt, globals={"m": model, **names}).timeit(number) / number * 1e9


def best_alternating(
    first: tuple[str, object], second: tuple[str, object], number: int, rounds: int, names: dict[str, object]
) -> tuple[float, float]:
    """Best round of each of two (statement, model) pairs, timed A B A B in one run."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):  # alternating: both see the same machine state
        a.append(time_ns(*first, number, names))
        b.append(time_ns(*second, number, names))
    return min(a), min(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per pair")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    data = {"slots": [None], "one": [1], "million": list(range(1_000_000))}
    defaults, plain = SingleGpu(), Plain()
    rows: dict[str, dict[str, float]] = {}
    for name, stmt in CALLS.items():
        ours, floor = best_alternating((stmt, defaults), (stmt, plain), args.number, args.rounds, data)
        rows[name] = {"default_ns": ours, "plain_ns": floor, "ratio": ours / floor}
    one, million = best_alternating(
        ("m.ep_broadcast_tokens(one)", defaults),
        ("m.ep_broadcast_tokens(million)", defaults),
        args.number,
        args.rounds,
        data,
    )
    tokens = {"one_token_ns": one, "million_tokens_ns": million, "ratio": million / one}

    print(
        f"Python {platform.python_version()} on {platform.machine()}, "
        f"best of {args.rounds} rounds of {args.number:,} calls"
    )
    print(f"{'call':<34}{'default ns':>12}{'plain ns':>10}{'ratio':>8}")
    for name, row in rows.items():
        print(f"{name:<34}{row['default_ns']:>12.1f}{row['plain_ns']:>10.1f}{row['ratio']:>7.2f}x")
    print(
        f"default ep_broadcast_tokens: 1 token {tokens['one_token_ns']:.1f} ns, "
        f"1,000,000 tokens {tokens['million_tokens_ns']:.1f} ns ({tokens['ratio']:.2f}x)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"python": sys.version, "calls": rows, "tokens": tokens}, out, indent=2)


if __name__ == "__main__":
    main()
