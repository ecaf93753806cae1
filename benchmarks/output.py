"""Where a benchmark's figures go: JSON always, a PNG when matplotlib (the ``bench`` extra) is installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/out")
"""Where a run writes unless ``--out`` says otherwise: ignored by git, so a smoke run never replaces the
committed figures under ``docs/`` (pass ``--out docs`` to refresh those on purpose)."""


def plotting_available() -> bool:
    """Whether a PNG can be drawn; if not, say so at the start of the run, not after it."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print("matplotlib is not installed (pip install -e '.[bench]'): the figures go to JSON only", file=sys.stderr)
    return False


def say_written(*paths: Path) -> None:
    """One line naming what the run wrote."""
    print("wrote " + " and ".join(str(path) for path in paths))
