"""``python -m metrale_model_engine.serve``: see the package."""

from __future__ import annotations

from . import script

script()
