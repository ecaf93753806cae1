"""The demo served by 1, 2 and 4 ranks started from this process (``demo.main``; its ranks fork from the
start server), compared by their JSON summaries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine.demo import main

from helpers.demo_env import leave_torchrun

pytestmark = pytest.mark.torch

SHORT = ("--max-new-tokens", "12")


@pytest.fixture(autouse=True)
def as_started_by_hand(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Not under torchrun; this process's torch threads as they were (a one-rank demo sets them)."""
    leave_torchrun(monkeypatch)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def served(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """Run the demo with ``args``; it must exit 0; its summary."""
    path = tmp_path / f"{name}.json"
    assert main([*args, "--json", str(path)]) == 0
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default run (2 ranks over shared memory), short: what every other world size must generate."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        leave_torchrun(monkeypatch)
        return served(tmp_path_factory.mktemp("demo"), "two", *SHORT)


@pytest.mark.parametrize(
    ("args", "transport"),
    [
        (("--world-size", "1"), "SoloTransport"),
        (("--world-size", "4", "--transport", "torch", "--protocol", "v2"), "TorchTransport"),
    ],
)
def test_every_world_size_generates_the_same_text(
    args: tuple[str, ...],
    transport: str,
    two_ranks: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert two_ranks["transport"] == "ShmTransport"
    summary = served(tmp_path, "other", *args, *SHORT)
    assert summary["transport"] == transport
    assert summary["requests"] == two_ranks["requests"]
    if transport == "SoloTransport":
        out = capfd.readouterr().out
        assert "[head] one rank: the single-GPU path, no command sent (is_ep() is false)" in out
        assert "1 rank," in out


def test_a_request_cut_short_by_its_slot_says_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    summary = served(tmp_path, "cut", "--max-new-tokens", "240", "--world-size", "1")
    cut = [
        line for line in capfd.readouterr().out.splitlines() if line.endswith("(cut short: its slot's cache is full)")
    ]
    reasons = {request["id"]: request["finish_reason"] for request in summary["requests"]}
    assert set(reasons.values()) == {"context"} and len(cut) == len(reasons) == 6  # every prompt + 240 > 256
    assert all(len(r["tokens"]) < 240 for r in summary["requests"])
