"""The demo started by hand in the test process: none of torchrun's variables, whatever ran pytest."""

from __future__ import annotations

import pytest

from metrale_model_engine._demo.choices import TORCHRUN_VARS


def leave_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset torchrun's variables for the test (``demo.main`` would take itself for a torchrun rank)."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
