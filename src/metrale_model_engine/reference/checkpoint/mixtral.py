"""Mixtral (``MixtralForCausalLM``): its tensor names and the fields of its ``config.json``.

Honoured: the shared fields (``read_shared``: grouped-query attention
through ``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``rms_norm_eps``,
``tie_word_embeddings``, ...), ``num_local_experts`` and ``intermediate_size`` (an
expert's width); the top-k routing weights are always renormalised.  Refused: a
``sliding_window`` shorter than the context served.
"""

from __future__ import annotations

from typing import Final

from .family import Family, check_window
from .fields import ConfigFields


def _sliding_window(fields: ConfigFields, values: dict[str, object]) -> None:
    check_window(fields, "sliding_window", values)


MIXTRAL: Final = Family(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    moe="block_sparse_moe",
    expert_weights=("w1", "w3", "w2"),
    expert_count=("num_local_experts", "num_experts"),
    expert_width="intermediate_size",
    rope_theta=1e6,
    own_fields=_sliding_window,
)
"""Mixtral's names: ``model.layers.N.block_sparse_moe.gate`` routes, ``experts.E.w1`` / ``w3`` / ``w2`` are an
expert's gate, up and down projections."""
