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
from metrale_model_engine.reference import DecodeGraphs, LmConfig, LmState, ReferenceLm, ShardedLm
from metrale_model_engine.reference.layers import ShardedBlock
from metrale_model_engine.torch import OpCount, count_ops
from metrale_model_engine.transport import SoloTransport

pytestmark = pytest.mark.torch

MAX_LAUNCHES = 80
"""The issue's bound on the ops that are not views in one ``decode`` (218 before it, 76 after)."""
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def model_on(
    shipped: tuple[LmConfig, dict[str, torch.Tensor]], device: str = "cpu", dtype: torch.dtype = torch.float32
) -> ShardedLm:
    config, full = shipped
    model = ShardedLm(config, num_slots=16, dtype=dtype, device=torch.device(device))
    model.load_full_state(full)
    return model


def decode_inputs(batch: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = torch.arange(batch, device=device).flip(0)
    return slots, (slots * 7 + 3) % 256, slots + 5


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
    shipped: tuple[LmConfig, dict[str, torch.Tensor]], batch: int, dtype: torch.dtype
) -> None:
    model, inputs = model_on(shipped, dtype=dtype), decode_inputs(batch)
    logits, count = count_ops(lambda: model.decode(*inputs))
    assert logits.shape == (batch, 256)
    assert count.waits == {}
    if dtype == torch.float32:  # bfloat16 adds a conversion to float32 and back around each norm and rotation
        assert count.launched <= MAX_LAUNCHES, count.launches
    assert count.launches["mm"] == 1 + 5 * shipped[0].n_layers  # qkv, wo, router, experts in, out; the LM head


def test_a_prefill_chunk_and_the_training_path_never_wait(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    model = model_on(shipped)
    model.prefill(3, torch.arange(10), 0)
    _, count = count_ops(lambda: model.prefill(3, torch.arange(20, 60), 10))
    assert count.waits == {}
    _, count = count_ops(lambda: model(torch.arange(64).view(2, 32)))
    assert count.waits == {}


def test_the_step_runs_on_the_meta_device_where_no_value_can_be_read() -> None:
    model = ShardedLm(LmConfig(), num_slots=4, device=torch.device("meta"))
    logits = model.decode(*decode_inputs(3, "meta"))
    assert logits.shape == (3, 256) and logits.device.type == "meta"
    assert model.prefill(1, torch.zeros(5, dtype=torch.int64, device="meta"), 3).shape == (256,)


def test_device_index_tensors_are_trusted_host_ones_checked() -> None:
    model = ShardedLm(LmConfig(), num_slots=4, device=torch.device("meta"))
    bad = torch.tensor([0, 9])
    with pytest.raises(ValueError, match=r"slots\[1\]=9 is out of range \(0 \.\.= 3\)"):
        model.decode(bad, bad, bad)
    model.decode(bad.to("meta"), bad.to("meta"), bad.to("meta"))  # not read: it would wait for the device


def test_the_served_decode_never_waits(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=16))
    slots: list[LmState | None] = [None] * 16
    for seq_id in range(8):
        model.alloc(slots, seq_id)
        model.prefill(slots, seq_id, [65 + seq_id] * 3, 0, 3)
    _, count = count_ops(lambda: model.decode(slots, list(range(8)), [70] * 8))
    assert count.waits == {} and count.launched <= MAX_LAUNCHES


def test_the_state_dict_keeps_the_weights_file_names(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    config, full = shipped
    model = model_on(shipped)
    state = model.state_dict()
    assert sorted(state) == sorted(full)
    attention = [name for name in state if name.startswith("layers.0.attn.")]
    assert attention == [f"layers.0.attn.{name}" for name in ("wq", "wk", "wv", "wo")]  # where wqkv stood
    assert model.state_dict(keep_vars=True)["layers.0.attn.wq"].grad_fn is None  # a view, not a step of autograd
    assert all(torch.equal(state[name], full[name].float()) for name in full)
    again = ShardedLm(config, num_slots=1)
    again.load_state_dict(state)
    block = again.layers[1]
    assert isinstance(block, ShardedBlock)
    assert torch.equal(block.moe.w_out[:, 2], full["layers.1.moe.w_down"][2].float())
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"layers\.0\.attn\.wqkv\""):
        again.load_state_dict({name: t for name, t in state.items() if name != "layers.0.attn.wk"})


def test_the_model_pickles(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    model = model_on(shipped)
    copy = pickle.loads(pickle.dumps(model))
    inputs = decode_inputs(4)
    assert torch.equal(copy.decode(*inputs), model.decode(*inputs))


def test_graphs_refuse_a_model_off_cuda_or_of_several_ranks(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, it is on cpu"):
        DecodeGraphs(model_on(shipped))
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        ReferenceLm(EpLink(SoloTransport(), num_slots=2), cuda_graphs=True)
    sharded = ShardedLm(shipped[0], num_slots=2, rank=1, world_size=2, all_reduce=lambda tensor: None)
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
def test_on_cuda_decode_and_prefill_never_sync(shipped: tuple[LmConfig, dict[str, torch.Tensor]], batch: int) -> None:
    on_cuda, on_cpu = model_on(shipped, "cuda"), model_on(shipped)  # loading copies and waits: outside the check
    prompt, inputs = torch.arange(30), decode_inputs(batch)
    on_cuda_inputs = tuple(tensor.cuda() for tensor in inputs)
    torch.cuda.synchronize()
    with no_sync():
        on_cuda.prefill(0, prompt.cuda(non_blocking=True), 0)
        logits = on_cuda.decode(*on_cuda_inputs)
        on_cuda.prefill(1, prompt, 0)  # host tensors: checked on the host, copied without a wait
        on_cuda.decode(*inputs)
    on_cpu.prefill(0, prompt, 0)
    torch.testing.assert_close(logits.cpu(), on_cpu.decode(*inputs), atol=1e-3, rtol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_on_cuda_the_graphed_steps_give_the_eager_logits(shipped: tuple[LmConfig, dict[str, torch.Tensor]]) -> None:
    eager, graphed = model_on(shipped, "cuda"), model_on(shipped, "cuda")
    graphs = DecodeGraphs(graphed)
    for model in (eager, graphed):
        for slot in range(6):
            model.prefill(slot, torch.arange(10 + slot, device="cuda"), 0)
    lengths = [10 + slot for slot in range(6)]
    for step in range(6):
        batch = [0, 2, 4] if step % 2 else [0, 1, 2, 3, 4, 5]
        tokens = [(step * 31 + slot) % 256 for slot in batch]
        inputs = torch.tensor([batch, tokens, [lengths[slot] for slot in batch]], device="cuda")
        expected = eager.decode_step(inputs[0], inputs[1], inputs[2])
        torch.testing.assert_close(graphs(inputs), expected, atol=1e-5, rtol=0)
        for slot in batch:
            lengths[slot] += 1
    assert graphs.batch_sizes == [3, 6]
    caches = [model.layers[0].attn.kv_cache for model in (graphed, eager)]  # type: ignore[union-attr]
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=0)
