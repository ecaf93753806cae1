"""Token arrays as u32 buffers: one conversion, at C speed, checked before sending."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, Protocol, TypeAlias, Union

from typing_extensions import Buffer

from .words import U32_MAX, U32_TYPECODE, u32_array


class ArrayInterface(Protocol):
    """An object with numpy's array interface: numpy arrays, on every Python version.

    numpy's stubs declare the buffer protocol on arrays only from Python 3.12 on;
    this is how a numpy array type-checks as a token array before that.  At run
    time the library reads every token array through the buffer protocol.
    """

    @property
    def __array_interface__(self) -> dict[str, Any]: ...


TokenArray: TypeAlias = Union[Sequence[int], Buffer, ArrayInterface]  # noqa: UP007  (a run-time alias on 3.10)
"""A u32 token array: a sequence of ints or a buffer (``array('I')``, numpy)."""

_NATIVE_ORDER: Final[str] = "<" if sys.byteorder == "little" else ">"
_U32_FORMATS: Final[frozenset[str]] = frozenset(
    prefix + code for prefix in ("", "@", "=", _NATIVE_ORDER) for code in "IL"
)
_INT_FORMATS: Final[str] = "bBhHiIlLqQnN"
_FOREIGN_ORDERS: Final[tuple[str, ...]] = (">", "!") if sys.byteorder == "little" else ("<",)


def as_u32_buffer(name: str, tokens: TokenArray) -> Buffer:
    """Return ``tokens`` as a C-contiguous buffer of native u32 items.

    An ``array('I')`` or a writable contiguous u32 buffer (numpy ``uint32``, a
    ``memoryview``) is returned without copying; a list, a tuple, another sequence of
    ints or a buffer of another integer type is converted once, in C.  Elements are
    checked as [`check_u32`][metrale_model_engine.check_u32] checks a word: a ``bool`` is
    not a token (a buffer of booleans is not a buffer of integers).

    Raises:
        TypeError: an element is not an int (``bool`` included), or the buffer does
            not hold integers.
        ValueError: an element is outside the u32 range, or the buffer is not 1-D.
    """
    if isinstance(tokens, array) and tokens.typecode == U32_TYPECODE:
        return tokens
    if isinstance(tokens, (list, tuple)):
        return u32_array(name, tokens)
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]  # a Sequence or a numpy array may be a buffer
    except TypeError:
        if not isinstance(tokens, Sequence):
            raise TypeError(
                f"{name} must be a token array (a sequence of ints in 0 ..= {U32_MAX}, or a buffer of them), "
                f"got {type(tokens).__name__} {tokens!r}"
            ) from None
        return u32_array(name, tokens)  # not a buffer: a sequence
    if view.ndim != 1:
        raise ValueError(f"{name} must be a 1-D token array, got a {view.ndim}-D buffer")
    if view.format in _U32_FORMATS and view.itemsize == 4 and view.c_contiguous:
        # Read-only memory is copied once so that backends may wrap it writable.
        return _native(view) if not view.readonly else array(U32_TYPECODE, view.tobytes())
    order, code = view.format[:-1], view.format[-1:]
    if order not in ("", "@", "=", "<", ">", "!") or code not in _INT_FORMATS:
        raise TypeError(f"{name} must hold integers, got a buffer of format {view.format!r}")
    if order in _FOREIGN_ORDERS:
        return u32_array(name, _swapped(view))
    return u32_array(name, view.tolist())


def writable_u32_buffer(name: str, tokens: object) -> memoryview:
    """``tokens`` as a native-order u32 memoryview that a receive may write into, in place.

    Raises:
        TypeError: ``tokens`` exposes no buffer, or not one of native-order u32 items
            (the message names a foreign byte order).
        ValueError: the buffer is read-only, not 1-D or not C-contiguous.
    """
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]  # any object: TypeError below
    except TypeError:
        raise TypeError(
            f"{name} must be a writable u32 buffer (array('I'), numpy uint32), got {type(tokens).__name__}"
        ) from None
    if view.format[:1] in _FOREIGN_ORDERS:
        raise TypeError(
            f"{name} must hold u32 items in this machine's byte order ({sys.byteorder}-endian), "
            f"got a buffer of format {view.format!r} (byte order {view.format[0]!r}); "
            "receive into a native uint32 buffer and convert after"
        )
    if view.format not in _U32_FORMATS or view.itemsize != 4:
        raise TypeError(f"{name} must hold u32 items, got a buffer of format {view.format!r}")
    if view.readonly or view.ndim != 1 or not view.c_contiguous:
        raise ValueError(f"{name} must be a writable, 1-D, C-contiguous buffer")
    return _native(view)


def _native(view: memoryview) -> memoryview:
    """``view`` with the native u32 format code, so that views of it can be assigned."""
    if view.format == U32_TYPECODE:
        return view
    return view.cast("B").cast("I") if U32_TYPECODE == "I" else view.cast("B").cast("L")


def _swapped(view: memoryview) -> array[int]:
    """The integers of a buffer in the foreign byte order, as a native array (one copy)."""
    signed = view.format[-1].islower()
    code = next(c for c in ("bhilq" if signed else "BHILQ") if array(c).itemsize == view.itemsize)
    values = array(code, view.tobytes())
    values.byteswap()
    return values


def token_count(tokens: TokenArray) -> int:
    """Number of tokens in ``tokens`` (a sequence or a 1-D buffer), without copying."""
    if isinstance(tokens, Sequence):
        return len(tokens)
    return len(memoryview(tokens))  # type: ignore[arg-type]  # numpy arrays are buffers at run time
