"""SequenceState.extend against the bare C conversion of the same tokens, side by side.

    python benchmarks/bench_extend.py [--tokens 65536] [--rounds 7]

Prints the best round of each, alternating, and the ratio (target: at most 2x the
cost of ``array('I', tokens)``; see the README for what the check must also do).
"""

from __future__ import annotations

import argparse
import random
import timeit
from array import array

from metrale_model_engine import U32_TYPECODE, SequenceState, check_u32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65_536)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20)
    args = parser.parse_args()
    tokens = [random.randrange(32_000) for _ in range(args.tokens)]
    cases = {
        "SequenceState.extend": lambda: SequenceState(0).extend(tokens),
        "array('I', tokens)": lambda: array(U32_TYPECODE, tokens),
        # What extend did before: check_u32 on each token in a Python loop.
        "per-token check (before)": lambda: [check_u32(f"tokens[{i}]", t) for i, t in enumerate(tokens)],
    }
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            best[name] = min(best[name], timeit.timeit(case, number=args.number) / args.number)
    base = best["array('I', tokens)"]
    for name, seconds in best.items():
        print(f"{name:<24} {seconds * 1e3:8.3f} ms  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
