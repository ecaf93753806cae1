"""The independent oracle: tiny random checkpoints written by ``transformers``' own ``save_pretrained`` in the
Hub's layout, and ``transformers``' own greedy tokens for them (needs the ``test-torch`` extra).

Both families are shaped to exercise what sharding must get right: grouped-query
attention with 2 KV heads (replicated at 4 ranks; at 3, Mixtral's 8 heads split
3 + 3 + 2 and the middle rank holds both KV heads), 4 or 8 experts, 2 of them per
token; Qwen3-MoE also with heads wider than ``hidden_size / heads``, its per-head
query and key norms, and routing weights that are not renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch

FAMILIES: Final = ("mixtral", "qwen3_moe")
VOCAB: Final = 128
PROMPTS: Final[tuple[tuple[int, ...], ...]] = (
    (5, 17, 99, 3),
    (64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
    (127,),
    tuple(range(30, 50)),
)
"""Prompts of 1 to 20 tokens (of the 128-token vocabulary)."""
NEW_TOKENS: Final = 12
SHAPES: Final[dict[str, dict[str, Any]]] = {
    "mixtral": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
    },
    "qwen3_moe": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "max_position_embeddings": 128,
    },
}


def write_checkpoint(
    directory: Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """A random ``family`` model of :data:`SHAPES` (with ``overrides``), written by ``save_pretrained``.

    ``max_shard_size`` (e.g. ``"20KB"``) splits the weights over several files with an index.
    """
    import transformers

    config_class, model_class = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    torch.manual_seed(seed)
    config = config_class(**{**SHAPES[family], **overrides})
    model = model_class(config).to(dtype)
    options: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **options)
    return directory


def reference_tokens(
    directory: Path,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    *,
    dtype: torch.dtype = torch.float32,
    stop_at_eos: bool = False,
) -> tuple[list[list[int]], list[list[tuple[float, float]]]]:
    """``transformers``' greedy tokens for each prompt (one at a time), and at each step its two largest logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.train(False)
    generated: list[list[int]] = []
    tops: list[list[tuple[float, float]]] = []
    for prompt in prompts:
        stop = {} if stop_at_eos else {"eos_token_id": None}
        with torch.no_grad():
            out = model.generate(
                torch.tensor([list(prompt)]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True, **stop,
            )  # fmt: skip
        generated.append(out.sequences[0, len(prompt) :].tolist())
        tops.append(
            [(float(first), float(second)) for first, second in (s[0].float().topk(2).values for s in out.scores)]
        )
    return generated, tops


def smallest_gap(tops: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The smallest gap between the two largest logits at any step of ``reference_tokens``' (a gap far above
    rounding makes equal tokens a fair test)."""
    return min(first - second for steps in tops for first, second in steps)
