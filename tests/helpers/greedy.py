"""The reference model's greedy run that one rank and a sharded group must agree on, how closely their float32
logits must agree (``LOGIT_TOLERANCE``), and the shipped model built on one rank of a group (needs torch)."""

from __future__ import annotations

import torch

from metrale_model_engine.reference import AllReduce, Checkpoint, ExpertRouting, ShardedLm
from metrale_model_engine.reference.checkpoint import load_shard

PROMPTS = ("Licensed under the", "Permission is hereby")

LOGIT_TOLERANCE = 1e-4
"""The largest difference allowed between two float32 computations of the same logits that sum in another order:
a sharded model's against one rank's, a batched or cached decode's against one alone or the training path's (seen:
about 1e-6)."""

GREEDY_STEPS = 24
BLOCK_SIZE = 16
Greedy = dict[str, list[list[float]] | list[list[int]]]
"""A greedy session's figures: ``"logits"``, every step's rows; ``"tokens"``, each prompt's generated tokens."""


def on_one_thread() -> None:
    """Torch's CPU ops on one thread, as each rank process runs them."""
    torch.set_num_threads(1)


def byte_ids(text: str) -> list[int]:
    """``text`` as the shipped model's tokens: its UTF-8 bytes."""
    return list(text.encode())


def shipped_model(
    shipped: Checkpoint,
    num_slots: int = 4,
    *,
    rank: int = 0,
    world_size: int = 1,
    all_reduce: AllReduce | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    routing: ExpertRouting = "auto",
) -> ShardedLm:
    """Rank ``rank`` of ``world_size`` of the shipped model, its shard read from the checkpoint, with the blocks of
    ``num_slots`` whole sequences of 16-position blocks (``table`` gives each its own)."""
    model = ShardedLm(
        shipped.config,
        num_blocks=num_slots * -(-shipped.config.max_seq_len // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        rank=rank,
        world_size=world_size,
        all_reduce=all_reduce,
        dtype=dtype,
        device=torch.device(device),
        expert_routing=routing,
    )
    load_shard(model, shipped)
    return model


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def table(model: ShardedLm, slot: int) -> torch.Tensor:
    """The block table of sequence ``slot`` when each of ``shipped_model``'s sequences has blocks of its own,
    interleaved with the others' (slot ``s`` of ``n``: blocks ``s, s + n, s + 2n, ...``), so that no table is a
    range of blocks."""
    slots = model.num_blocks // model.blocks_per_sequence
    return torch.arange(model.blocks_per_sequence) * slots + slot


def tables(model: ShardedLm, slots: list[int]) -> torch.Tensor:
    """``table`` of each of ``slots``, as the rows of one tensor (a decode step's)."""
    return torch.stack([table(model, slot) for slot in slots])


def greedy_session(model: ShardedLm) -> Greedy:
    """Prefill both prompts (the first in two chunks, in slot 2; the second in slot 0), then greedy-decode
    both in one batch; every step's logits and the tokens."""
    first, second = (byte_ids(prompt) for prompt in PROMPTS)
    model.prefill(table(model, 2), ints(first[:7]), 0)
    rows = [model.prefill(table(model, 2), ints(first[7:]), 7), model.prefill(table(model, 0), ints(second), 0)]
    positions = [len(first), len(second)]
    logits: list[list[float]] = []
    tokens: list[list[int]] = [[], []]
    for _ in range(GREEDY_STEPS):
        logits.extend(row.tolist() for row in rows)
        for row, generated in zip(rows, tokens, strict=True):
            generated.append(int(row.argmax()))
        out = model.decode(tables(model, [2, 0]), ints([generated[-1] for generated in tokens]), ints(positions))
        rows = [out[0], out[1]]
        positions = [position + 1 for position in positions]
    return {"logits": logits, "tokens": tokens}


def one_rank_greedy(shipped: Checkpoint) -> Greedy:
    """The shipped model's :func:`greedy_session` on one rank, in this process, on one thread."""
    on_one_thread()
    return greedy_session(shipped_model(shipped))
