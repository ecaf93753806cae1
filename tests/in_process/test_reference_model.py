"""The reference model: its config and argument checks; the cached, batched and sharded paths against the
training path; the three ways to run the experts; deterministic training; the shipped model's greedy text.

Tolerances, float32 on the CPU (what the shipped model runs in; logits span about -13 .. 19):

* cached (prefill in chunks, then decode) against ``forward`` on the whole sequence:
  ``atol=1e-4`` (measured: 1.8e-5); the same in float64: ``atol=1e-10`` (measured: 2e-14);
* one decode row alone against the same row in a batch: ``atol=1e-4`` (measured: 5e-6);
* 2 and 4 ranks over gloo against one rank: ``atol=1e-4`` (measured: 6e-6), and every
  rank of a run returns bit-identical logits (the all-reduce hands every rank the same sums);
  the same for 3 ranks in threads of this process (measured: 6.7e-6, the shipped model);
* greedy tokens are compared exactly.  The smallest gap between the two largest
  logits at any greedy step here is 1.9 (asserted above 1e-2), so rounding cannot
  flip a token: float32 suffices and no test needs float64.

The checkpoint itself (its files, its refusals, ``transformers`` as the oracle) is
tested in ``test_checkpoint.py``.
"""

from __future__ import annotations

import importlib.util
import string
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine.reference import Checkpoint, ExpertRouting, LmConfig, ShardedLm, count_ops, decode_span
from metrale_model_engine.reference.checkpoint import MIXTRAL, export_state, load_state
from metrale_model_engine.reference.network.layers import span_groups

from helpers.greedy import LOGIT_TOLERANCE, Greedy, byte_ids, greedy_session, ints, shipped_model, table, tables
from helpers.threaded import ThreadGroup

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
DECODE_TEXTS = ("Licensed under the", "Permission is hereby granted", "THE SOFTWARE IS")


# Config and arguments


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"d_model": True}, TypeError, "LmConfig.d_model must be an int, got bool True"),
        ({"n_layers": 0}, ValueError, "LmConfig.n_layers must be at least 1, got 0"),
        ({"n_heads": 3}, ValueError, "LmConfig.n_heads=3 must divide d_model=128"),
        ({"n_heads": 128}, ValueError, "the head width 1 must be even"),
        ({"head_dim": 7, "n_heads": 3}, ValueError, "the head width 7 must be even"),
        ({"head_dim": -1}, ValueError, "LmConfig.head_dim must be at least 0, got -1"),
        ({"n_kv_heads": 3}, ValueError, "LmConfig.n_kv_heads=3 must divide n_heads=4"),
        ({"top_k": 5}, ValueError, "LmConfig.top_k=5 must not exceed n_experts=4"),
        ({"rope_base": "1e4"}, TypeError, "LmConfig.rope_base must be a float, got str '1e4'"),
        ({"norm_eps": float("nan")}, ValueError, "LmConfig.norm_eps must be positive and finite, got nan"),
        ({"qk_norm": 1}, TypeError, "LmConfig.qk_norm must be a bool, got int 1"),
    ],
)
def test_config_fields_are_checked(fields: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        LmConfig(**fields)  # type: ignore[arg-type]


def test_derived_fields_are_filled_in() -> None:
    config = LmConfig()
    assert (config.head_dim, config.n_kv_heads) == (32, 4)
    wide = LmConfig(d_model=64, n_heads=4, head_dim=32, n_kv_heads=2)  # Qwen3's: heads wider than d_model / n_heads
    assert (wide.head_dim, wide.n_kv_heads) == (32, 2)


def test_any_world_size_up_to_the_query_heads_splits_a_model() -> None:
    assert LmConfig().world_sizes() == [1, 2, 3, 4]
    assert LmConfig(n_heads=8, n_kv_heads=2, n_experts=4).world_sizes() == list(range(1, 9))


def test_a_world_of_more_ranks_than_kv_heads_replicates_each_kv_head() -> None:
    config = LmConfig(n_heads=8, n_kv_heads=2, n_experts=8)
    shards = [config.shard(rank, 4) for rank in range(4)]
    assert [(s.first_head, s.heads) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.first_kv_head, s.kv_heads) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [(s.first_expert, s.experts) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.first_kv_head, s.kv_heads) for s in (config.shard(rank, 2) for rank in range(2))] == [(0, 1), (1, 1)]
    assert config.kv_cache_bytes(1, 4, 4) == config.kv_cache_bytes(1, 2, 4)  # one KV head a rank either way
    assert all(s.pad_before == s.pad_after == 0 and s.padded_heads == s.heads for s in shards)


def test_an_uneven_world_splits_heads_and_experts_as_evenly_as_it_can() -> None:
    """8 heads of 2 KV heads and 8 experts over 3 ranks: 3 + 3 + 2 of each; the middle rank's heads 3-5 read both
    KV heads (one of them, then two), so it holds both, and computes one zero head before its own."""
    config = LmConfig(n_heads=8, n_kv_heads=2, n_experts=8)
    shards = [config.shard(rank, 3) for rank in range(3)]
    assert [(s.first_head, s.heads) for s in shards] == [(0, 3), (3, 3), (6, 2)]
    assert [(s.first_kv_head, s.kv_heads) for s in shards] == [(0, 1), (0, 2), (1, 1)]
    assert [(s.first_expert, s.experts) for s in shards] == [(0, 3), (3, 3), (6, 2)]
    assert [(s.pad_before, s.pad_after, s.padded_heads) for s in shards] == [(0, 0, 3), (1, 0, 4), (0, 0, 2)]
    one_kv_head = 2 * config.n_layers * config.max_seq_len * config.head_dim * 4  # keys and values, float32
    assert [config.kv_cache_bytes(1, 3, 4, rank=rank) for rank in range(3)] == [
        one_kv_head,
        2 * one_kv_head,
        one_kv_head,
    ]
    mixtral = LmConfig(d_model=128, n_heads=32, n_kv_heads=8, n_experts=8)  # Mixtral-8x7B's heads over 3
    assert [tuple(mixtral.shard(rank, 3)) for rank in range(3)] == [
        (0, 11, 0, 3, 0, 3, 0, 1), (11, 11, 2, 4, 3, 3, 3, 2), (22, 10, 5, 3, 6, 2, 2, 0)
    ]  # fmt: skip
    few = [LmConfig(n_experts=2).shard(rank, 4) for rank in range(4)]  # more ranks than experts: some hold none
    assert [(s.first_expert, s.experts) for s in few] == [(0, 1), (1, 1), (2, 0), (2, 0)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (8, 8), (12, 3), (32, 8), (32, 4), (6, 1)])
def test_every_world_size_shards_every_head_once_with_the_kv_heads_it_reads(heads: int, kv_heads: int) -> None:
    config = LmConfig(d_model=4 * heads, n_heads=heads, n_kv_heads=kv_heads, n_experts=5)
    group = heads // kv_heads
    for world_size in config.world_sizes():
        shards = [config.shard(rank, world_size) for rank in range(world_size)]
        assert [h for s in shards for h in range(s.first_head, s.first_head + s.heads)] == list(range(heads))
        assert [e for s in shards for e in range(s.first_expert, s.first_expert + s.experts)] == list(range(5))
        assert max(s.heads for s in shards) - min(s.heads for s in shards) <= 1
        for s in shards:
            per_kv_head, rest = divmod(s.padded_heads, s.kv_heads)
            assert not rest  # every KV head serves as many query heads, as the attention kernels want
            read = [(s.first_head + i) // group for i in range(s.heads)]  # the KV head each query head reads
            assert read == [s.first_kv_head + (s.pad_before + i) // per_kv_head for i in range(s.heads)]
            assert (read[0], read[-1]) == (s.first_kv_head, s.first_kv_head + s.kv_heads - 1)
            assert per_kv_head <= max(group, s.heads)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 5, "all_reduce": print}, r"world_size=5 cannot split the model: each rank holds one of its "
         r"n_heads=4 query heads at least \(world sizes that can: 1 \.\.= 4\)"),
        ({"world_size": 0}, "world_size must be at least 1, got 0"),
        ({"world_size": 2}, r"all_reduce is required when world_size=2 > 1"),
        ({"rank": 2, "world_size": 2, "all_reduce": print}, r"rank=2 is out of range for world_size=2 \(0 \.\.= 1\)"),
        ({"num_blocks": 0}, "num_blocks must be at least 1, got 0"),
        ({"block_size": 0}, "block_size must be at least 1, got 0"),
        ({"expert_routing": "gpu"}, "expert routing must be one of auto, host, device, got 'gpu'"),
    ],
)  # fmt: skip
def test_model_arguments_are_checked(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"num_blocks": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        ShardedLm(LmConfig(), **arguments)  # type: ignore[arg-type]


def test_call_arguments_are_checked(shipped: Checkpoint) -> None:
    model = shipped_model(shipped, num_slots=2)  # 32 blocks of 16
    with pytest.raises(ValueError, match=r"table\[3\]=32 is out of range \(0 \.\.= 31\)"):
        model.prefill(ints([0, 1, 2, 32]), ints([1]), 0)
    with pytest.raises(ValueError, match=r"a table names each block once, got \[0, 1, 0\]"):
        model.prefill(ints([0, 1, 0]), ints([1]), 0)
    with pytest.raises(
        ValueError, match=r"the table's 2 block\(s\) of 16 hold 32 positions, fewer than the chunk's end 33"
    ):
        model.prefill(ints([0, 1]), ints([1] * 3), 30)
    with pytest.raises(TypeError, match=r"table must be a 1-D int64 tensor, got int 0"):
        model.prefill(0, ints([1]), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"start=250 \+ 10 tokens = 260 passes max_seq_len=256"):
        model.prefill(table(model, 0), ints([1] * 10), 250)
    with pytest.raises(TypeError, match=r"tokens must be a 1-D int64 tensor, got a torch.int32 tensor"):
        model.prefill(table(model, 0), torch.ones(3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"tokens\[1\]=256 is out of range \(0 \.\.= 255\)"):
        model.prefill(table(model, 0), ints([1, 256]), 0)
    with pytest.raises(ValueError, match=r"positions\[1\]=256 is out of range \(0 \.\.= 255\)"):
        model.decode(tables(model, [0, 1]), ints([1, 2]), ints([3, 256]))
    with pytest.raises(ValueError, match=r"positions\[0\]=16 is out of range \(0 \.\.= 15\)"):
        model.decode(ints([0])[None], ints([1]), ints([16]))  # one block holds 16 positions
    with pytest.raises(ValueError, match=r"tables.flatten\(\)\[0\]=-1 is out of range"):
        model.decode(ints([-1])[None], ints([1]), ints([3]))
    with pytest.raises(ValueError, match=r"two rows write one cache row: \[19, 19\]"):
        model.decode(tables(model, [1, 1]), ints([1, 2]), ints([3, 3]))
    with pytest.raises(TypeError, match=r"tables must be a 2-D int64 tensor, got a torch.int64 tensor of shape \(2,\)"):
        model.decode(ints([0, 1]), ints([1, 2]), ints([3, 4]))
    with pytest.raises(ValueError, match="must have one length, got 2, 1 and 2"):
        model.decode(tables(model, [0, 1]), ints([1]), ints([3, 4]))
    with pytest.raises(ValueError, match="tokens has 257 positions, more than max_seq_len=256"):
        model(torch.zeros(1, 257, dtype=torch.int64))


def test_shards_are_the_slices_of_the_whole_model(shipped: Checkpoint) -> None:
    """Every rank's parameters, joined along the dimension the rule splits, are the one-rank model's."""
    whole = dict(shipped_model(shipped).named_parameters())
    shards = [dict(shipped_model(shipped, rank=rank, world_size=4, all_reduce=print).named_parameters())
              for rank in range(4)]  # fmt: skip
    width = shipped.config.head_dim  # one query head and one KV head a rank: [q | k | v] rows of one head each
    for rank, shard in enumerate(shards):
        q, k = shard["layers.1.attn.wqkv"][:width], shard["layers.1.attn.wqkv"][width : 2 * width]
        assert torch.equal(q, whole["layers.1.attn.wqkv"][rank * width : (rank + 1) * width])
        keys = whole["layers.1.attn.wqkv"][4 * width : 8 * width]
        assert torch.equal(k, keys[rank * width : (rank + 1) * width])
        assert torch.equal(shard["layers.1.moe.router"], whole["layers.1.moe.router"])
    for name, dim in {"layers.1.attn.wo": 1, "layers.1.moe.w_in": 0, "layers.1.moe.w_out": 0}.items():
        assert torch.equal(torch.cat([shard[name] for shard in shards], dim=dim), whole[name])


def test_three_ranks_equal_one_rank(shipped: Checkpoint, greedy_one_rank: Greedy) -> None:
    """The shipped model's 4 heads, 4 KV heads and 4 experts over 3 ranks (2 + 1 + 1 of each), in threads."""
    group = ThreadGroup(3)
    results = group.run(
        lambda rank: greedy_session(
            shipped_model(shipped, 3, rank=rank, world_size=3, all_reduce=group.all_reduce(rank))
        )
    )
    assert results[1] == results[0] == results[2]  # bit for bit: every rank gets the same sums
    expected = torch.tensor(greedy_one_rank["logits"])
    torch.testing.assert_close(torch.tensor(results[0]["logits"]), expected, atol=LOGIT_TOLERANCE, rtol=0)
    assert results[0]["tokens"] == greedy_one_rank["tokens"]


def _blocks(config: LmConfig) -> int:
    """The blocks of 16 (``ShardedLm``'s default) one sequence of ``config.max_seq_len`` positions takes."""
    return -(-config.max_seq_len // 16)


def _random_model(config: LmConfig, seed: int = 0, sequences: int = 2) -> ShardedLm:
    model = ShardedLm(config, num_blocks=sequences * _blocks(config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2 + (parameter == 1).float())
    return model


@pytest.mark.parametrize(("world_size", "routing"), [(3, "host"), (5, "host"), (5, "device")])
def test_padded_shards_equal_one_rank(world_size: int, routing: ExpertRouting) -> None:
    """8 heads of 2 KV heads (with Qwen3's query and key norms) and 4 experts over 3 and 5 ranks: ranks whose heads
    straddle two KV heads pad them with zero heads, ranks past the experts hold none (their experts run on the host
    or as on a device); the logits of the training path, a prefill and a decode step are one rank's."""
    config = LmConfig(d_model=64, n_heads=8, n_kv_heads=2, head_dim=16, n_experts=4, d_expert=32, qk_norm=True)
    shards = [config.shard(rank, world_size) for rank in range(world_size)]
    if world_size == 3:
        assert shards[1].pad_before == 1
    else:
        assert shards[4].experts == 0
    whole = _random_model(config)
    tokens = torch.arange(3, 27).view(2, 12)

    def logits(model: ShardedLm) -> list[torch.Tensor]:
        model.prefill(table(model, 1), tokens[1, :7], 0)
        rows = [model(tokens), model.prefill(table(model, 0), tokens[0], 0)]
        return [*rows, model.decode(tables(model, [0, 1]), ints([5, 9]), ints([12, 7]))]

    expected = logits(whole)
    state = export_state(whole, MIXTRAL)
    group = ThreadGroup(world_size)

    def rank_logits(rank: int) -> list[torch.Tensor]:
        model = ShardedLm(config, num_blocks=2 * _blocks(config), rank=rank, world_size=world_size,
                          all_reduce=group.all_reduce(rank), expert_routing=routing)  # fmt: skip
        load_state(model, MIXTRAL, state)
        return logits(model)

    results = group.run(rank_logits)
    for got in results:
        for ours, theirs in zip(got, results[0], strict=True):
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(ours, theirs, atol=LOGIT_TOLERANCE, rtol=0)


def test_a_one_rank_model_exports_what_it_loaded(shipped: Checkpoint) -> None:
    model = shipped_model(shipped)
    exported = export_state(model, MIXTRAL)
    again = ShardedLm(shipped.config, num_blocks=1)
    load_state(again, MIXTRAL, exported)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in exported
    with pytest.raises(ValueError, match=r"the state has no tensor 'lm_head\.weight'"):
        load_state(again, MIXTRAL, {k: v for k, v in exported.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has shape \(3,\), not \(128,\)"):
        load_state(again, MIXTRAL, {**exported, "model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="only a one-rank model holds every weight; this is rank 1 of 2"):
        export_state(shipped_model(shipped, rank=1, world_size=2, all_reduce=print), MIXTRAL)


# The cached and batched paths against the training path


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, LOGIT_TOLERANCE), (torch.float64, 1e-10)])
def test_prefill_in_chunks_then_decode_equals_forward(shipped: Checkpoint, dtype: torch.dtype, atol: float) -> None:
    model = shipped_model(shipped, dtype=dtype)
    text = byte_ids((ROOT / "LICENSE-MIT").read_text()[:300])
    model.prefill(table(model, 1), ints(text[100:300]), 0)  # stale entries in its blocks, which the sequence below must
    # not see
    sequence = ints(text[:120])
    expected = model(sequence[None])[0]
    got = {
        4: model.prefill(table(model, 1), sequence[:5], 0),
        39: model.prefill(table(model, 1), sequence[5:40], 5),
        40: model.prefill(table(model, 1), sequence[40:41], 40),
    }
    for position in range(41, 120):
        got[position] = model.decode(tables(model, [1]), sequence[position : position + 1], ints([position]))[0]
    for position, logits in got.items():
        assert logits.dtype == dtype
        torch.testing.assert_close(logits, expected[position], atol=atol, rtol=0)


def test_a_decode_attends_over_its_span_alone_as_over_the_whole_cache(shipped: Checkpoint) -> None:
    """Positions past every row's own are masked either way: the span only saves the reading."""
    assert [decode_span(n, 256) for n in (1, 16, 17, 100, 129, 256)] == [16, 16, 32, 128, 256, 256]
    model = shipped_model(shipped)
    text = byte_ids((ROOT / "LICENSE-MIT").read_text()[:40])
    for slot in range(3):
        model.prefill(table(model, slot), ints(text[slot : slot + 20]), 0)
    held, tokens, positions = tables(model, [2, 0, 1]), ints([65, 66, 67]), ints([20, 20, 20])
    spanned = model.decode_step(held, tokens, positions, span=32)
    whole = model.decode_step(held, tokens, positions)  # writes position 20 of each sequence again, the same values
    torch.testing.assert_close(spanned, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_the_experts_run_the_same_sums_every_way(shipped: Checkpoint, batch: int) -> None:
    """On the host by expert, gathered by token, or densely: equal to rounding, at one rank, two and three (2 + 1 + 1
    experts)."""
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, shipped.config.d_model, generator=generator)
    for world_size in (1, 2, 3):
        outputs = []
        for routing in ("host", "device"):  # device: gathered when batch * top_k < experts, else dense
            models = [shipped_model(shipped, rank=rank, world_size=world_size, all_reduce=print, routing=routing)
                      for rank in range(world_size)]  # fmt: skip
            moes = [next(model.blocks()).moe for model in models]
            outputs.append(sum(moe(x) for moe in moes))
        torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    local = next(shipped_model(shipped, routing="device").blocks()).moe
    experts, weights = local.route(x)
    assert experts.shape == weights.shape == (batch, 2)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(batch))  # Mixtral renormalises the top k


def test_every_call_makes_two_all_reduces_per_layer(shipped: Checkpoint) -> None:
    calls: list[tuple[int, ...]] = []
    config = shipped.config
    model = shipped_model(shipped, 2, all_reduce=lambda tensor: calls.append(tuple(tensor.shape)))
    model(torch.zeros(2, 3, dtype=torch.int64))
    model.prefill(table(model, 0), ints([1, 2, 3]), 0)
    model.decode(tables(model, [0, 1]), ints([4, 5]), ints([3, 0]))
    per_call = 2 * config.n_layers
    d = config.d_model
    assert calls == [(2, 3, d)] * per_call + [(3, d)] * per_call + [(2, d)] * per_call  # tokens, flattened


def test_a_fused_step_attends_in_groups_of_like_lengths_as_the_training_path() -> None:
    """Decode rows of five sequences whose blocks are scattered over the pool, at positions far apart and out of
    order, with a prefill chunk, in one fused step of a grouped-query model (8 heads of 2 KV heads): the rows attend
    longest first in groups, each over its own span, and every row's logits are the training path's on its sequence,
    in the caller's order."""
    assert span_groups([300, 290, 40, 30], 16, 512) == [(0, 2, 304), (2, 4, 48)]
    assert span_groups([73, 70, 43, 13, 7], 16, 100) == [(0, 5, 80)]  # splitting would spare 37 * 3 positions
    assert span_groups([100, 99], 16, 100) == [(0, 2, 100)] and span_groups([], 16, 100) == []
    config = LmConfig(d_model=64, n_heads=8, n_kv_heads=2, head_dim=16, n_experts=4, d_expert=32, max_seq_len=256)
    model = _random_model(config, sequences=6)
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randperm(model.num_blocks, generator=generator).view(6, _blocks(config))
    lengths = [7, 43, 13, 200, 180]
    assert span_groups(sorted(lengths, reverse=True), 16, 256) == [(0, 2, 208), (2, 5, 48)]
    sequences = [torch.randint(config.vocab_size, (length,), generator=generator) for length in lengths]
    for held in blocks:  # stale entries past every row's position, which no row may see
        model.prefill(held, torch.randint(config.vocab_size, (230,), generator=generator), 0)
    for held, sequence in zip(blocks, sequences, strict=False):
        model.prefill(held, sequence[:-1], 0)
    chunk = torch.randint(config.vocab_size, (9,), generator=generator)
    rows = [(held.tolist(), int(sequence[-1]), len(sequence) - 1)
            for held, sequence in zip(blocks, sequences, strict=False)]  # fmt: skip
    logits = model.fused_step([(blocks[5].tolist(), 0, chunk.tolist())], rows)
    for row, sequence in enumerate([*sequences, chunk]):
        expected = model(sequence[None])[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=LOGIT_TOLERANCE, rtol=0)


def _prefill_prompts(model: ShardedLm, slots: list[int]) -> list[torch.Tensor]:
    return [
        model.prefill(table(model, slot), ints(byte_ids(text)), 0)
        for slot, text in zip(slots, DECODE_TEXTS, strict=True)
    ]


def test_batched_decode_rows_are_independent(shipped: Checkpoint) -> None:
    alone, batched = shipped_model(shipped), shipped_model(shipped)
    slots = [3, 0, 2]
    last = _prefill_prompts(alone, slots)
    assert all(torch.equal(a, b) for a, b in zip(last, _prefill_prompts(batched, slots), strict=True))
    positions = [len(byte_ids(text)) for text in DECODE_TEXTS]
    tokens = [int(logits.argmax()) for logits in last]
    for step in range(8):
        order = [0, 1, 2] if step % 2 else [2, 0, 1]  # the batch's order must not matter either
        together = batched.decode(
            tables(batched, [slots[i] for i in order]), ints([tokens[i] for i in order]),
            ints([positions[i] for i in order]),
        )  # fmt: skip
        for row, i in enumerate(order):
            single = alone.decode(tables(alone, [slots[i]]), ints([tokens[i]]), ints([positions[i]]))[0]
            torch.testing.assert_close(together[row], single, atol=LOGIT_TOLERANCE, rtol=0)
            assert int(together[row].argmax()) == int(single.argmax())
            tokens[i] = int(single.argmax())
            positions[i] += 1


# The shipped model's greedy text


def test_greedy_text_is_license_english(greedy_one_rank: Greedy) -> None:
    logits = torch.tensor(greedy_one_rank["logits"])
    top_two = logits.topk(2, dim=-1).values
    gap = float((top_two[:, 0] - top_two[:, 1]).min())
    assert gap > 100 * LOGIT_TOLERANCE  # no near-ties: greedy tokens are robust
    first, second = (bytes(tokens).decode() for tokens in greedy_one_rank["tokens"])  # type: ignore[arg-type]
    assert set(first + second) <= set(string.printable)
    assert first.startswith(" Apache License"), first


# Training


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    """``scripts/train_reference.py``, imported (registered while in use: its dataclasses need that)."""
    name = "train_reference"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "train_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def test_training_is_deterministic(script: ModuleType) -> None:
    settings = script.TrainSettings(steps=3, batch_size=2, seq_len=32, warmup_steps=2, log_every=1)
    corpus = script.read_corpus()
    runs = [script.train(LmConfig(), corpus, settings, log=lambda line: None) for _ in range(2)]
    (first, first_losses), (second, second_losses) = runs
    assert first_losses == second_losses and len(first_losses) == 3
    pairs = zip(first.state_dict().items(), second.state_dict().items(), strict=True)
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in pairs)
    start = ShardedLm(LmConfig(), num_blocks=1)
    script.init_weights(start, torch.Generator().manual_seed(settings.seed))
    assert first.lm_head is not None and start.lm_head is not None
    assert not torch.equal(first.lm_head, start.lm_head)  # it did train


def test_training_writes_a_checkpoint_that_loads(script: ModuleType, tmp_path: Path) -> None:
    assert script.main(["--steps", "2", "--out", str(tmp_path / "model")]) == 0
    written = Checkpoint.open(tmp_path / "model")
    assert written.config == LmConfig() and written.dtype == torch.float32 and written.tokenizer_file is not None
    model = shipped_model(written)
    assert all(torch.equal(p, p.bfloat16().float()) for p in model.parameters())  # rounded to bfloat16, stored float32


def test_the_shipped_weights_learned_the_licenses(script: ModuleType, shipped: Checkpoint) -> None:
    mit = ints(byte_ids((ROOT / "LICENSE-MIT").read_text()))
    assert script.corpus_loss(shipped_model(shipped), mit, 128) < 1.0


def test_a_batch_1_step_on_the_cpu_reads_only_the_picked_experts(shipped: Checkpoint) -> None:
    """Counted: per layer the query/key/value and output products, the router, and two products for each of the
    ``top_k`` experts picked (of 4); then the LM head.  Running every expert would make 3 + 2 * 4 a layer."""
    model = shipped_model(shipped)
    model.prefill(table(model, 0), ints(byte_ids("Licensed under")), 0)
    _, count = count_ops(lambda: model.decode(tables(model, [0]), ints([32]), ints([14])))
    config = shipped.config
    assert count.launches["mm"] == 1 + (3 + 2 * config.top_k) * config.n_layers
