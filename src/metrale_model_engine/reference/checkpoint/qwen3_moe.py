"""Qwen3-MoE (``Qwen3MoeForCausalLM``): its tensor names and the fields of its ``config.json``.

Honoured: the shared fields (``read_shared``), ``head_dim``, the
per-head RMSNorm of queries and keys (``self_attn.q_norm``, ``k_norm``, always
present), ``norm_topk_prob``, ``num_experts`` and ``moe_intermediate_size`` (an
expert's width).  Refused: ``attention_bias``, ``mlp_only_layers`` or a
``decoder_sparse_step`` other than 1 (dense layers between the sparse ones), and
sliding-window attention over less than the context served.  ``intermediate_size``
is the width of those dense layers alone, so it is accounted for, unused.
"""

from __future__ import annotations

from typing import Final

from .family import Family, check_window
from .fields import ConfigFields


def _own_fields(fields: ConfigFields, values: dict[str, object]) -> None:
    values["norm_topk_prob"] = fields.flag("norm_topk_prob", False)
    values["qk_norm"] = True
    if fields.flag("attention_bias", False):
        fields.refuse("attention_bias", "the projections have no biases here")
    if fields.integer("decoder_sparse_step", 1) != 1:
        fields.refuse("decoder_sparse_step", "every layer is a mixture of experts here (a step of 1)")
    if fields.value("mlp_only_layers") not in (None, []):
        fields.refuse("mlp_only_layers", "every layer is a mixture of experts here (no dense layers)")
    fields.value("intermediate_size")  # the dense layers' width: none are served
    if fields.flag("use_sliding_window", False):
        check_window(fields, "sliding_window", values)
    fields.value("sliding_window")  # without use_sliding_window, transformers ignores it too
    fields.value("max_window_layers")  # ditto


QWEN3_MOE: Final = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    moe="mlp",
    expert_weights=("gate_proj", "up_proj", "down_proj"),
    expert_count=("num_experts", "num_local_experts"),
    expert_width="moe_intermediate_size",
    rope_theta=1e4,
    own_fields=_own_fields,
)
"""Qwen3-MoE's names: ``model.layers.N.mlp.gate`` routes, ``mlp.experts.E.gate_proj`` / ``up_proj`` /
``down_proj`` are an expert's projections, ``self_attn.q_norm`` / ``k_norm`` the per-head norms."""
