"""How many blocks one rank's KV cache holds: ``pool_blocks``, from the memory it is given, the same on every rank.

``kv_memory`` is what a user gives (``ReferenceLm``'s argument, the demo's ``--kv-memory``):

* ``None``: as many blocks as every slot's whole context takes (``num_slots *
  ceil(max_seq_len / block_size)``): nothing is ever preempted;
* an ``int``: bytes of this rank's cache;
* a ``float`` in ``(0, 1]``: that fraction of the memory free once this rank's weights
  are loaded (on CUDA its device's, ``torch.cuda.mem_get_info``; on the CPU the host's
  ``MemAvailable``, which the ranks of one host share: give each its part).

The ranks may hold different KV heads, and see different free memory, so with a given
``kv_memory`` they agree on the smallest count (``EpLink.min_u32``): every rank ends
with the same pool, as the head's block tables need.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import EpLink
from ..config import LmConfig, Shard

KvMemory = int | float | None
"""Bytes (``int``), a fraction of the free memory (``float``), or ``None``: see the module."""
_MEMINFO = Path("/proc/meminfo")


def check_kv_memory(kv_memory: object) -> KvMemory:
    """``kv_memory`` as given, checked.

    Raises:
        TypeError: not an int, a float or ``None`` (``bool`` is not an int).
        ValueError: an int below 1, or a float outside ``(0, 1]``.
    """
    if kv_memory is None:
        return None
    if type(kv_memory) is int:
        if kv_memory < 1:
            raise ValueError(f"kv_memory must be at least 1 byte, got {kv_memory}")
        return kv_memory
    if type(kv_memory) is float:
        if not 0 < kv_memory <= 1:
            raise ValueError(f"kv_memory as a fraction of the free memory must be in (0, 1], got {kv_memory}")
        return kv_memory
    raise TypeError(
        f"kv_memory must be an int (bytes), a float (a fraction of the free memory) or None, "
        f"got {type(kv_memory).__name__} {kv_memory!r}"
    )


def block_bytes(config: LmConfig, shard: Shard, block_size: int, itemsize: int) -> int:
    """Bytes of one block of a rank's cache: keys and values of its KV heads, every layer."""
    return 2 * config.n_layers * block_size * shard.kv_heads * config.head_dim * itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: a CUDA device's (``mem_get_info``), else the host's ``MemAvailable``.

    Raises:
        OSError: the host's free memory cannot be read (no ``/proc/meminfo``, or no ``MemAvailable`` in it).
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in _MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{_MEMINFO} says no MemAvailable: give kv_memory in bytes")


def pool_blocks(
    link: EpLink,
    config: LmConfig,
    shard: Shard,
    *,
    kv_memory: KvMemory,
    block_size: int,
    itemsize: int,
    weights: int,
    device: torch.device,
) -> int:
    """The blocks of every rank's cache (see the module); ``weights``: the bytes of this rank's weights, not yet
    loaded.  Collective (every rank, at the same point) when ``kv_memory`` is given and the link has several ranks.

    Raises:
        ValueError: ``kv_memory`` holds no block (on every rank, when one's holds none), or a bad ``block_size``.
        TypeError, ValueError: as ``check_kv_memory``.
        OSError: as ``free_memory``.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be an int of at least 1, got {block_size!r}")
    kv_memory = check_kv_memory(kv_memory)
    per_sequence = -(-config.max_seq_len // block_size)
    if kv_memory is None:
        return link.num_slots * per_sequence
    size = block_bytes(config, shard, block_size, itemsize)
    if isinstance(kv_memory, float):
        free = free_memory(device)
        budget = int(kv_memory * max(0, free - weights))
        what = (
            f"kv_memory={kv_memory} of the {free / 2**20:,.0f} MiB free less the {weights / 2**20:,.0f} MiB of weights"
        )
    else:
        budget, what = kv_memory, f"kv_memory={kv_memory} bytes"
    blocks = min(budget // size, 0xFFFF_FFFF)
    agreed = link.min_u32(blocks) if link.world_size > 1 else blocks
    if agreed < 1:
        mine = f"{what} holds {blocks} block(s) of {size:,} bytes ({block_size} positions) on rank {link.rank}"
        raise ValueError(f"the KV cache holds no block: {mine}" if blocks < 1 else f"another rank's KV cache holds "
                         f"no block (here, {mine})")  # fmt: skip
    return agreed
