"""Rank programs for checkpoints in the Hugging Face layout; each runs in a process of ``torch.run_group``.

:func:`serve_prompts` serves the oracle's prompts twice from a checkpoint, in a cache too small
for them all at once, and the head saves the tokens, the preemptions and the prefix cache's hits;
:func:`load_and_measure` saves what loading a rank's shard cost its memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from metrale_model_engine import EpLink, run_worker
from metrale_model_engine.reference import (
    Checkpoint,
    LmConfig,
    LmState,
    ReferenceLm,
    Request,
    Sampling,
    Server,
    ShardedLm,
)
from metrale_model_engine.reference.rank.pool import block_bytes
from metrale_model_engine.torch import open_link
from metrale_model_engine.transport import SoloTransport

from helpers.oracle import NEW_TOKENS, PROMPTS
from helpers.rank_results import save
from helpers.usage import memory

SLOTS = 3
BLOCK_SIZE = 4
TIGHT_BLOCKS = 10
"""A cache of 10 blocks of 4 positions: the oracle's longest request fits it alone (31 positions, 8 blocks), but its
first three, which run together, grow to 15 + 22 + 11 positions (13 blocks): a decode step preempts the newest."""
QUIET = logging.getLogger("tests.checkpoints.quiet")
QUIET.setLevel(logging.CRITICAL)


def served_tokens(
    model: ReferenceLm, sampling: Sampling | None = None, *, prefix_caching: bool = True
) -> tuple[list[list[int]], int, int]:
    """The head's tokens for the oracle's prompts served twice, one round after the other (the second round's
    prompts find blocks of the first's cached, with ``prefix_caching``), every one of their new tokens (no
    end-of-sequence stop); how many requests were preempted; and the prompt tokens found cached."""
    server = Server(model, prefill_chunk=5, sync_every=4, eos_token_ids=(), prefix_caching=prefix_caching)
    tokens = []
    for first in (0, len(PROMPTS)):
        requests = [Request(first + i, prompt, NEW_TOKENS, sampling or Sampling()) for i, prompt in enumerate(PROMPTS)]
        done = server.run(requests)
        tokens += [done[request.id].tokens for request in requests]
    server.shutdown()  # a sync point: every rank's KV bookkeeping is the head's
    return tokens, server.preemptions, model.kv_blocks.hit_tokens


def tight_kv_memory(directory: str | Path, rank: int, world_size: int) -> int:
    """The bytes of :data:`TIGHT_BLOCKS` float32 blocks of :data:`BLOCK_SIZE` positions on ``rank``."""
    config = Checkpoint.open(directory).config
    return TIGHT_BLOCKS * block_bytes(config, config.shard(rank, world_size), BLOCK_SIZE, 4)


def serve_prompts(
    rank: int,
    world_size: int,
    directory: str,
    transport: str,
    out: str,
    sampling: Sampling | None = None,
    prefix_caching: bool = True,
) -> None:
    """Serve the oracle's prompts twice (``served_tokens``) from ``directory`` in float32 over ``transport``, in a
    cache of :data:`TIGHT_BLOCKS` blocks; the head saves the tokens, the preemptions and the prefix cache's hits."""
    torch.set_num_threads(1)
    link = open_link(transport, num_slots=SLOTS, command_timeout=60.0) if world_size > 1 else None
    kv_memory = tight_kv_memory(directory, rank, world_size)
    with ReferenceLm(link or EpLink(SoloTransport(), num_slots=SLOTS), checkpoint=directory, dtype=torch.float32,
                     kv_memory=kv_memory, block_size=BLOCK_SIZE) as model:  # fmt: skip
        if rank == 0:
            tokens, preemptions, hits = served_tokens(model, sampling, prefix_caching=prefix_caching)
            kind = type(model.ep_link.transport).__name__
            save(out, rank, tokens=tokens, preemptions=preemptions, hit_tokens=hits, transport=kind)
        else:
            slots: list[LmState | None] = [None] * SLOTS
            summary = run_worker(model, slots, logger=QUIET)
            save(out, rank, failed=summary.commands_failed)


def load_and_measure(rank: int, world_size: int, directory: str, out: str) -> None:
    """Load this rank's shard of ``directory``; save how far its resident memory rose meanwhile, at its peak.

    The peak is the kernel's high-water mark (``VmHWM``), reset just before the
    load (``/proc/self/clear_refs``), against the resident set just before.  A tiny
    model is built and dropped first: torch's first use of its allocation and
    initialisation code maps about 20 MB of libraries and arenas, which is no part
    of the shard (and varies from machine to machine).
    """
    torch.set_num_threads(1)
    tiny = LmConfig(d_model=32, n_heads=4, n_experts=4, top_k=2, d_expert=64, max_seq_len=8)
    ShardedLm(tiny, num_blocks=1, rank=rank, world_size=world_size, all_reduce=lambda tensor: None)  # dropped at once
    link = open_link("torch", num_slots=1, command_timeout=60.0)
    before = memory("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    with ReferenceLm(link, checkpoint=directory) as model:
        grew = memory("VmHWM") - before
        save(out, rank, grew=grew, shard=model.checkpoint.shard_bytes(rank, world_size, torch.float32))
        if rank == 0:
            link.shutdown_workers()
        else:
            slots: list[LmState | None] = [None]
            run_worker(model, slots, logger=QUIET)


def open_and_measure(directory: str) -> int:
    """How far this process's resident memory rises, at its peak, while it opens ``directory`` (a launcher's check)."""
    before = memory("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    Checkpoint.open(directory)
    return memory("VmHWM") - before
