"""The demo's choices before any rank starts: the checkpoint and the world sizes it allows, the prompts as the
model's ids, the device and backend this machine allows, the ranks' threads, and whether their weights and KV
caches fit its memory.

Each refusal is a ``ValueError`` whose message is the demo's one ``error:`` line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from .args import PROMPT_IDS

if TYPE_CHECKING:
    import torch

    from ..reference import Checkpoint, Tokenizer

TORCHRUN_VARS: Final = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables that say this process is a rank that torchrun started."""


def under_torchrun_env() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def device_and_backend(
    args: argparse.Namespace, local_ranks: int, devices: int, world_sizes: Sequence[int]
) -> tuple[str, str]:
    """The device and the backend the ranks use, from ``--device`` and ``--backend`` and ``devices`` CUDA devices;
    ``world_sizes`` are those that split the model, ascending (the largest that fits is suggested).

    Raises:
        ValueError: the choice cannot run here: CUDA with fewer devices than local
            ranks (two ranks on one device is refused by NCCL, and would share its
            memory otherwise), NCCL for a model on the CPU, CUDA graphs off CUDA.
    """
    have = f"{devices} CUDA device{'s' if devices != 1 else ''}"
    on_gpus = 0 < local_ranks <= devices and args.backend != "gloo"  # gloo asked for: all-reduces on the host
    device = args.device or ("cuda" if on_gpus else "cpu")
    wanted = "--device cuda" if device == "cuda" else "--backend nccl" if args.backend == "nccl" else None
    if wanted is not None and devices < local_ranks:
        fits = [size for size in world_sizes if size <= devices]
        fewer = f"--world-size {fits[-1]}" if fits and not under_torchrun_env() else None
        on_cpu = "--device cpu" if wanted == "--device cuda" else "--backend gloo"
        instead = " or ".join(option for option in (fewer, on_cpu) if option)
        raise ValueError(
            f"{wanted} needs a CUDA device per local rank: {local_ranks} rank(s), {have} on this machine; use {instead}"
        )
    if args.backend == "nccl" and device == "cpu":
        raise ValueError("--backend nccl all-reduces CUDA tensors: it needs --device cuda; use --backend gloo")
    if args.cuda_graphs and device != "cuda":
        raise ValueError(f"--cuda-graphs needs --device cuda (the model is on the CPU here, with {have})")
    if args.cuda_graphs and local_ranks > 1:
        raise ValueError(
            "--cuda-graphs is for one rank (a replayed all-reduce could not be bounded by the collective "
            "timeout); use --world-size 1"
        )
    return device, args.backend or ("nccl" if device == "cuda" else "gloo")


def default_threads(local_ranks: int) -> int:
    """Torch threads per rank: this model's ops are too small to share among many threads.

    Measured (docs/reference.md): on a 16-core machine 2 ranks of 8 threads each took
    10.8 ms per decode step where ranks of 1 thread (the serving benchmark's) took
    3.75 ms, their threads spinning against each other's all-reduces; one rank alone
    gains a little from a second thread (1.06 against 1.14-1.24 ms at batch 4 here).
    """
    return min(2, os.cpu_count() or 1) if local_ranks == 1 else 1


def open_checkpoint(model: Path | None, max_seq_len: int | None, world_size: int) -> Checkpoint:
    """The checkpoint in ``model`` (``None``: the shipped one), opened and checked (its headers alone), and
    ``world_size`` checked against it.

    Raises:
        ValueError: it cannot be served (a ``CheckpointError`` is one), or by that many ranks.
    """
    from ..reference import Checkpoint

    checkpoint = Checkpoint.open(model, max_seq_len=max_seq_len)
    config = checkpoint.config
    if world_size not in config.world_sizes():
        raise ValueError(
            f"--world-size {world_size} cannot split the model: each rank holds one of its {config.n_heads} attention "
            f"heads at least (world sizes that can: 1 ..= {config.n_heads})"
        )
    return checkpoint


CUDA_KV_MEMORY: Final = 0.9
"""``--kv-memory``'s default on CUDA: this fraction of each device's memory free after the weights."""


def kv_memory(
    checkpoint: Checkpoint, dtype: torch.dtype, given: int | float | None, device: str, world_size: int,
    local_ranks: int,
) -> int | float | None:  # fmt: skip
    """Each rank's KV memory from ``--kv-memory`` (``given``): on CUDA a fraction stays one (of each rank's own
    device; ``CUDA_KV_MEMORY`` by default); on the CPU, where the host's ranks share its memory, a fraction becomes
    each local rank's part of the memory free after their weights, in bytes."""
    if device == "cuda":
        return CUDA_KV_MEMORY if given is None else given
    if not isinstance(given, float):
        return given
    import torch

    from ..reference.rank.pool import free_memory

    weights = sum(checkpoint.shard_bytes(rank, world_size, dtype) for rank in range(local_ranks))
    return max(1, int(given * max(0, free_memory(torch.device("cpu")) - weights) / local_ranks))


def check_memory(
    checkpoint: Checkpoint, dtype: torch.dtype, slots: int, world_size: int, local_ranks: int, kv_bytes: int | None
) -> None:
    """Refuse (``ValueError``) a run whose local ranks' weights and KV caches would not fit this machine's memory;
    ``kv_bytes``: each rank's KV cache (``None``: every slot's whole context)."""
    config = checkpoint.config
    per_rank = [
        checkpoint.shard_bytes(rank, world_size, dtype)
        + (config.kv_cache_bytes(slots, world_size, dtype.itemsize, rank=rank) if kv_bytes is None else kv_bytes)
        for rank in range(local_ranks)
    ]
    needed = sum(per_rank)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a platform that does not say
        return
    if needed > memory:
        given, less = f"--kv-memory of {kv_bytes} bytes a rank", "a smaller --kv-memory needs less"
        if kv_bytes is None:
            given = f"--slots {slots}, --max-seq-len {config.max_seq_len}"
            less = "a --kv-memory, fewer --slots or a shorter --max-seq-len needs less"
        raise ValueError(
            f"{given}: the weights and KV caches of {local_ranks} rank(s) would take {needed / 2**30:,.1f} GiB, more "
            f"than this machine's {memory / 2**30:,.1f} GiB of memory ({less})"
        )


def prompt_ids(
    given: Sequence[tuple[str, object]], checkpoint: Checkpoint, tokenizer: Tokenizer | None
) -> list[tuple[int, ...]]:
    """The prompts as token ids, each checked against the model: non-empty, in its vocabulary and context.

    Raises:
        ValueError: a text prompt without a tokenizer, or a prompt that is empty, too long or
            holds an id outside the vocabulary (the message gives the prompt's number, from 1).
    """
    from ..reference import check_prompt

    prompts: list[tuple[int, ...]] = []
    for number, (kind, value) in enumerate(given, start=1):
        if kind == PROMPT_IDS:
            assert isinstance(value, tuple)
            ids: tuple[int, ...] = value
        elif tokenizer is None:
            raise ValueError(
                f"prompt {number} is text, but {checkpoint.directory} has no tokenizer.json: give it as --prompt-ids"
            )
        else:
            assert isinstance(value, str)
            ids = tuple(tokenizer.encode(value))
        if not ids:
            raise ValueError(f"prompt {number} is empty: a prompt needs at least one token")
        check_prompt(ids, checkpoint.config, where=f"prompt {number}: ")
        prompts.append(ids)
    return prompts
