"""Checkpoints in the Hugging Face layout served by 2, 3 and 4 ranks in real processes: the tokens of
``transformers`` for both families, over shared memory and over torch, in a paged KV cache too small for every
request at once (requests preempted and computed again), the prompts served twice with prefix caching (prefix hits)
and without it; a bfloat16 checkpoint in several files;
a sampled run the same at every world size; and each rank's memory, its shard and not the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
pytest.importorskip("transformers", reason="the test-torch extra is not installed")

import torch

from metrale_model_engine.reference import LmConfig, Sampling, ShardedLm
from metrale_model_engine.reference.checkpoint import save_checkpoint
from metrale_model_engine.torch import run_group

from helpers import checkpoint_sessions as sessions
from helpers import oracle
from helpers.rank_results import load

pytestmark = pytest.mark.torch

RUN_LIMIT = 180.0
"""Seconds a group may run before its ranks are killed."""


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """One random checkpoint of each family, written by transformers, and transformers' greedy tokens for it."""
    root = tmp_path_factory.mktemp("checkpoints")
    found = {}
    for family in oracle.FAMILIES:
        directory = oracle.write_checkpoint(root / family, family)
        tokens, tops = oracle.reference_tokens(directory)
        gap = oracle.smallest_gap(tops)
        assert gap > 1e-4, gap  # no near tie: equal tokens are a fair test of the arithmetic
        found[family] = (directory, tokens)
    return found


def served(
    tmp_path: Path,
    directory: Path,
    world_size: int,
    transport: str,
    sampling: Sampling | None = None,
    *,
    prefix_caching: bool = True,
) -> object:
    """The tokens of the oracle's prompts served twice (``sessions.served_tokens``), preempted and, with
    ``prefix_caching``, with prefix hits (none without)."""
    out = tmp_path / f"{world_size}-{transport}-{prefix_caching}"
    out.mkdir()
    arguments = (str(directory), transport, str(out), sampling, prefix_caching)
    assert run_group(sessions.serve_prompts, world_size, *arguments, timeout=RUN_LIMIT) == [0] * world_size
    results = load(out, world_size)
    assert all(results[rank]["failed"] == 0 for rank in range(1, world_size))
    kind = {"shm": "ShmTransport", "torch": "TorchTransport"}[transport] if world_size > 1 else "SoloTransport"
    assert results[0]["transport"] == kind
    preemptions, hits = results[0]["preemptions"], results[0]["hit_tokens"]
    assert isinstance(preemptions, int) and preemptions > 0  # a cache too small for the prompts at once
    assert isinstance(hits, int) and (hits > 0 if prefix_caching else hits == 0)
    return results[0]["tokens"]


PAIRS = [
    ("mixtral", 2, "shm"),
    ("mixtral", 3, "torch"),
    ("mixtral", 4, "shm"),
    ("qwen3_moe", 2, "torch"),
    ("qwen3_moe", 3, "shm"),
    ("qwen3_moe", 4, "torch"),
]
"""Every family at every world size, and each of them, and each world size, over both transports: every pair of
values once (the transport carries bytes and shards nothing, so its twelve products add no other sharding)."""


@pytest.mark.parametrize(("family", "world_size", "transport"), PAIRS)
def test_the_ranks_give_the_tokens_of_transformers(
    written: dict[str, tuple[Path, list[list[int]]]], tmp_path: Path, family: str, world_size: int, transport: str
) -> None:
    """4 ranks hold one KV head each of the 2: each KV head replicated on the 2 ranks whose query heads read it.
    3 ranks split unevenly: Mixtral's 8 heads as 3 + 3 + 2 (the middle rank's straddle both KV heads: it holds
    both and pads its heads) and 4 experts as 2 + 1 + 1; Qwen3-MoE's 4 heads as 2 + 1 + 1 and 8 experts as 3 + 3 + 2.
    The paged cache is too small for the prompts at once, so requests are preempted and computed again."""
    directory, expected = written[family]
    assert served(tmp_path, directory, world_size, transport) == expected * 2


@pytest.mark.parametrize(("world_size", "transport"), [(2, "torch"), (4, "shm")])
def test_without_prefix_caching_the_ranks_give_the_tokens_of_transformers(
    written: dict[str, tuple[Path, list[list[int]]]], tmp_path: Path, world_size: int, transport: str
) -> None:
    """Every prompt computed whole, each time it comes (no prefix hit), across preemptions."""
    directory, expected = written["mixtral"]
    assert served(tmp_path, directory, world_size, transport, prefix_caching=False) == expected * 2


def test_a_bfloat16_checkpoint_in_several_files_serves_its_float32_tokens(tmp_path: Path) -> None:
    directory = oracle.write_checkpoint(tmp_path / "bf16", "qwen3_moe", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").exists()
    expected, _ = oracle.reference_tokens(directory, dtype=torch.float32)
    assert served(tmp_path, directory, 2, "torch") == expected * 2


def test_a_seed_gives_the_same_sampled_tokens_at_every_world_size(
    written: dict[str, tuple[Path, list[list[int]]]], tmp_path: Path
) -> None:
    directory, greedy = written["mixtral"]
    sampling = Sampling(temperature=1.5, top_k=40, top_p=0.95, seed=7)
    runs = {size: served(tmp_path, directory, size, "shm", sampling) for size in (1, 2, 4)}
    assert runs[1] == runs[2] == runs[4]
    assert runs[1] != greedy  # it did sample


def test_each_rank_holds_its_shard_not_the_checkpoint(tmp_path: Path) -> None:
    """Peak resident memory while loading, per rank: its shard, and the mapped pages of one layer's slices."""
    config = LmConfig(d_model=256, n_heads=4, n_experts=8, top_k=2, d_expert=2048, max_seq_len=64)
    model = ShardedLm(config, num_blocks=1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(generator=torch.Generator().manual_seed(0))
    save_checkpoint(tmp_path / "big", model)
    whole = (tmp_path / "big" / "model.safetensors").stat().st_size  # about 103 MB, 96% of it experts
    assert sessions.open_and_measure(str(tmp_path / "big")) < 8 * 2**20  # a launcher reads the headers alone
    out = tmp_path / "ranks"
    out.mkdir()
    assert run_group(sessions.load_and_measure, 4, str(tmp_path / "big"), str(out), timeout=RUN_LIMIT) == [0] * 4
    layer = whole // config.n_layers // 4  # one layer's slices of a rank (the experts dominate)
    for rank, result in load(out, 4).items():
        grew, shard = result["grew"], result["shard"]
        assert isinstance(grew, int) and isinstance(shard, int)
        assert shard < 0.27 * whole  # a quarter of the experts, the replicated rest small
        assert grew < shard + layer + 16 * 2**20 < 0.6 * whole, (rank, grew, shard, whole)
