"""Argument checks and the "ranks disagree" message: one validator per kind of argument, one wording.

A wrong type is a ``TypeError``, a wrong value of the right type a ``ValueError``;
every message names the argument, what it must be, and what it got.  ``bool`` is
never a number here.  (u32 words have their own policy in ``_core.words``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import NoReturn, TypeVar

T = TypeVar("T")


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` in ``low ..= high`` (no upper bound when ``None``), else raise."""
    wanted = f"an int in {low} ..= {high}" if high is not None else f"an int >= {low}"
    if type(value) is not int:
        _refuse(name, value, wanted, right_type=False)
    if value < low or (high is not None and value > high):
        _refuse(name, value, wanted, right_type=True)
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool = False, allow_none: bool = False) -> float | None:
    """Return ``value`` as a float if it is a finite number of seconds (``> 0``, or ``>= 0``), else raise.

    ``None`` is accepted (and returned) only with ``allow_none``.
    """
    if value is None and allow_none:
        return None
    bound = ">= 0" if allow_zero else "> 0"
    wanted = f"a finite number of seconds {bound}" + (" or None" if allow_none else "")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _refuse(name, value, wanted, right_type=False)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        _refuse(name, value, wanted, right_type=True)
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``, else raise ``TypeError``."""
    if not isinstance(value, bool):
        _refuse(name, value, "a bool", right_type=False)
    return value


def check_choice(name: str, value: object, choices: Sequence[T]) -> T:
    """Return the choice equal to ``value`` (a ``str`` compared as is), else raise.

    ``TypeError`` when ``value`` is not of the choices' type, ``ValueError`` when it
    is none of them; the message lists the accepted values.
    """
    kind = type(choices[0])
    accepted = ", ".join(repr(choice) for choice in choices)
    if not isinstance(value, kind):
        _refuse(name, value, f"one of {accepted}", right_type=False)
    for choice in choices:
        if choice == value:
            return choice
    _refuse(name, value, f"one of {accepted}", right_type=True)


def check_instance(name: str, value: object, kind: type[T], wanted: str) -> T:
    """Return ``value`` if it is an instance of ``kind``, else raise ``TypeError`` saying ``wanted``."""
    if not isinstance(value, kind):
        _refuse(name, value, wanted, right_type=False)
    return value


def check_slot(seq_id: int, slots: Sized) -> None:
    """Raise unless ``seq_id`` is an ``int`` that indexes ``slots`` (``0 <= seq_id < len(slots)``).

    The worker-side bound of every command, checked before the model's hook runs,
    and a head method's check of its slot argument.

    Raises:
        TypeError: ``seq_id`` is not an ``int`` (``bool`` included).
        IndexError: it is out of range.
    """
    if type(seq_id) is not int and (isinstance(seq_id, bool) or not isinstance(seq_id, int)):
        raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__} {seq_id!r}")
    if not 0 <= seq_id < len(slots):
        raise IndexError(f"seq_id={seq_id} is out of range for {len(slots)} slots")


def disagreement(rank: int, what: str, values: Sequence[T], shown: Callable[[T], str] = str) -> str | None:
    """``None`` when every rank has the same value, else the message that lists each rank's.

    ``values`` are by rank; ``what`` names the field ("protocol", "slot count").
    """
    differ = ranks_disagree({f"the {what}": values}, shown)
    return None if differ is None else f"rank {rank}: {differ}; every rank must use the same value"


def ranks_disagree(values: Mapping[str, Sequence[T]], shown: Callable[[T], str] = str) -> str | None:
    """``None`` when every rank has the same value of each name, else the one wording of a disagreement.

    ``"the ranks disagree on NAME (rank 0: a, rank 1: b); OTHER (...)"``, naming each
    value that differs (``values[name]`` by rank) with every rank's.
    """
    mismatches = [
        f"{name} ({', '.join(f'rank {r}: {shown(v)}' for r, v in enumerate(column))})"
        for name, column in values.items()
        if len(set(column)) > 1
    ]
    return f"the ranks disagree on {'; '.join(mismatches)}" if mismatches else None


def _refuse(name: str, value: object, wanted: str, *, right_type: bool) -> NoReturn:
    error = ValueError if right_type else TypeError
    raise error(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
