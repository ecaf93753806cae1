"""What the deeper sync point costs: the reference model's decode step and state digest with ``check_kv_values``.

One rank (the cost is each rank's own), the shipped weights, float32 on the CPU.
Each round times a decode step of a full batch with the check off and on, side
by side, and the state digest of full slots (what a sync point computes) with
the check off (the bookkeeping alone) and on (plus the cache's reduction); the
medians over rounds and their ratios are printed.  Figures are not asserted:
these machines are noisy.

    python benchmarks/bench_kv_check.py [--rounds 30] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import model_step
from metrale_model_engine.reference import LmState, ReferenceLm

PROMPT = tuple(b"Licensed under the Apache License, Version 2.0 (the")  # the shipped model: byte ids


def filled(batch: int, check: bool) -> tuple[ReferenceLm, list[LmState | None]]:
    """A one-rank model with ``batch`` slots, each holding :data:`PROMPT`."""
    return model_step.filled(batch, PROMPT, lambda link: ReferenceLm(link, check_kv_values=check))


def timed(call: object) -> float:
    assert callable(call)
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {check: filled(args.batch, check) for check in (False, True)}
    seq_ids, tokens = list(range(args.batch)), [65] * args.batch
    steps: dict[bool, list[float]] = {False: [], True: []}
    digests: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for check in (False, True) if round_ % 2 else (True, False):  # each goes first in half of the rounds
            model, slots = models[check]
            if any(state is not None and state.length >= model.config.max_seq_len - 1 for state in slots):
                model, slots = models[check] = filled(args.batch, check)
            steps[check].append(timed(lambda model=model, slots=slots: model.decode(slots, seq_ids, tokens)))
            digest = model.ep_link.state_digest
            assert digest is not None
            digests[check].append(timed(lambda digest=digest, slots=slots: digest(slots)))
    step_off, step_on = statistics.median(steps[False]), statistics.median(steps[True])
    digest_off, digest_on = statistics.median(digests[False]), statistics.median(digests[True])
    print(f"decode step, batch {args.batch}: {step_off * 1e3:.3f} ms off, {step_on * 1e3:.3f} ms with the check "
          f"({step_on / step_off:.2f}x, +{(step_on - step_off) * 1e6:.0f} us)")  # fmt: skip
    print(f"state digest at a sync point, {args.batch} slots: {digest_off * 1e6:.0f} us off, "
          f"{digest_on * 1e6:.0f} us with the check ({digest_on / digest_off:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
