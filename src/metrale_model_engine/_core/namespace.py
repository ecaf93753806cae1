"""What ``dir()`` of a public module shows (its ``__all__``, its dunders and its public submodules), and the names
a module gives on after they moved."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import TypeAlias

PublicDir: TypeAlias = Callable[[], list[str]]
"""The type of a module's ``__dir__``."""


def public_dir(namespace: Mapping[str, object], names: Iterable[str]) -> PublicDir:
    """A module's ``__dir__`` (PEP 562) for the module whose globals are ``namespace``.

    Its helpers (``annotations``, ``TYPE_CHECKING``, the modules it imports) stay
    usable but are not listed; its public submodules are, once imported.
    """
    listed = set(names)
    prefix = f"{namespace['__name__']}."

    def __dir__() -> list[str]:
        shown = set(listed)
        for name, value in namespace.items():
            submodule = isinstance(value, ModuleType) and value.__name__ == prefix + name and not name.startswith("_")
            if submodule or (name.startswith("__") and name.endswith("__")):
                shown.add(name)
        return sorted(shown)

    return __dir__


def moved_names(module: str, moved: Mapping[str, tuple[str, object]]) -> Callable[[str], object]:
    """A module's ``__getattr__`` (PEP 562) for the names that left it: ``moved`` maps each to its new home (a
    module's name) and its value, which it gives with a ``DeprecationWarning`` naming the home, until 0.3.

    Any other name raises ``AttributeError``, as for a module without one.
    """

    def __getattr__(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, value = moved[name]
        text = f"{module}.{name} is now {home}.{name}; the old name goes in 0.3"
        warnings.warn(text, DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
