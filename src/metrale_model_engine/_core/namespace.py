"""What ``dir()`` of a public module shows: its ``__all__``, its dunders and its public submodules."""

from __future__ import annotations

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
