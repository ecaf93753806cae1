"""The torch backend's checks that need no second process, and encoding properties."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
numpy = pytest.importorskip("numpy", reason="numpy is needed by torch's tensor.numpy()")

from metrale_model_engine.torch import run_group  # noqa: E402

from helpers import torch_sessions as sessions  # noqa: E402

pytestmark = pytest.mark.torch


def _session_digests(backend: str, device: str | None, out: Path) -> list[object]:
    codes = run_group(sessions.full_session_on, 2, "v2", device, str(out), backend=backend, timeout=300)
    assert codes == [0, 0]
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes())["digest"] for r in range(2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine")
def test_cuda_tensors_over_gloo(tmp_path: Path) -> None:
    digests = _session_digests("gloo", "cuda:0", tmp_path)
    assert digests[0] == digests[1]


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs 2 CUDA devices for 2 ranks; this machine has fewer"
)
def test_nccl_full_session(tmp_path: Path) -> None:
    digests = _session_digests("nccl", None, tmp_path)
    assert digests[0] == digests[1]
