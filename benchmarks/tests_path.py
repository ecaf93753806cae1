"""Puts ``tests/`` on the path, once imported: the benchmarks measure with the tests' helpers (``helpers.usage``).

One copy of each instrument serves both, and the package holds none of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
