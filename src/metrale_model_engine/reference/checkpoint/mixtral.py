"""Mixtral (``MixtralForCausalLM``): its tensor names and the fields of its ``config.json``.

Honoured: the shared fields (:func:`~.family.read_shared`: grouped-query attention
through ``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``rms_norm_eps``,
``tie_word_embeddings``, ...), ``num_local_experts`` and ``intermediate_size`` (an
expert's width); the top-k routing weights are always renormalised.  Refused: a
``sliding_window`` shorter than the context served.
"""

from __future__ import annotations

from typing import Final

from ..._core.namespace import PublicDir, public_dir
from ..config import LmConfig
from .family import HARMLESS, Family, check_window, make_config, read_shared
from .fields import ConfigFields

__all__ = ["MIXTRAL"]


__dir__: PublicDir = public_dir(globals(), __all__)


def _read(fields: ConfigFields, max_seq_len: int | None) -> LmConfig:
    values = read_shared(fields, max_seq_len, rope_theta=1e6)
    values["n_experts"] = fields.integer("num_local_experts", fields.integer("num_experts", 8))
    values["d_expert"] = fields.integer("intermediate_size")
    config = make_config(fields, values)
    check_window(fields, "sliding_window", config.max_seq_len)
    fields.finish(HARMLESS)
    return config


MIXTRAL: Final = Family("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"), _read)
"""Mixtral's names: ``model.layers.N.block_sparse_moe.gate`` routes, ``experts.E.w1`` / ``w3`` / ``w2`` are an
expert's gate, up and down projections."""
