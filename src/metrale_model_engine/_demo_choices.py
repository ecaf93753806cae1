"""The demo's choices before any rank starts: the world sizes the shipped model allows, the device and
backend this machine allows, the ranks' threads, and whether their KV caches fit its memory.

Each refusal is a ``ValueError`` whose message is the demo's one ``error:`` line.
"""

from __future__ import annotations

import argparse
import os
from typing import Final

TORCHRUN_VARS: Final = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables that say this process is a rank that torchrun started."""


def model_shape() -> tuple[int, int] | None:
    """The shipped model's attention heads and experts, read from its weights' header.

    ``None`` without torch or a readable weights file: ``main`` says so, in its own line.
    """
    try:
        from .reference import SHIPPED_WEIGHTS, read_config
    except ImportError:
        return None
    try:
        config = read_config(SHIPPED_WEIGHTS)
    except (OSError, ValueError):
        return None
    return config.n_heads, config.n_experts


def shared_world_sizes(heads: int, experts: int) -> list[int]:
    """The world sizes that can share ``heads`` attention heads and ``experts`` experts, ascending."""
    return [size for size in range(1, min(heads, experts) + 1) if not heads % size and not experts % size]


def unshared_world_size(world_size: int) -> str | None:
    """Why the shipped model cannot be split over ``world_size`` ranks, or ``None``."""
    shape = model_shape()
    if shape is None or world_size in shared_world_sizes(*shape):
        return None
    listed = ", ".join(map(str, shared_world_sizes(*shape)))
    return f"must divide the model's {shape[0]} attention heads and {shape[1]} experts ({listed}), got {world_size}"


def under_torchrun_env() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARS)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def device_and_backend(args: argparse.Namespace, local_ranks: int, devices: int) -> tuple[str, str]:
    """The device and the backend the ranks use, from ``--device`` and ``--backend`` and ``devices`` CUDA devices.

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
        shape = model_shape()
        fits = [size for size in shared_world_sizes(*shape) if size <= devices] if shape else []
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


def check_memory(slots: int, world_size: int, local_ranks: int) -> None:
    """Refuse (``ValueError``) a slot count whose KV caches would not fit this machine's memory."""
    from .reference import SHIPPED_WEIGHTS, read_config

    needed = read_config(SHIPPED_WEIGHTS).kv_cache_bytes(slots, world_size, 4) * local_ranks  # float32
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a platform that does not say
        return
    if needed > memory:
        raise ValueError(
            f"--slots {slots}: the KV caches of {local_ranks} rank(s) would take {needed / 2**30:,.1f} GiB, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory"
        )
