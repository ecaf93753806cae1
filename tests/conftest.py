"""What every test module shares: rank processes start from one server that imported torch once;
the shipped weights of the reference model, read once per module (``shipped``).

``run_group`` and ``run_ring`` spawn a fresh interpreter per rank by default, and each
imports torch (about a second on this project's 2-core machine).  In this process the
test suite has them fork from a start server instead (``start_ranks_from_a_server``):
about 0.05 s a group.  Programs the tests run as a user runs them (the demo, the
examples) are other processes and keep the default.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest

from metrale_model_engine._host.launch import start_ranks_from_a_server

if TYPE_CHECKING:
    import torch

    from metrale_model_engine.reference import LmConfig

start_ranks_from_a_server(
    ["metrale_model_engine.torch"] if importlib.util.find_spec("torch") is not None else ["metrale_model_engine.shm"]
)


@pytest.fixture(scope="module")
def shipped() -> tuple[LmConfig, dict[str, torch.Tensor]]:
    """The shipped weights: their config and full state, float32 CPU tensors (needs torch)."""
    from metrale_model_engine.reference import load_weights

    return load_weights()
