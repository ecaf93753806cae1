"""``config.json``'s fields, each read once, typed, and every one accounted for.

A family's reader (``mixtral``, ``qwen3_moe``) takes the fields it honours
from a ``ConfigFields``, refuses the values it does not implement
(``ConfigFields.refuse``), and names the fields that do not change the
arithmetic of inference; ``ConfigFields.finish`` then refuses any field left
over, so that nothing in a config is silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Final, NoReturn, TypeVar

from .files import CheckpointError

_T = TypeVar("_T")


class Missing:
    """The type of ``REQUIRED``."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final = Missing()
"""A default that says the field must be present."""


class ConfigFields:
    """The fields of ``path`` (``config.json``), read one by one; each error names the file and the field."""

    def __init__(self, path: Path, values: dict[str, object]) -> None:
        self.path = path
        self._values = values
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        """Whether the field is present and not ``null``."""
        return self._values.get(name) is not None

    def value(self, name: str) -> object:
        """The field's raw value (``None`` if absent), now accounted for."""
        self._read.add(name)
        return self._values.get(name)

    def integer(self, name: str, default: int | Missing = REQUIRED, *, least: int = 1) -> int:
        """An int field, at least ``least`` (``null`` or absent: ``default``)."""
        value = self.value(name)
        if value is None:
            return self._default(name, default)
        if type(value) is not int:
            self.wrong(name, value, "must be an int")
        if value < least:
            self.wrong(name, value, f"must be at least {least}")
        return value

    def number(self, name: str, default: float | Missing = REQUIRED) -> float:
        """A positive, finite number field (``null`` or absent: ``default``)."""
        value = self.value(name)
        if value is None:
            return self._default(name, default)
        if type(value) not in (int, float):
            self.wrong(name, value, "must be a number")
        assert isinstance(value, (int, float))
        if not 0 < value < math.inf:
            self.wrong(name, value, "must be positive and finite")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        """A boolean field (``null`` or absent: ``default``)."""
        value = self.value(name)
        if value is None:
            return default
        if type(value) is not bool:
            self.wrong(name, value, "must be true or false")
        return value

    def text(self, name: str, default: str | Missing = REQUIRED) -> str:
        """A string field (``null`` or absent: ``default``)."""
        value = self.value(name)
        if value is None:
            return self._default(name, default)
        if not isinstance(value, str):
            self.wrong(name, value, "must be a string")
        return value

    def wrong(self, name: str, value: object, must: str) -> NoReturn:
        """Refuse a field whose value has the wrong type or range."""
        raise CheckpointError(f"{self.path}: {name!r} {must}, got {value!r:.80}")

    def refuse(self, name: str, why: str) -> NoReturn:
        """Refuse a field whose value this implementation does not honour; ``why`` says what it would need."""
        raise CheckpointError(f"{self.path}: {name}={self._values.get(name)!r:.80} is not supported: {why}")

    def finish(self, harmless: Collection[str]) -> None:
        """Refuse the first field neither read nor ``harmless`` (known not to change inference)."""
        for name in sorted(self._values.keys() - self._read - set(harmless)):
            if self._values[name] is not None:
                raise CheckpointError(
                    f"{self.path}: field {name!r} is not supported (it may change the model's arithmetic, "
                    f"and this implementation does not read it)"
                )

    def _default(self, name: str, default: _T | Missing) -> _T:
        if isinstance(default, Missing):
            raise CheckpointError(f"{self.path}: the field {name!r} is missing")
        return default
