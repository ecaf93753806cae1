"""The reference model's greedy run that one rank and a sharded group must agree on (needs torch)."""

from __future__ import annotations

import torch

from metrale_model_engine.reference import LmConfig, ShardedLm, encode

PROMPTS = ("Licensed under the", "Permission is hereby")

GREEDY_STEPS = 24


def shipped_model(shipped: tuple[LmConfig, dict[str, torch.Tensor]], num_slots: int = 4) -> ShardedLm:
    config, full = shipped
    model = ShardedLm(config, num_slots=num_slots)
    model.load_full_state(full)
    return model


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def greedy_session(model: ShardedLm) -> dict[str, list[list[float]] | list[list[int]]]:
    """Prefill both prompts (the first in two chunks, in slot 2; the second in slot 0), then greedy-decode
    both in one batch; every step's logits and the tokens."""
    first, second = (encode(prompt) for prompt in PROMPTS)
    model.prefill(2, ints(first[:7]), 0)
    rows = [model.prefill(2, ints(first[7:]), 7), model.prefill(0, ints(second), 0)]
    positions = [len(first), len(second)]
    logits: list[list[float]] = []
    tokens: list[list[int]] = [[], []]
    for _ in range(GREEDY_STEPS):
        logits.extend(row.tolist() for row in rows)
        for row, generated in zip(rows, tokens, strict=True):
            generated.append(int(row.argmax()))
        out = model.decode(ints([2, 0]), ints([generated[-1] for generated in tokens]), ints(positions))
        rows = [out[0], out[1]]
        positions = [position + 1 for position in positions]
    return {"logits": logits, "tokens": tokens}
