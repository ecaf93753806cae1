"""A reference tensor- and expert-parallel transformer in plain torch, with trained weights (extra ``torch``).

The model (:class:`ShardedLm`, shape :class:`LmConfig`) is a small decoder-only
transformer over bytes: token embedding; per layer a pre-RMSNorm multi-head
causal self-attention with rotary positions (RoPE) and a KV cache per slot, then
a pre-RMSNorm mixture of experts (a linear router over ``n_experts`` SwiGLU
experts; the ``top_k`` largest router logits pick the experts, a softmax over
those ``top_k`` logits weighs them); a final RMSNorm and an LM head.  The shipped
weights (:data:`SHIPPED_WEIGHTS`, about 0.79 M parameters in bfloat16) were trained
by ``scripts/train_reference.py`` on this project's two license texts, so they
continue ``"Licensed under the"`` with license English.

Sharding over ``world_size`` ranks, which must divide ``n_heads`` and ``n_experts``
(the Megatron / gpt-fast / nano-vllm scheme):

* attention: each rank holds ``n_heads / world_size`` heads: their rows of
  ``wq``, ``wk``, ``wv`` (column parallel), the matching columns of ``wo`` (row
  parallel), and their part of the KV cache; one all-reduce (sum) of the
  attention output per layer;
* experts (expert parallelism): each rank holds ``n_experts / world_size`` whole
  experts; the router is replicated, so every rank computes the same routing and
  adds the weighted outputs of the picked experts it holds; one all-reduce per layer;
* embedding, norms, router and LM head are replicated: at this size
  (256 x 128 each) splitting the vocabulary would save little and cost one more
  collective per call.  The residual stream is replicated, and every rank ends
  with the same logits.

So each :meth:`~ShardedLm.forward`, :meth:`~ShardedLm.prefill` and
:meth:`~ShardedLm.decode` makes ``2 * n_layers`` all-reduces, the same on every
rank.  With one rank it is the plain single-device model.

Numerics: the ranks sum the partial outputs in another order than one rank's
matrix products do, so sharded logits equal the one-rank logits to rounding
(within 1e-5 in float32 on the CPU), not bit for bit; the ranks of one group agree
bit for bit, since the all-reduce hands each the same sums.  The tests bound these
differences and check that greedy tokens agree.  Any floating dtype works: float32
(the tests), float64, bfloat16 and float16 (norms, rotations and routing weights
are then computed in float32).

Weights travel in a small safetensors-like file (:mod:`.weights`), read
without pickle; :func:`shard_state` cuts one rank's part out of the full state.
The tokenizer (:mod:`.tokenizer`) maps each UTF-8 byte to one token.  This
package imports torch; the root package never imports it.

Its modules, one job each: :mod:`.config` (the shape and the sharding rule),
:mod:`.layers` and :mod:`.model` (the network), :mod:`.graphs` (decode steps
replayed from CUDA graphs), :mod:`.state` (a slot's state and
the checks every rank makes of a command), :mod:`.serving` (:class:`ReferenceLm`,
the network served over the protocol), :mod:`.scheduler` (:class:`Server`,
continuous batching on the head), :mod:`.kv_check`, :mod:`.summary`,
:mod:`.weights` and :mod:`.tokenizer`.  Everything is exported here.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the check below; the modules import it themselves)
except ImportError as _missing:  # pragma: no cover - exercised in a torch-less venv
    raise ImportError(
        "metrale_model_engine.reference needs PyTorch: install the 'torch' extra, "
        "pip install 'metrale-model-engine[torch]' (CPU build: pip install torch==2.13.0 first)"
    ) from _missing

from .._core.namespace import PublicDir, public_dir
from .config import LmConfig, Shard, check_world, init_full_state, shard_state, state_shapes
from .graphs import DecodeGraphs
from .layers import AllReduce
from .model import ShardedLm
from .scheduler import Completion, DecodeStep, FinishReason, Request, ServedLm, Server
from .serving import (
    CMD_ALLOC,
    CMD_DECODE,
    CMD_PREFILL,
    EXIT_GRACE,
    LmSlots,
    LmState,
    ReferenceLm,
    RunStopped,
    TimeSpent,
    check_decode,
    check_prefill,
    check_prompt,
    kv_digest,
)
from .summary import run_summary, summary_lines
from .tokenizer import VOCAB_SIZE, decode_text, encode
from .weights import FORMAT_VERSION, MAGIC, SHIPPED_WEIGHTS, load_weights, read_config, save_weights

__all__ = [
    "CMD_ALLOC",
    "CMD_DECODE",
    "CMD_PREFILL",
    "EXIT_GRACE",
    "FORMAT_VERSION",
    "MAGIC",
    "SHIPPED_WEIGHTS",
    "VOCAB_SIZE",
    "AllReduce",
    "Completion",
    "DecodeGraphs",
    "DecodeStep",
    "FinishReason",
    "LmConfig",
    "LmSlots",
    "LmState",
    "ReferenceLm",
    "Request",
    "RunStopped",
    "ServedLm",
    "Server",
    "Shard",
    "ShardedLm",
    "TimeSpent",
    "check_decode",
    "check_prefill",
    "check_prompt",
    "check_world",
    "decode_text",
    "encode",
    "init_full_state",
    "kv_digest",
    "load_weights",
    "read_config",
    "run_summary",
    "save_weights",
    "shard_state",
    "state_shapes",
    "summary_lines",
]


__dir__: PublicDir = public_dir(globals(), __all__)
