"""The files of a checkpoint directory in the Hugging Face layout, read and checked without reading a weight.

A directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` naming each tensor's file when there are several),
and optionally ``generation_config.json`` and ``tokenizer.json``.  A safetensors
file is an 8-byte little-endian header length, a JSON header (each tensor's
``dtype``, ``shape`` and ``data_offsets``, counted from the end of the header), then
the data.  ``tensor_table`` reads the headers alone and checks that every tensor
lies inside its file, so a truncated or corrupt file is named before any rank starts.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeGuard

from ..._core.namespace import PublicDir, public_dir

__all__ = ["DTYPE_SIZES", "INDEX", "CheckpointError", "TensorEntry", "read_json", "tensor_table"]


__dir__: PublicDir = public_dir(globals(), __all__)


INDEX: Final = "model.safetensors.index.json"
DTYPE_SIZES: Final[dict[str, int]] = {"F32": 4, "BF16": 2, "F16": 2}
"""The safetensors dtypes a weight may have, and their sizes in bytes."""
_LENGTH: Final = struct.Struct("<Q")
_MAX_HEADER: Final = 100 * 2**20  # safetensors' own limit


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message names the file, and the field or tensor, at fault."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as its file's header describes it."""

    file: Path
    dtype: str
    """The safetensors dtype (``"F32"``, ``"BF16"``, ...)."""
    shape: tuple[int, ...]


def read_json(path: Path) -> dict[str, object]:
    """The JSON object in ``path``.

    Raises:
        CheckpointError: the file is missing, unreadable, not JSON, or not an object.
    """
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    return _object(text, f"{path}: ")


def _object(raw: bytes, where: str) -> dict[str, object]:
    """``raw`` as a JSON object; ``where`` begins a refusal."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{where}not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}a JSON {type(value).__name__}, not an object")
    return value


def tensor_table(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``directory``, by name, from the safetensors headers alone.

    With ``model.safetensors.index.json``, the files its ``weight_map`` names (each
    tensor must be in the file the map says); without it, every ``*.safetensors``
    file of the directory (a name in two files is refused).

    Raises:
        CheckpointError: no weights file, a bad index, a missing file, a corrupt or
            truncated header, or a tensor that lies past its file's end (the message
            names the file and the tensor).
    """
    index = directory / INDEX
    if index.exists():
        return _indexed(index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file (and no {INDEX})")
    table: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in _header(file).items():
            if name in table:
                raise CheckpointError(f"{file}: tensor {name!r} is also in {table[name].file.name}")
            table[name] = entry
    return table


def _indexed(index: Path) -> dict[str, TensorEntry]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map each tensor's name to its file's name")
    headers: dict[str, dict[str, TensorEntry]] = {}
    table: dict[str, TensorEntry] = {}
    for name, file_name in weight_map.items():
        file = index.parent / file_name
        if Path(file_name).name != file_name:
            raise CheckpointError(f"{index}: tensor {name!r} is mapped to {file_name!r}, not a file of the directory")
        if file_name not in headers:
            if not file.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} is in {file_name}, which does not exist")
            headers[file_name] = _header(file)
        entry = headers[file_name].get(name)
        if entry is None:
            raise CheckpointError(f"{file}: has no tensor {name!r}, which {INDEX} places there")
        table[name] = entry
    return table


def _header(file: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file's header describes, each checked to lie inside the file."""
    try:
        with file.open("rb") as stream:
            size = file.stat().st_size
            prefix = stream.read(_LENGTH.size)
            if len(prefix) < _LENGTH.size:
                raise CheckpointError(f"{file}: truncated: {size} bytes, less than the 8-byte header length")
            (length,) = _LENGTH.unpack(prefix)
            if length > min(_MAX_HEADER, size - _LENGTH.size):
                raise CheckpointError(
                    f"{file}: corrupt or truncated: its header length is {length} bytes, the file has {size}"
                )
            raw = stream.read(length)
    except OSError as error:
        raise CheckpointError(f"{file}: cannot be read ({error.strerror or error})") from None
    header = _object(raw, f"{file}: corrupt header: ")
    data = size - _LENGTH.size - length
    return {name: _entry(file, name, fields, data) for name, fields in header.items() if name != "__metadata__"}


def _entry(file: Path, name: str, fields: object, data: int) -> TensorEntry:
    if not isinstance(fields, dict):
        raise CheckpointError(f"{file}: corrupt: the header's entry for {name!r} is not an object")
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if not isinstance(dtype, str) or not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise CheckpointError(f"{file}: corrupt: tensor {name!r} lacks a dtype, a shape or two data offsets")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{file}: corrupt: tensor {name!r} has data offsets {offsets}")
    if end > data:
        raise CheckpointError(
            f"{file}: truncated: tensor {name!r} needs bytes {begin} .. {end} of the data, the file has {data}"
        )
    if dtype in DTYPE_SIZES and end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise CheckpointError(
            f"{file}: corrupt: tensor {name!r} ({dtype}, shape {shape}) spans {end - begin} bytes, "
            f"not {math.prod(shape) * DTYPE_SIZES[dtype]}"
        )
    return TensorEntry(file, dtype, tuple(shape))


def _ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)
