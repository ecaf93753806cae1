"""A checkpoint directory opened and checked (``Checkpoint``), and a rank's part of it read (``load_shard``).

[`Checkpoint.open`][metrale_model_engine.reference.Checkpoint.open] reads ``config.json``, ``generation_config.json``
and the safetensors headers, never a weight: a launcher calls it to refuse a bad checkpoint
before any rank starts, and each rank calls it again before
[`load_shard`][metrale_model_engine.reference.checkpoint.load_shard] reads that rank's slices, lazily, from the files
(``safetensors``' ``get_slice``): no rank, and no launcher, holds the whole checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import safe_open

from ..config import LmConfig
from ..network.model import ShardedLm
from .family import Family
from .fields import ConfigFields
from .files import CheckpointError, TensorEntry, read_json, tensor_table
from .mixtral import MIXTRAL
from .plan import Piece, copy_held, fill, pieces, reshard
from .qwen3_moe import QWEN3_MOE

SHIPPED_MODEL: Final[Path] = Path(__file__).parents[1] / "tiny_moe"
"""The model that ships with the package: a ``MixtralForCausalLM`` checkpoint with a byte tokenizer."""
FAMILIES: Final[tuple[Family, ...]] = (MIXTRAL, QWEN3_MOE)
"""The architectures a checkpoint may have."""
DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtypes a model may run in and a checkpoint's weights may have, by name (``config.json``'s)."""
_STORED: Final = {name.upper().replace("FLOAT", "F"): dtype for name, dtype in DTYPES.items()}
"""``DTYPES`` by the names safetensors gives them: ``F32``, ``BF16``, ``F16``."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory in the Hugging Face layout, checked (see the module); open one with ``open``."""

    directory: Path
    family: Family
    config: LmConfig
    """The model's shape, ``max_seq_len`` being the context served."""
    dtype: torch.dtype
    """The checkpoint's own dtype (``config.json``'s ``dtype``, else its weights'): a model's default."""
    tensors: Mapping[str, TensorEntry]
    eos_token_ids: tuple[int, ...]
    """The ids that end a sequence: ``generation_config.json``'s ``eos_token_id``, else ``config.json``'s."""
    tokenizer_file: Path | None
    """``tokenizer.json`` beside the weights, if there is one."""

    @classmethod
    def open(cls, directory: str | Path | None = None, *, max_seq_len: int | None = None) -> Checkpoint:
        """Open and check the checkpoint in ``directory`` (``None``: ``SHIPPED_MODEL``).

        Args:
            directory: the checkpoint's directory.
            max_seq_len: the context to serve, at most the model's ``max_position_embeddings``
                (``None``: all of it).  A sequence holds at most that many positions.

        Raises:
            CheckpointError: the directory, a file, a field or a tensor is missing or wrong;
                the message names which, and where.
        """
        path = SHIPPED_MODEL if directory is None else Path(directory)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such directory" if not path.exists() else f"{path}: not a directory")
        fields = ConfigFields(path / "config.json", read_json(path / "config.json"))
        family = _family(fields)
        named_dtypes = [fields.value("dtype"), fields.value("torch_dtype")]  # transformers 5's name, then 4's
        dtype_name = next((name for name in named_dtypes if name is not None), None)
        eos = fields.value("eos_token_id")
        fields.value("bos_token_id")  # the tokenizer adds it, as its special tokens say
        config = family.read(fields, max_seq_len)
        tensors = tensor_table(path)
        _check_tensors(path, tensors, pieces(config, family, config.shard(0, 1)), family, config)
        if dtype_name is None:
            dtype = _STORED[tensors["model.embed_tokens.weight"].dtype]
        elif isinstance(dtype_name, str) and dtype_name in DTYPES:
            dtype = DTYPES[dtype_name]
        else:
            fields.wrong("dtype", dtype_name, f"must be one of {', '.join(DTYPES)}")
        eos_ids = _token_ids(fields.path, eos, config.vocab_size)
        generation = path / "generation_config.json"
        if generation.exists():  # it says what generate() does: its ids, where it names any, win
            fields_of_generation = read_json(generation)
            if "eos_token_id" in fields_of_generation:
                eos_ids = _token_ids(generation, fields_of_generation["eos_token_id"], config.vocab_size)
        tokenizer = path / "tokenizer.json"
        return cls(path, family, config, dtype, tensors, eos_ids, tokenizer if tokenizer.is_file() else None)

    def shard_bytes(self, rank: int, world_size: int, dtype: torch.dtype) -> int:
        """The bytes of rank ``rank``'s weights in ``dtype``, when ``world_size`` ranks share the model (the zero
        heads of its padding included: their rows of the query projection and columns of the output projection)."""
        config, shard = self.config, self.config.shard(rank, world_size)
        elements = sum(_elements(piece) for piece in pieces(config, self.family, shard))
        padding = (shard.pad_before + shard.pad_after) * config.head_dim * config.d_model * 2 * config.n_layers
        return (elements + padding) * dtype.itemsize

    def weight_bytes(self) -> int:
        """The bytes of the checkpoint's weights as stored."""
        sizes = {name: dtype.itemsize for name, dtype in _STORED.items()}
        return sum(math.prod(entry.shape) * sizes.get(entry.dtype, 0) for entry in self.tensors.values())


def load_shard(model: ShardedLm, checkpoint: Checkpoint, *, held: ShardedLm | None = None) -> int:
    """Read ``model``'s shard of ``checkpoint`` (its rank's slices alone) into its parameters, in their dtype.

    The files are mapped (``safetensors``' ``safe_open``) one layer at a time, so
    at its peak a rank holds its shard and the pages of one layer's slices.

    Args:
        model: the rank's model; its parameters are filled (the zero heads of its padding left as they are).
        checkpoint: the checkpoint opened.
        held: this rank's model of another shard of the same checkpoint (its world changed: a rank
            lost, say): the slices it holds are copied from it, and only the others read from the files
            ([`reshard`][metrale_model_engine.reference.checkpoint.reshard]).  ``None``: every slice read.

    Returns:
        The bytes read from the files (in their stored dtype).

    Raises:
        ValueError: ``model``'s config, or ``held``'s, is not the checkpoint's.
        OSError: a file cannot be read.
    """
    for name, lm in (("model", model), ("held model", held)):
        if lm is not None and lm.config != checkpoint.config:
            raise ValueError(f"the {name}'s config {lm.config} is not the checkpoint's, {checkpoint.config}")
    missing = None
    if held is not None:
        change = reshard(checkpoint.config, checkpoint.family, held.shard, model.shard)
        copy_held(model, held, change.held)
        missing = change.missing
    opened: dict[Path, Any] = {}
    layer: str | None = None
    read_bytes = 0
    with ExitStack() as files:

        def read(piece: Piece) -> torch.Tensor:
            nonlocal layer, read_bytes
            if _layer_of(piece) != layer:  # a new layer: the last one's pages go
                files.close()
                opened.clear()
                layer = _layer_of(piece)
            file = checkpoint.tensors[piece.name].file
            if file not in opened:
                opened[file] = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            part: torch.Tensor = opened[file].get_slice(piece.name)[piece.part]
            read_bytes += part.numel() * part.element_size()
            return part

        fill(model, checkpoint.family, read, missing)
    return read_bytes


def _layer_of(piece: Piece) -> str:
    """``"layers.N"`` for a piece of layer ``N``, ``""`` for the embedding, the final norm and the LM head."""
    parts = piece.target.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else ""


def _family(fields: ConfigFields) -> Family:
    architectures = fields.value("architectures")
    model_type = fields.value("model_type")
    names = [family.architecture for family in FAMILIES]
    if not isinstance(architectures, list) or len(architectures) != 1:
        fields.wrong("architectures", architectures, f"must name one architecture ({', '.join(names)})")
    for family in FAMILIES:
        if architectures[0] == family.architecture:
            if model_type not in (None, family.model_type):
                fields.wrong("model_type", model_type, f"must be {family.model_type!r} for {family.architecture}")
            return family
    fields.refuse("architectures", f"the architectures served are {', '.join(names)}")


def _check_tensors(
    path: Path, tensors: Mapping[str, TensorEntry], wanted: list[Piece], family: Family, config: LmConfig
) -> None:
    names = {piece.name for piece in wanted}
    for piece in wanted:
        entry = tensors.get(piece.name)
        if entry is None:
            raise CheckpointError(f"{path}: no tensor {piece.name!r} in any of its files")
        if entry.dtype not in _STORED:
            stored = ", ".join(_STORED)
            raise CheckpointError(f"{entry.file}: tensor {piece.name!r} is {entry.dtype}, not one of {stored}")
        if entry.shape != piece.shape:
            raise CheckpointError(
                f"{entry.file}: tensor {piece.name!r} has shape {list(entry.shape)}, "
                f"the config needs {list(piece.shape)}"
            )
    tied_head = {"lm_head.weight"} if config.tie_embeddings else set()  # the embedding is the head: not read
    for name, entry in sorted(tensors.items()):
        if name not in names and name not in tied_head:
            raise CheckpointError(
                f"{entry.file}: tensor {name!r} is not part of a {family.architecture} of this config"
            )


def _token_ids(source: Path, value: object, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id`` (``None``, one id or a list) as a tuple, each in the vocabulary."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        if type(token) is not int or not 0 <= token < vocab_size:
            raise CheckpointError(
                f"{source}: eos_token_id {value!r:.80} must be ids of the vocabulary (0 ..= {vocab_size - 1})"
            )
    return tuple(ids)


def _elements(piece: Piece) -> int:
    """The elements of the part of its tensor that ``piece`` reads."""
    whole = (slice(None),) * (len(piece.shape) - len(piece.part))
    return math.prod(
        len(range(size)[index]) if isinstance(index, slice) else 1
        for size, index in zip(piece.shape, piece.part + whole, strict=True)
    )
