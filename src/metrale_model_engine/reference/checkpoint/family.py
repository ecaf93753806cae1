"""What the checkpoint families share: ``Family`` (how one names its tensors and reads its config) and the
fields of ``config.json`` that Mixtral and Qwen3-MoE read alike (``read_shared``).

Tensor names are the Hub's own, which ``transformers`` writes: ``model.embed_tokens``,
per layer ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``input_layernorm``,
``post_attention_layernorm``, the router and the experts under the family's MoE
module, then ``model.norm`` and ``lm_head`` (each ``.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ..config import LmConfig
from .fields import ConfigFields
from .files import CheckpointError

HARMLESS: Final = frozenset(
    {
        "_name_or_path",
        "attention_dropout",  # dropout: training only
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "return_dict",
        "router_aux_loss_coef",
        "router_jitter_noise",  # noise on the router's input: training only
        "transformers_version",
        "use_cache",
    }
)
"""Fields of either family that do not change the arithmetic of inference."""


@dataclass(frozen=True)
class Family:
    """A model family of the Hub: its architecture's name, how it names its tensors, and how it reads its config."""

    architecture: str
    """``config.json``'s ``architectures[0]``, e.g. ``"MixtralForCausalLM"``."""
    model_type: str
    """``config.json``'s ``model_type``, e.g. ``"mixtral"``."""
    moe: str
    """A layer's MoE module: ``model.layers.N.<moe>.gate`` is the router, ``<moe>.experts.E`` the experts."""
    expert_weights: tuple[str, str, str]
    """An expert's gate, up and down projections, e.g. ``("w1", "w3", "w2")``."""
    expert_count: tuple[str, ...]
    """The names the number of experts goes by in ``config.json`` (``transformers`` 5 writes one, the Hub another)."""
    expert_width: str
    """The field of an expert's hidden width."""
    rope_theta: float
    """RoPE's base when ``config.json`` names none (``transformers``' default for the family)."""
    own_fields: Callable[[ConfigFields, dict[str, object]], None]
    """Reads the family's own fields into the ``LmConfig`` values, and refuses those it does not honour."""

    def read(self, fields: ConfigFields, max_seq_len: int | None) -> LmConfig:
        """The model's shape, serving ``max_seq_len`` positions (``None``: all of ``max_position_embeddings``).

        Raises:
            CheckpointError: a field is missing, wrong, or not honoured here; any field left unread.
        """
        values = read_shared(fields, max_seq_len, rope_theta=self.rope_theta)
        named = [name for name in self.expert_count if fields.has(name)] or [self.expert_count[0]]  # none: missing
        counts = [fields.integer(name) for name in named]
        if len(set(counts)) > 1:
            fields.wrong(named[0], counts[0], f"must equal {named[1]}={counts[1]} (both count the experts)")
        values["n_experts"] = counts[0]
        values["d_expert"] = fields.integer(self.expert_width)
        self.own_fields(fields, values)
        config = make_config(fields, values)
        fields.finish(HARMLESS)
        return config

    def layer(self, index: int) -> str:
        """The prefix of layer ``index``'s tensor names."""
        return f"model.layers.{index}."

    def router(self, layer: int) -> str:
        """The name of layer ``layer``'s router."""
        return f"{self.layer(layer)}{self.moe}.gate.weight"

    def expert(self, layer: int, expert: int) -> tuple[str, str, str]:
        """The names of expert ``expert``'s gate, up and down projections in layer ``layer``."""
        prefix = f"{self.layer(layer)}{self.moe}.experts.{expert}."
        gate, up, down = (f"{prefix}{name}.weight" for name in self.expert_weights)
        return gate, up, down


def read_shared(fields: ConfigFields, max_seq_len: int | None, *, rope_theta: float) -> dict[str, object]:
    """The ``LmConfig`` fields both families read alike, as keyword arguments; ``rope_theta`` is the
    family's default base.

    Refuses an activation other than SiLU, RoPE other than the default (``rope_scaling``,
    a ``rope_type``), and a ``max_seq_len`` past ``max_position_embeddings``.
    """
    if fields.text("hidden_act", "silu") != "silu":
        fields.refuse("hidden_act", "the experts are SwiGLU (silu) in both families")
    layer_types = fields.value("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or any(kind != "full_attention" for kind in layer_types)
    ):
        fields.refuse("layer_types", "only full attention is implemented (every layer 'full_attention')")
    heads = fields.integer("num_attention_heads")
    context = fields.integer("max_position_embeddings")
    if max_seq_len is not None and max_seq_len > context:
        fields.wrong("max_position_embeddings", context, f"must cover the context asked for ({max_seq_len})")
    return {
        "vocab_size": fields.integer("vocab_size"),
        "d_model": fields.integer("hidden_size"),
        "n_layers": fields.integer("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": fields.integer("num_key_value_heads", heads),
        "head_dim": fields.integer("head_dim", 0),
        "top_k": fields.integer("num_experts_per_tok"),
        "max_seq_len": context if max_seq_len is None else max_seq_len,
        "rope_base": _rope_base(fields, rope_theta),
        "norm_eps": fields.number("rms_norm_eps"),
        "tie_embeddings": fields.flag("tie_word_embeddings", False),
    }


_FIELD_NAMES: Final = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "top_k": "num_experts_per_tok",
    "n_experts": "the expert count",
    "d_expert": "the expert width",
}
"""[`LmConfig`][metrale_model_engine.reference.LmConfig]'s names in the words of ``config.json``, for its refusals."""


def make_config(fields: ConfigFields, values: dict[str, object]) -> LmConfig:
    """``LmConfig(**values)``, a refusal told in the config file's own field names."""
    try:
        return LmConfig(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        told = re.sub(r"\b(\w+)(?==)", lambda name: _FIELD_NAMES.get(name[1], name[1]), str(error))
        raise CheckpointError(f"{fields.path}: its fields make no model: {told.replace('LmConfig.', '')}") from None


def check_window(fields: ConfigFields, name: str, values: dict[str, object]) -> None:
    """Refuse a sliding window (field ``name``) shorter than the context served (``values``' ``max_seq_len``):
    a window that covers it lets every position see all, as full attention does."""
    served = values["max_seq_len"]
    assert isinstance(served, int)
    if fields.has(name) and fields.integer(name) < served:
        fields.refuse(
            name,
            f"sliding-window attention is not implemented; serve at most {fields.value(name)} positions "
            f"(max_seq_len), where the window covers the whole context",
        )


def _rope_base(fields: ConfigFields, default: float) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x); only the default RoPE."""
    base = default
    for name in ("rope_parameters", "rope_scaling"):
        parameters = fields.value(name)
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            fields.wrong(name, parameters, "must be an object")
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        if kind != "default" or not parameters.keys() <= {"rope_type", "type", "rope_theta"}:
            fields.refuse(name, "only the default RoPE is implemented (no scaling, no partial rotation)")
        if "rope_theta" in parameters:
            base = _positive(fields, name, parameters["rope_theta"])
    if fields.has("rope_theta"):
        base = fields.number("rope_theta")
    return base


def _positive(fields: ConfigFields, name: str, value: object) -> float:
    if type(value) not in (int, float) or not 0 < value < float("inf"):  # type: ignore[operator]
        fields.wrong(name, value, "must hold a positive, finite rope_theta")
    assert isinstance(value, (int, float))
    return float(value)
