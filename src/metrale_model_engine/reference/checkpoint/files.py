"""The files of a checkpoint directory in the Hugging Face layout, read and checked without reading a weight.

A directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` naming each tensor's file when there are several),
and optionally ``generation_config.json`` and ``tokenizer.json``.  ``tensor_table``
reads the safetensors headers alone, through ``safetensors``' ``safe_open``, which
checks each (its length, its JSON, every tensor's dtype, shape and place in the file),
so a truncated or corrupt file is named before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from safetensors import SafetensorError, safe_open

INDEX: Final = "model.safetensors.index.json"


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
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def tensor_table(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``directory``, by name, from the safetensors headers alone.

    With ``model.safetensors.index.json``, the files its ``weight_map`` names (each
    tensor must be in the file the map says); without it, every ``*.safetensors``
    file of the directory (a name in two files is refused).

    Raises:
        CheckpointError: no weights file, a bad index, a missing or unreadable file, or one that
            ``safe_open`` refuses: a truncated file, or a corrupt header (the message names the file,
            and the tensor where the index is at fault).
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
    """The tensors of a safetensors file, as ``safe_open`` reads its header (and checks it: no weight is read)."""
    try:
        with safe_open(str(file), framework="pt") as opened:
            return {name: _entry(file, opened.get_slice(name)) for name in opened.keys()}  # noqa: SIM118  (no __iter__)
    except SafetensorError as error:
        raise CheckpointError(_refusal(file, str(error).removeprefix("Error while deserializing header: "))) from None
    except OSError as error:
        raise CheckpointError(f"{file}: cannot be read ({error.strerror or error})") from None


def _entry(file: Path, part: Any) -> TensorEntry:
    """A tensor's entry from its slice in ``safe_open`` (which safetensors leaves untyped)."""
    return TensorEntry(file, str(part.get_dtype()), tuple(int(size) for size in part.get_shape()))


def _refusal(file: Path, reason: str) -> str:
    """``safe_open``'s ``reason`` for refusing ``file``, in this reader's words: truncated or corrupt, and how."""
    try:
        size = file.stat().st_size
        with file.open("rb") as stream:
            length = int.from_bytes(stream.read(8), "little")  # the header's length, to name the one refused
    except OSError as error:
        return f"{file}: cannot be read ({error.strerror or error})"
    if reason.startswith("header too small"):
        return f"{file}: truncated: {size} bytes, less than the 8-byte header length"
    if reason.startswith(("header too large", "invalid header length")):
        return f"{file}: corrupt or truncated: its header length is {length} bytes, the file has {size}"
    if reason.startswith("incomplete metadata"):
        return f"{file}: truncated: tensor data does not end where its header says (the file has {size} bytes)"
    if reason.startswith(("invalid JSON in header: ", "invalid UTF-8 in header: ")):
        return f"{file}: corrupt header: not valid JSON ({reason.partition(': ')[2]})"
    return f"{file}: corrupt: {reason}"
