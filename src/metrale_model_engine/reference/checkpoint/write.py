"""A one-rank model written as a ``MixtralForCausalLM`` checkpoint in the Hugging Face layout (``save_checkpoint``):
what ``scripts/train_reference.py`` writes the shipped model with, and what ``transformers`` loads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from safetensors.torch import save_file

from ..network.model import ShardedLm
from .loader import DTYPES
from .mixtral import MIXTRAL
from .plan import export_state


def save_checkpoint(
    directory: str | Path,
    model: ShardedLm,
    *,
    tokenizer: tokenizers.Tokenizer | None = None,
    eos_token_ids: Sequence[int] = (),
) -> None:
    """Write ``model`` (one rank) to ``directory`` as a Mixtral checkpoint, in its parameters' dtype.

    Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and,
    when given, ``tokenizer.json``; the directory is made if missing.  The same
    model always gives the same bytes.

    Raises:
        ValueError: ``model`` is one of several ranks, or its config has what Mixtral
            lacks (per-head query and key norms, routing weights not renormalised),
            or its dtype is not float32, bfloat16 or float16.
    """
    config = model.config
    if config.qk_norm or not config.norm_topk_prob:
        raise ValueError("a Mixtral checkpoint has no per-head query/key norms and always renormalises the top-k")
    dtype = model.embed.dtype
    dtype_name = next((name for name, known in DTYPES.items() if known == dtype), None)
    if dtype_name is None:
        raise ValueError(f"the model's dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    state = export_state(model, MIXTRAL)
    eos = list(eos_token_ids)
    fields = {
        "architectures": [MIXTRAL.architecture],
        "model_type": MIXTRAL.model_type,
        "dtype": dtype_name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_expert,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_base,  # transformers 4 reads this one ...
        "rope_parameters": {"rope_theta": config.rope_base, "rope_type": "default"},  # ... and 5 this one
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "sliding_window": None,
        "bos_token_id": None,
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
    }
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    generation = {"eos_token_id": fields["eos_token_id"]}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = target / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # readable as the other files are (it is written private)
    if tokenizer is not None:
        tokenizer.save(str(target / "tokenizer.json"))
