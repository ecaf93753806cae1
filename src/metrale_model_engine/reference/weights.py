"""The weights file of the reference model: a small safetensors-like format, read without pickle.

Layout (every integer little-endian)::

    magic     8 bytes   b"MTRLREF\\0"
    version   u32       1
    length    u64       of the header, in bytes
    header    JSON      UTF-8, padded with spaces so that the data starts at a multiple of 8
    data      the tensors' bytes, little-endian, back to back in the header's order, to the end of the file

The header is ``{"config": {<LmConfig fields>}, "tensors": [{"name", "dtype",
"shape", "offset", "length"}, ...]}``, offsets counted from the start of the data.
A file holds exactly the full state of its config (:func:`~.model.state_shapes`).
Tensors are read with ``torch.frombuffer`` and copied; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import torch

from .._core.namespace import PublicDir, public_dir
from .config import LmConfig, check_state, state_shapes

__all__ = ["FORMAT_VERSION", "MAGIC", "SHIPPED_WEIGHTS", "load_weights", "read_config", "save_weights"]


__dir__: PublicDir = public_dir(globals(), __all__)


MAGIC: Final[bytes] = b"MTRLREF\0"
FORMAT_VERSION: Final[int] = 1
SHIPPED_WEIGHTS: Final[Path] = Path(__file__).with_name("tiny_moe.weights")
"""The trained weights that ship with the package (``scripts/train_reference.py`` writes them)."""

_PREAMBLE: Final = struct.Struct("<8sIQ")  # magic, version, header length
_ALIGN: Final[int] = 8
_DTYPES: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_ENTRY_KEYS: Final[frozenset[str]] = frozenset({"name", "dtype", "shape", "offset", "length"})


def save_weights(
    path: str | os.PathLike[str],
    config: LmConfig,
    state: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write ``config`` and the full ``state`` to ``path``, the tensors converted to ``dtype``.

    The same arguments always give the same bytes.  The file is written beside
    ``path`` and renamed over it, so a reader never sees half a file.

    Raises:
        ValueError: ``dtype`` is not bfloat16, float16 or float32, or ``state`` is not
            the full state of ``config`` (:func:`~.model.check_state`).
    """
    dtype_name = next((name for name, known in _DTYPES.items() if known == dtype), None)
    if dtype_name is None:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
    shapes = state_shapes(config)
    check_state(state, shapes)
    entries: list[dict[str, object]] = []
    chunks: list[bytes] = []
    offset = 0
    for name in shapes:
        data = _to_little_endian_bytes(state[name].detach().to(device="cpu", dtype=dtype).contiguous())
        entries.append({"name": name, "dtype": dtype_name, "shape": list(shapes[name]), "offset": offset})
        entries[-1]["length"] = len(data)
        chunks.append(data)
        offset += len(data)
    header = json.dumps({"config": dataclasses.asdict(config), "tensors": entries}, separators=(",", ":")).encode()
    header += b" " * (-(_PREAMBLE.size + len(header)) % _ALIGN)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as file:
        file.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)))
        file.write(header)
        for chunk in chunks:
            file.write(chunk)
    os.replace(partial, target)


def load_weights(
    path: str | os.PathLike[str] | None = None, *, dtype: torch.dtype = torch.float32
) -> tuple[LmConfig, dict[str, torch.Tensor]]:
    """Read a weights file: its config and full state, as CPU tensors of ``dtype`` that the caller owns.

    Args:
        path: the file; ``None`` reads :data:`SHIPPED_WEIGHTS`.
        dtype: of the returned tensors.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not a valid weights file; the message names the file
            and the problem (magic, version, truncation, header, config, a tensor's
            name, dtype, shape, place or values).
    """
    source = SHIPPED_WEIGHTS if path is None else Path(path)
    raw = bytearray(source.read_bytes())  # writable, so torch.frombuffer does not warn
    try:
        return _parse(raw, dtype)
    except _BadFile as problem:
        raise ValueError(f"{source}: {problem}") from None


def read_config(path: str | os.PathLike[str] | None = None) -> LmConfig:
    """The config of a weights file (``None``: :data:`SHIPPED_WEIGHTS`), reading its header only.

    Raises:
        OSError, ValueError: as :func:`load_weights`, for the preamble and the header.
    """
    source = SHIPPED_WEIGHTS if path is None else Path(path)
    with source.open("rb") as file:
        preamble = file.read(_PREAMBLE.size)
        try:
            header_length = _check_preamble(preamble)
            return _parse_config(_parse_header(_read_header(file.read(header_length), header_length)).get("config"))
        except _BadFile as problem:
            raise ValueError(f"{source}: {problem}") from None


class _BadFile(Exception):
    """A problem with the file's contents; :func:`load_weights` adds the file's name."""


def _check_preamble(raw: bytes | bytearray) -> int:
    """The header's length, once the preamble at the start of ``raw`` is checked."""
    if len(raw) < _PREAMBLE.size:
        raise _BadFile(f"truncated: {len(raw)} bytes, less than the {_PREAMBLE.size}-byte preamble")
    magic, version, header_length = _PREAMBLE.unpack_from(raw)
    if magic != MAGIC:
        raise _BadFile(f"not a reference weights file: it starts with {bytes(magic)!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise _BadFile(f"format version {version} is not supported (this reader knows version {FORMAT_VERSION})")
    length: int = header_length
    return length


def _read_header(text: bytes, length: int) -> bytes:
    if len(text) < length:
        raise _BadFile(f"truncated: the header needs {length} bytes, the file has {len(text)}")
    return text


def _parse(raw: bytearray, dtype: torch.dtype) -> tuple[LmConfig, dict[str, torch.Tensor]]:
    header_length = _check_preamble(raw)
    data_start = _PREAMBLE.size + header_length
    header = _parse_header(_read_header(bytes(raw[_PREAMBLE.size : data_start]), header_length))
    config = _parse_config(header.get("config"))
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise _BadFile("the header's 'tensors' is not a list")
    shapes = state_shapes(config)
    data = memoryview(raw)[data_start:]
    state: dict[str, torch.Tensor] = {}
    offset = 0
    for entry in entries:
        name, tensor_dtype, length = _check_entry(entry, shapes, state, offset, len(data))
        tensor = torch.frombuffer(data, dtype=tensor_dtype, count=length // tensor_dtype.itemsize, offset=offset)
        tensor = _from_little_endian(tensor).reshape(shapes[name]).to(dtype=dtype, copy=True)
        if not bool(torch.isfinite(tensor).all()):
            raise _BadFile(f"tensor {name!r} holds non-finite values")
        state[name] = tensor
        offset += length
    missing = [name for name in shapes if name not in state]
    if missing:
        raise _BadFile(f"tensors missing for the config: {missing}")
    if offset != len(data):
        raise _BadFile(f"{len(data) - offset} bytes follow the last tensor")
    return config, state


def _parse_header(text: bytes) -> dict[str, object]:
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _BadFile(f"the header is not UTF-8 JSON ({error})") from None
    if not isinstance(header, dict):
        raise _BadFile(f"the header is a JSON {type(header).__name__}, not an object")
    return header


def _parse_config(fields: object) -> LmConfig:
    if not isinstance(fields, dict):
        raise _BadFile("the header's 'config' is not an object")
    known = {field.name for field in dataclasses.fields(LmConfig)}
    if fields.keys() != known:
        raise _BadFile(
            f"the config's fields differ from LmConfig's: missing {sorted(known - fields.keys())}, "
            f"unknown {sorted(fields.keys() - known)}"
        )
    try:
        return LmConfig(**fields)
    except (TypeError, ValueError) as error:
        raise _BadFile(f"bad config: {error}") from None


def _check_entry(
    entry: object, shapes: Mapping[str, tuple[int, ...]], seen: Mapping[str, torch.Tensor], offset: int, size: int
) -> tuple[str, torch.dtype, int]:
    """Check one header entry against the config and the layout so far; returns name, dtype and byte length."""
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        raise _BadFile(f"a tensor entry must be an object with keys {sorted(_ENTRY_KEYS)}, got {entry!r:.120}")
    name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or name not in shapes:
        raise _BadFile(f"unexpected tensor {name!r} (the config has no such weight)")
    if name in seen:
        raise _BadFile(f"tensor {name!r} appears twice")
    if dtype_name not in _DTYPES:
        raise _BadFile(f"tensor {name!r} has dtype {dtype_name!r}; supported: {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or tuple(shape) != shapes[name]:
        raise _BadFile(f"tensor {name!r} has shape {shape!r}, the config needs {list(shapes[name])}")
    dtype = _DTYPES[dtype_name]
    length = math.prod(shapes[name]) * dtype.itemsize
    if entry["length"] != length:
        raise _BadFile(f"tensor {name!r} has length {entry['length']!r}, its dtype and shape need {length}")
    if entry["offset"] != offset:
        raise _BadFile(f"tensor {name!r} starts at {entry['offset']!r}; it must follow the previous one, at {offset}")
    if offset + length > size:
        raise _BadFile(f"truncated: tensor {name!r} needs bytes {offset} .. {offset + length} of {size} data bytes")
    return name, dtype, length


def _to_little_endian_bytes(tensor: torch.Tensor) -> bytes:
    raw = tensor.reshape(-1).view(torch.uint8)
    if sys.byteorder == "big":
        raw = raw.view(-1, tensor.element_size()).flip(-1).reshape(-1)
    return raw.numpy().tobytes()


def _from_little_endian(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` read from little-endian bytes, in this machine's order."""
    if sys.byteorder == "little":
        return tensor
    swapped = tensor.view(torch.uint8).view(-1, tensor.element_size()).flip(-1).contiguous()
    return swapped.view(tensor.dtype).reshape(tensor.shape)
