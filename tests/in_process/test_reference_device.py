"""The reference model as a GPU wants it: no host sync and few launches per step, counted on the CPU
(``count_ops``); on CUDA itself (skipped without one): no sync under ``set_sync_debug_mode("error")``,
and CUDA graphs that give the eager logits.

The counts are the issue's gate where no GPU is at hand: every op that is not a view
is at least one kernel launch on CUDA, and every op in ``WAITING_OPS`` (or a boolean
index, or a copy to the host) makes the host wait for the device.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine import EpLink
from metrale_model_engine.reference import (
    Checkpoint,
    DecodeGraphs,
    LmConfig,
    LmState,
    OpCount,
    ReferenceLm,
    ShardedLm,
    count_ops,
)
from metrale_model_engine.transport import SoloTransport

from helpers.greedy import shipped_model, table

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]

MAX_LAUNCHES = 91
"""The bound on the ops that are not views in one float32 ``decode`` of the shipped model with the experts run
on the device: 218 before the decode was made for a GPU, 76 after; with grouped-query attention and the span
read of the cache 80 at batch 4 and 16, and 86 at batch 1, where the picked experts' weights are gathered; 3 more
with the paged cache, once a step whatever the layers: the block tables turned into cache rows (a multiply and an
add) and each row's own position picked from them (a gather).  Each layer writes and reads its cache with one op
each, as before (``index_copy_`` and ``index_select`` where the per-slot cache had ``index_put_`` and ``index``)."""
CUDA = torch.cuda.is_available()


def model_on(shipped: Checkpoint, device: str = "cpu", dtype: torch.dtype = torch.float32) -> ShardedLm:
    """The shipped model with its experts run as on a GPU (``"device"``: nothing read back), on ``device``."""
    return shipped_model(shipped, 16, dtype=dtype, device=device, routing="device")


def decode_inputs(batch: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of ``batch`` rows, each in a sequence of its own (its blocks interleaved with the others')."""
    slots = torch.arange(batch, device=device).flip(0)
    tables = torch.arange(16, device=device)[None, :] * 16 + slots[:, None]
    return tables, (slots * 7 + 3) % 256, slots + 5


def test_the_counter_sorts_views_launches_and_waits() -> None:
    x = torch.arange(6.0).view(2, 3)

    def work() -> torch.Tensor:
        y = x.t() * 2  # a view, a launch
        y.nonzero()
        torch.unique(x)
        bool(x.sum() > 0)
        return x[x > 1]

    result, count = count_ops(work)
    assert torch.equal(result, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert count.views["t"] == 1 and count.views.get("view", 0) == 0
    assert count.launches["mul"] == 1
    assert count.waits == {"nonzero": 1, "_unique2": 1, "_local_scalar_dense": 1, "index": 1}
    assert count.waited == 4 and count.launched == sum(count.launches.values()) >= 7
    assert count_ops(lambda: None)[1] == OpCount()


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_never_waits_for_the_device_and_launches_few_ops(
    shipped: Checkpoint, batch: int, dtype: torch.dtype
) -> None:
    model, inputs = model_on(shipped, dtype=dtype), decode_inputs(batch)
    logits, count = count_ops(lambda: model.decode(*inputs))
    assert logits.shape == (batch, 256)
    assert count.waits == {}
    if dtype == torch.float32:  # bfloat16 adds a conversion to float32 and back around each norm and rotation
        assert count.launched <= MAX_LAUNCHES, count.launches
    layers = shipped.config.n_layers
    if batch * 2 < 4:  # gathered: qkv, wo, router; the picked experts' in, out and weighted sum
        assert (count.launches["mm"], count.launches["bmm"]) == (1 + 3 * layers, 3 * layers)
    else:  # dense: qkv, wo, router, every expert's out stacked; every expert's in, batched by expert; the LM head
        assert (count.launches["mm"], count.launches["bmm"]) == (1 + 4 * layers, layers)


@pytest.mark.parametrize("batch", [1, 16])
def test_an_uneven_shard_decodes_with_no_op_more_than_one_rank(batch: int) -> None:
    """8 heads of 2 KV heads and 4 experts over 3 ranks (heads 3 + 3 + 2, experts 2 + 1 + 1): the middle rank's
    heads, padded to whole groups, keep the step's ops (it launches what the last rank, unpadded, does), and no
    rank waits or launches an op more than one rank does (one expert a rank saves a copy; at batch 1 one rank
    gathers its picked experts, a rank of 3 holding 1 or 2 runs them densely)."""
    config = LmConfig(d_model=64, n_heads=8, n_kv_heads=2, head_dim=16, n_experts=4, d_expert=32, max_seq_len=32)
    inputs = decode_inputs(batch)
    counts = []
    for rank, world_size in [(0, 1), (0, 3), (1, 3), (2, 3)]:
        model = ShardedLm(config, num_blocks=256, rank=rank, world_size=world_size, all_reduce=lambda tensor: None,
                          expert_routing="device")  # fmt: skip
        _, count = count_ops(lambda: model.decode(*inputs))  # noqa: B023  (called at once)
        assert count.waits == {} and count.launched <= MAX_LAUNCHES
        counts.append(count.launches)
    assert config.shard(1, 3).pad_before == 1 and config.shard(2, 3).pad_before == 0
    assert counts[2] == counts[3]
    if batch == 16:
        for launches in counts[1:]:
            assert all(launched <= counts[0][op] for op, launched in launches.items()), (launches, counts[0])


def test_a_prefill_chunk_and_the_training_path_never_wait(shipped: Checkpoint) -> None:
    model = model_on(shipped)
    model.prefill(table(model, 3), torch.arange(10), 0)
    _, count = count_ops(lambda: model.prefill(table(model, 3), torch.arange(20, 60), 10))
    assert count.waits == {}
    _, count = count_ops(lambda: model(torch.arange(64).view(2, 32)))
    assert count.waits == {}


def test_the_step_runs_on_the_meta_device_where_no_value_can_be_read() -> None:
    model = ShardedLm(LmConfig(), num_blocks=256, device=torch.device("meta"))
    logits = model.decode(*decode_inputs(3, "meta"))
    assert logits.shape == (3, 256) and logits.device.type == "meta"
    meta_table = torch.arange(4, device="meta")
    assert model.prefill(meta_table, torch.zeros(5, dtype=torch.int64, device="meta"), 3).shape == (256,)


def test_device_index_tensors_are_trusted_host_ones_checked() -> None:
    model = ShardedLm(LmConfig(), num_blocks=4, device=torch.device("meta"))
    bad, tables = torch.tensor([0, 9]), torch.tensor([[0], [9]])
    with pytest.raises(ValueError, match=r"tables.flatten\(\)\[1\]=9 is out of range \(0 \.\.= 3\)"):
        model.decode(tables, bad, bad)
    model.decode(tables.to("meta"), bad.to("meta"), bad.to("meta"))  # not read: it would wait for the device


def test_the_served_decode_never_waits(shipped: Checkpoint) -> None:
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=16), expert_routing="device")
    slots: list[LmState | None] = [None] * 16
    for seq_id in range(8):
        model.alloc(slots, seq_id)
        model.prefill(slots, seq_id, [65 + seq_id] * 3, 0, 3)
    _, count = count_ops(lambda: model.decode(slots, list(range(8)), [70] * 8))
    assert count.waits == {} and count.launched <= MAX_LAUNCHES


def test_the_state_dict_is_the_parameters_under_their_own_names(shipped: Checkpoint) -> None:
    model = model_on(shipped)
    state = model.state_dict()
    assert list(state) == [name for name, _ in model.named_parameters()]  # caches and tables are not persistent
    assert [name for name in state if name.startswith("layers.0.")] == [
        f"layers.0.{name}" for name in ("attn_norm", "moe_norm", "attn.wqkv", "attn.wo", "moe.router", "moe.w_in",
                                        "moe.w_out")
    ]  # fmt: skip
    again = ShardedLm(shipped.config, num_blocks=1)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"layers\.0\.attn\.wqkv\""):
        again.load_state_dict({name: t for name, t in state.items() if name != "layers.0.attn.wqkv"})


def test_the_model_pickles(shipped: Checkpoint) -> None:
    model = model_on(shipped)
    copy = pickle.loads(pickle.dumps(model))
    inputs = decode_inputs(4)
    assert torch.equal(copy.decode(*inputs), model.decode(*inputs))


def test_graphs_refuse_a_model_off_cuda_or_of_several_ranks(shipped: Checkpoint) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, it is on cpu"):
        DecodeGraphs(model_on(shipped))
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        ReferenceLm(EpLink(SoloTransport(), num_slots=2), cuda_graphs=True)
    sharded = ShardedLm(shipped.config, num_blocks=2, rank=1, world_size=2, all_reduce=lambda tensor: None)
    with pytest.raises(ValueError, match=r"CUDA graphs are for one rank, this model is rank 1 of 2: a replayed"):
        DecodeGraphs(sharded)


# On CUDA itself


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Make any operation that synchronizes the host with the device raise."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 16])
def test_on_cuda_decode_and_prefill_never_sync(shipped: Checkpoint, batch: int) -> None:
    on_cuda, on_cpu = model_on(shipped, "cuda"), model_on(shipped)  # loading copies and waits: outside the check
    prompt, inputs = torch.arange(30), decode_inputs(batch)
    on_cuda_inputs = tuple(tensor.cuda() for tensor in inputs)
    first, second = table(on_cuda, 0), table(on_cuda, 1)
    on_cuda_first = first.cuda()
    torch.cuda.synchronize()
    with no_sync():
        on_cuda.prefill(on_cuda_first, prompt.cuda(non_blocking=True), 0)
        logits = on_cuda.decode(*on_cuda_inputs)
        on_cuda.prefill(second, prompt, 0)  # host tensors: checked on the host, copied without a wait
        on_cuda.decode(*inputs)
    on_cpu.prefill(first, prompt, 0)
    torch.testing.assert_close(logits.cpu(), on_cpu.decode(*inputs), atol=1e-3, rtol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_on_cuda_the_graphed_steps_give_the_eager_logits(shipped: Checkpoint) -> None:
    eager, graphed = model_on(shipped, "cuda"), model_on(shipped, "cuda")
    graphs = DecodeGraphs(graphed)
    for model in (eager, graphed):
        for slot in range(6):
            model.prefill(table(model, slot).cuda(), torch.arange(10 + slot, device="cuda"), 0)
    lengths = [10 + slot for slot in range(6)]
    for step in range(6):
        batch = [0, 2, 4] if step % 2 else [0, 1, 2, 3, 4, 5]
        tokens = [(step * 31 + slot) % 256 for slot in batch]
        rows = [
            [token, lengths[slot], *table(eager, slot)[:2].tolist()] for slot, token in zip(batch, tokens, strict=True)
        ]
        inputs = torch.tensor(rows, device="cuda")  # each row: its token, its position, its table's first 2 blocks
        expected = eager.decode_step(inputs[:, 2:], inputs[:, 0], inputs[:, 1], span=32)  # every position < 32
        torch.testing.assert_close(graphs(inputs, 32), expected, atol=1e-5, rtol=0)
        for slot in batch:
            lengths[slot] += 1
    assert graphs.shapes == [(3, 32), (6, 32)]
    caches = [model.layers[0].attn.kv_cache for model in (graphed, eager)]  # type: ignore[union-attr]
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=0)
