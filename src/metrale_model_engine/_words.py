"""u32 command words: their bounds, the words the protocol reserves, and the one check.

Every word that crosses the wire (a command, a ``seq_id``, a follow-up word, a
token) is an unsigned 32-bit integer.  :func:`check_u32` is the single place that
decides whether a Python value is one, and the single place that words the error.
"""

from __future__ import annotations

from typing import Final

U32_MIN: Final[int] = 0
"""Smallest u32 word."""

U32_MAX: Final[int] = 0xFFFF_FFFF
"""Largest u32 word."""

CMD_SHUTDOWN: Final[int] = 0xFFFF_FFFF
"""Reserved command word: the head tells every worker to leave its loop.

A header carrying it makes ``ep_worker_step`` return ``False``; its ``seq_id``
(under protocol v2) is ignored.  Models must not use it for a command of their own.
"""

U32_RANGE_TEXT: Final[str] = "0 ..= 4294967295 (0xFFFFFFFF)"


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
