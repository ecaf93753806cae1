"""A tensor- and expert-parallel MoE transformer in plain torch, served over the protocol (extra ``torch``).

The model ([`ShardedLm`][metrale_model_engine.reference.ShardedLm], shape
[`LmConfig`][metrale_model_engine.reference.LmConfig]) computes Mixtral's and Qwen3-MoE's arithmetic, as
``transformers`` does: token embedding; per layer a pre-RMSNorm grouped-query causal self-attention with rotary
positions (RoPE; with Qwen3's per-head query and key norms) and a paged KV cache, then a pre-RMSNorm
mixture of SwiGLU experts (the router's softmax over every expert picks the
``top_k`` largest, renormalised or not); a final RMSNorm and an LM head.  Its
weights come from a checkpoint in the Hugging Face layout ([`checkpoint`][metrale_model_engine.reference.checkpoint]:
``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM``, ``config.json`` and
``*.safetensors``), every rank reading only its own part.  The shipped model
([`SHIPPED_MODEL`][metrale_model_engine.reference.SHIPPED_MODEL], a ``MixtralForCausalLM`` of about 0.79 M parameters
with a byte tokenizer) was trained by ``scripts/train_reference.py`` on this project's
two license texts, so it continues ``"Licensed under the"`` with license English.

Sharding over any ``world_size`` from 1 to ``n_heads`` ranks (the Megatron / vLLM / gpt-fast scheme, split as
evenly as it can be: [`LmConfig.shard`][metrale_model_engine.reference.LmConfig.shard]):

* attention: each rank holds ``n_heads / world_size`` query heads (8 over 3 ranks: 3, 3
  and 2) and the KV heads they read (a KV head replicated on each rank whose query heads
  read it), their rows of the fused query/key/value projection (column parallel),
  the matching columns of the output projection (row parallel), and their part of
  the KV cache; one all-reduce (sum) of the attention output per layer;
* experts (expert parallelism): each rank holds ``n_experts / world_size`` whole
  experts, as evenly; the router is replicated, so every rank computes the same routing and
  adds the weighted outputs of the picked experts it holds; one all-reduce per layer;
* embedding, norms, router and LM head are replicated.  The residual stream is
  replicated, and every rank ends with the same logits.

So each [`forward`][metrale_model_engine.reference.ShardedLm.forward],
[`prefill`][metrale_model_engine.reference.ShardedLm.prefill] and
[`decode`][metrale_model_engine.reference.ShardedLm.decode] makes ``2 * n_layers`` all-reduces, the same on every rank.
 With one rank it is the plain single-device model.

Numerics: the ranks sum the partial outputs in another order than one rank's
matrix products do, so sharded logits equal the one-rank logits to rounding
(within 1e-5 in float32 on the CPU), not bit for bit; the ranks of one group agree
bit for bit, since the all-reduce hands each the same sums.  The tests hold the
greedy tokens at 1, 2 and 4 ranks equal to ``transformers``' for the same
checkpoint, in float32 (and at 3, an uneven split).  Any floating dtype works: float32, float64, bfloat16 and float16
(norms, rotations and routing weights are then computed in float32); in bfloat16 the tokens
part from ``transformers``' (and from one world size to another) where the two largest
logits tie within its rounding (docs/reference.md).

This package imports torch; the root package never imports it.  Its modules, one
job each: ``config`` (the shape and the sharding rule), ``network`` (the network: ``layers``,
``experts`` and ``model``, and ``graphs``, decode steps
replayed from CUDA graphs), [`checkpoint`][metrale_model_engine.reference.checkpoint] (the Hugging Face layout),
``serving`` ([`ReferenceLm`][metrale_model_engine.reference.ReferenceLm], the network served over the protocol,
composed of its parts in ``rank``: a slot's state, the checks every rank makes of a command, the digests sync points
compare, the command words and their wire layout, the head's and the worker's side of a command, the forwards, the
all-reduce, the time spent), ``requests`` (a request, its completion, how its tokens are picked), ``scheduler``
([`Server`][metrale_model_engine.reference.Server], continuous batching on the head), ``batch`` (the requests in
flight: the queue, and the slots they hold) and ``summary``; ``server`` is
the scheduler's former name.  Everything a user writes is exported here, with
[`count_ops`][metrale_model_engine.reference.count_ops] (what one call
costs a device: its launches, and the ops that make the host wait for a GPU, on
any device; [`OpCount`][metrale_model_engine.reference.OpCount],
[`WAITING_OPS`][metrale_model_engine.reference.WAITING_OPS]), the check the tests and benchmarks make of these steps.
``RunStopped`` and ``EXIT_GRACE``, which this package re-exported, are the protocol's: their homes are
[`metrale_model_engine.RunStopped`][metrale_model_engine.RunStopped] and
[`metrale_model_engine.torch.EXIT_GRACE`][metrale_model_engine.torch.EXIT_GRACE]; the names here still work, with a
``DeprecationWarning``, until 0.3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import torch  # noqa: F401  (the check below; the modules import it themselves)
except ImportError as _missing:  # pragma: no cover - exercised in a torch-less venv
    raise ImportError(
        "metrale_model_engine.reference needs PyTorch: install the 'torch' extra, "
        "pip install 'metrale-model-engine[torch]' (CPU build: pip install torch==2.13.0 first)"
    ) from _missing

from .._core.namespace import PublicDir, public_dir
from .._tensors.op_count import WAITING_OPS, OpCount, count_ops
from .blocks import KvBlocks
from .checkpoint import SHIPPED_MODEL, Checkpoint, CheckpointError, Tokenizer
from .config import LmConfig, Shard, check_world
from .network.experts import ExpertRouting
from .network.graphs import DecodeGraphs
from .network.layers import AllReduce
from .network.model import ShardedLm, decode_span
from .rank.checks import check_decode, check_prefill, check_prompt
from .rank.commands.words import CMD_ALLOC, CMD_DECODE, CMD_PREFILL
from .rank.digest import kv_digest
from .rank.recovery import Recovery
from .rank.slots import LmSlots, LmState
from .rank.timing import TimeSpent
from .requests import GREEDY, Completion, FinishReason, Request, Sampler, Sampling, TokenLogprobs, token_logprobs
from .scheduler import DecodeStep, ServedLm, Server
from .serving import ReferenceLm
from .summary import run_summary, summary_lines

__all__ = [
    "CMD_ALLOC",
    "CMD_DECODE",
    "CMD_PREFILL",
    "GREEDY",
    "SHIPPED_MODEL",
    "WAITING_OPS",
    "AllReduce",
    "Checkpoint",
    "CheckpointError",
    "Completion",
    "DecodeGraphs",
    "DecodeStep",
    "ExpertRouting",
    "FinishReason",
    "KvBlocks",
    "LmConfig",
    "LmSlots",
    "LmState",
    "OpCount",
    "Recovery",
    "ReferenceLm",
    "Request",
    "Sampler",
    "Sampling",
    "ServedLm",
    "Server",
    "Shard",
    "ShardedLm",
    "TimeSpent",
    "TokenLogprobs",
    "Tokenizer",
    "check_decode",
    "check_prefill",
    "check_prompt",
    "check_world",
    "count_ops",
    "decode_span",
    "kv_digest",
    "run_summary",
    "summary_lines",
    "token_logprobs",
]


__dir__: PublicDir = public_dir(globals(), __all__)

if TYPE_CHECKING:
    from .. import RunStopped as RunStopped
    from ..torch import EXIT_GRACE as EXIT_GRACE
else:
    from .. import RunStopped as _RunStopped
    from .._core.namespace import moved_names
    from ..torch import EXIT_GRACE as _EXIT_GRACE

    __getattr__ = moved_names(
        __name__,
        {
            "RunStopped": ("metrale_model_engine", _RunStopped),
            "EXIT_GRACE": ("metrale_model_engine.torch", _EXIT_GRACE),
        },
    )
