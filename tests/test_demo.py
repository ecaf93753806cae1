"""The main job, ``python -m metrale_model_engine.demo``, run as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine.demo import digests_disagree, parse_args
from metrale_model_engine.torch import free_port

pytestmark = pytest.mark.torch


def run_bounded(command: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; on timeout kill the whole session (its ranks too)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "metrale_model_engine.demo", *args])


@pytest.mark.parametrize(
    "args", [(), ("--world-size", "3", "--protocol", "v2", "--sequences", "3", "--decode-steps", "2")]
)
def test_demo_runs_and_every_rank_agrees(args: tuple[str, ...]) -> None:
    result = demo(*args)
    assert result.returncode == 0, result.stderr
    world_size = int(args[1]) if args else 2
    lines = result.stdout.splitlines()
    digests = {line.split()[-1] for line in lines if "slot digest" in line}
    assert len(digests) == 1 and sum("slot digest" in line for line in lines) == world_size
    assert f"all {world_size} ranks agree" in lines
    assert any(line.startswith("[head] decode step") for line in lines)


def test_demo_refuses_bad_arguments() -> None:
    result = demo("--world-size", "0")
    assert result.returncode == 2
    assert "--world-size: must be at least 1, got 0" in result.stderr


def test_digest_check() -> None:
    assert digests_disagree(["a", "a", "a"]) is None
    assert digests_disagree(["a", "b", "a"]) == "the ranks' slot states differ: rank 1 has b, rank 0 has a"


def test_protocol_flag() -> None:
    assert parse_args(["--protocol", "v2"]).protocol == "v2"
    with pytest.raises(SystemExit):
        parse_args(["--protocol", "v3"])


def test_demo_runs_under_torchrun() -> None:
    result = run_bounded(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "metrale_model_engine.demo",
            "--protocol",
            "v2",
            "--decode-steps",
            "2",
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "all 2 ranks agree" in result.stdout.splitlines()
