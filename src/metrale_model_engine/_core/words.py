"""u32 words: their bounds, the word the protocol reserves, and the one policy for what a word is.

Every word that crosses the wire (a command, a ``seq_id``, a follow-up word, a
token) is an unsigned 32-bit integer.  [`check_u32`][metrale_model_engine.check_u32] decides for one value and
``u32_array`` for a sequence of them; both refuse ``bool`` and accept other
``int`` subclasses (an ``IntEnum`` of commands) as plain ``int``.  They are the only
places that decide, and the only places that word the error.
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Sequence
from typing import Final, Literal

U32_MIN: Final[int] = 0
"""Smallest u32 word."""

U32_MAX: Final[int] = 0xFFFF_FFFF
"""Largest u32 word."""

CMD_SHUTDOWN: Final[int] = 0xFFFF_FFFF
"""Reserved command word: the head tells every worker to leave its loop.

A header carrying it makes ``ep_worker_step`` return ``False``; its ``seq_id`` is
ignored.  Models must not use it for a command of their own.
"""

U32_RANGE_TEXT: Final[str] = "0 ..= 4294967295 (0xFFFFFFFF)"

U32_TYPECODE: Final[Literal["I", "L"]] = "I" if array("I").itemsize == 4 else "L"
"""The ``array`` typecode whose items are u32 on this platform."""


def check_u32(name: str, value: object) -> int:
    """Return ``value`` as an ``int`` if it is a u32 word, else raise.

    ``name`` is the argument's name, used in the message.  ``int`` subclasses other
    than ``bool`` (an ``IntEnum`` of command words, say) are accepted and returned as
    plain ``int``.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool``, ``float``, ``str``, ``None``...).
        ValueError: ``value`` is an ``int`` outside ``0 ..= 0xFFFFFFFF``.
    """
    # ``x >> 32`` is zero exactly for 0 <= x < 2**32 (negative ints shift to -1).
    # Hot callers inline the same two-test guard in front of this call; this
    # function stays the only place that accepts the rest or words the error.
    if type(value) is int and not value >> 32:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int in {U32_RANGE_TEXT}, got {type(value).__name__} {value!r}")
    if not U32_MIN <= value <= U32_MAX:
        raise ValueError(f"{name}={int(value)} is outside the u32 range {U32_RANGE_TEXT}")
    return int(value)


def u32_values(name: str, values: Sequence[int]) -> Sequence[int]:
    """``values`` if every item is a plain u32 ``int``, else a new list of them; raise for a bad item.

    Items are checked as [`check_u32`][metrale_model_engine.check_u32] checks one, in C.  First one ``marshal``
    pass (format version 2): it writes a plain ``int`` below 2**31 as exactly 5 bytes
    (``i``, then 4 little-endian bytes), a ``bool`` as 1 byte, a larger int as more,
    and refuses ``int`` subclasses; so every item is a plain int in
    ``0 ..= 2**31 - 1`` exactly when each item's first byte sits at ``5 + 5k`` and
    is ``i`` and each top byte is below 0x80.  Else one array conversion bounds the
    items and the set of their types catches ``bool`` (which the conversion takes)
    and subclasses (normalised to ``int``).  Only a failure walks the items in
    Python, to name the first bad one (``name[i]``).

    Raises:
        TypeError, ValueError: as [`check_u32`][metrale_model_engine.check_u32], for the first bad item.
    """
    if plain_small_ints(values):
        return values
    try:
        array(U32_TYPECODE, values)
        if set(map(type, values)) <= {int}:
            return values
    except (OverflowError, TypeError):
        pass
    return [check_u32(f"{name}[{i}]", value) for i, value in enumerate(values)]


def u32_array(name: str, values: Sequence[int]) -> array[int]:
    """``values`` as a new ``array('I')``, checked as ``u32_values`` checks them."""
    return array(U32_TYPECODE, u32_values(name, values))


def plain_small_ints(values: Sequence[object]) -> bool:
    """Whether ``values`` is a list or tuple of plain ``int`` in ``0 ..= 2**31 - 1`` (one marshal pass, in C).

    ``False`` for anything else (a ``bool``, an ``int`` subclass, a larger token):
    the careful checks then decide, and word the error.
    """
    if not isinstance(values, (list, tuple)):
        return False
    try:
        data = marshal.dumps(values, 2)  # version 2: no back-references, fixed 5-byte small ints
    except ValueError:  # an int subclass, or another object marshal does not take
        return False
    count = len(values)
    return len(data) == 5 + 5 * count and data[5::5] == b"i" * count and data[9::5].isascii()
