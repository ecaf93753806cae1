"""Checkpoints in the Hugging Face layout: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``, each rank reading
its own part (needs the ``torch`` extra, which brings ``safetensors`` and ``tokenizers``).

A directory holds ``config.json``, ``*.safetensors`` (with
``model.safetensors.index.json`` when there are several), and optionally
``generation_config.json`` and ``tokenizer.json``, as ``transformers``'
``save_pretrained`` writes them and the Hub ships them.
 [`Checkpoint.open`][metrale_model_engine.reference.Checkpoint.open]
checks it all without reading a weight (every field of ``config.json`` honoured or
refused by name); [`load_shard`][metrale_model_engine.reference.checkpoint.load_shard] reads one rank's slices into its
[`ShardedLm`][metrale_model_engine.reference.ShardedLm].

Its modules, one job each: ``files`` (the layout and the safetensors headers),
``fields`` (``config.json``'s fields, each accounted for), ``family`` (what
the families share), ``mixtral`` and ``qwen3_moe`` (one family each),
``plan`` (which slice goes where, and what a rank whose shard changes holds already),
``loader`` ([`Checkpoint`][metrale_model_engine.reference.checkpoint.Checkpoint],
[`load_shard`][metrale_model_engine.reference.checkpoint.load_shard]), ``tokenizer`` and ``write``
([`save_checkpoint`][metrale_model_engine.reference.checkpoint.save_checkpoint]).
"""

from __future__ import annotations

from ..._core.namespace import PublicDir, public_dir
from .family import Family
from .files import CheckpointError, TensorEntry
from .loader import DTYPES, FAMILIES, SHIPPED_MODEL, Checkpoint, load_shard
from .mixtral import MIXTRAL
from .plan import Piece, Reshard, export_state, load_state, pieces, reshard
from .qwen3_moe import QWEN3_MOE
from .tokenizer import Tokenizer, byte_tokenizer
from .write import save_checkpoint

__all__ = [
    "DTYPES",
    "FAMILIES",
    "MIXTRAL",
    "QWEN3_MOE",
    "SHIPPED_MODEL",
    "Checkpoint",
    "CheckpointError",
    "Family",
    "Piece",
    "Reshard",
    "TensorEntry",
    "Tokenizer",
    "byte_tokenizer",
    "export_state",
    "load_shard",
    "load_state",
    "pieces",
    "reshard",
    "save_checkpoint",
]


__dir__: PublicDir = public_dir(globals(), __all__)
