"""Token arrays as u32 buffers: one conversion, at C speed, checked before sending."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Final

from typing_extensions import Buffer

from ._words import check_u32

U32_TYPECODE: Final[str] = next(code for code in "IL" if array(code).itemsize == 4)
"""The ``array`` typecode whose items are u32 on this platform."""

_NATIVE_ORDER: Final[str] = "<" if sys.byteorder == "little" else ">"
_U32_FORMATS: Final[frozenset[str]] = frozenset(
    prefix + code for prefix in ("", "@", "=", _NATIVE_ORDER) for code in "IL"
)
_INT_FORMATS: Final[str] = "bBhHiIlLqQnN"


def as_u32_buffer(name: str, tokens: Sequence[int] | Buffer) -> Buffer:
    """Return ``tokens`` as a C-contiguous buffer of native u32 items.

    An ``array('I')`` or a writable contiguous u32 buffer (numpy ``uint32``, a
    ``memoryview``) is returned without copying; a list, a tuple, another sequence of
    ints or a buffer of another integer type is converted once, in C.  ``bool``
    elements count as 0 and 1, as in ``array``.

    Raises:
        TypeError: an element is not an int, or the buffer does not hold integers.
        ValueError: an element is outside the u32 range, or the buffer is not 1-D.
    """
    if isinstance(tokens, array) and tokens.typecode == U32_TYPECODE:
        return tokens
    if isinstance(tokens, (list, tuple)):
        return _to_array(name, tokens)
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]  # a Sequence may be a buffer too
    except TypeError:
        return _to_array(name, tokens)  # type: ignore[arg-type]  # not a buffer: a sequence
    if view.ndim != 1:
        raise ValueError(f"{name} must be a 1-D token array, got a {view.ndim}-D buffer")
    if view.format in _U32_FORMATS and view.itemsize == 4 and view.c_contiguous:
        # Read-only memory is copied once so that backends may wrap it writable.
        return view if not view.readonly else array(U32_TYPECODE, view.tobytes())
    if view.format.lstrip("@=<>!") not in _INT_FORMATS:
        raise TypeError(
            f"{name} must hold integers, got a buffer of format {view.format!r}"
        )
    return _to_array(name, view.tolist())


def writable_u32_buffer(name: str, tokens: Buffer) -> memoryview:
    """``tokens`` as a memoryview that a receive may write u32 items into, in place.

    Raises:
        TypeError: ``tokens`` exposes no buffer, or not one of u32 items.
        ValueError: the buffer is read-only, not 1-D or not C-contiguous.
    """
    try:
        view = memoryview(tokens)
    except TypeError:
        raise TypeError(
            f"{name} must be a writable u32 buffer (array('I'), numpy uint32), got {type(tokens).__name__}"
        ) from None
    if view.format not in _U32_FORMATS or view.itemsize != 4:
        raise TypeError(f"{name} must hold u32 items, got a buffer of format {view.format!r}")
    if view.readonly or view.ndim != 1 or not view.c_contiguous:
        raise ValueError(f"{name} must be a writable, 1-D, C-contiguous buffer")
    return view


def token_count(tokens: Sequence[int] | Buffer) -> int:
    """Number of tokens in ``tokens`` (a sequence or a 1-D buffer), without copying."""
    if isinstance(tokens, Sequence):
        return len(tokens)
    return len(memoryview(tokens))


def _to_array(name: str, tokens: Sequence[int]) -> array[int]:
    try:
        return array(U32_TYPECODE, tokens)
    except (OverflowError, TypeError) as error:
        for index, token in enumerate(tokens):
            if not isinstance(token, bool):
                check_u32(f"{name}[{index}]", token)
        raise TypeError(f"{name} is not a u32 token array: {error}") from error
