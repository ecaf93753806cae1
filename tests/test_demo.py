"""The main job, ``python -m metrale_model_engine.demo``, run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    ("args", "transport"),
    [
        ((), "ShmTransport"),
        (("--world-size", "3", "--protocol", "v2", "--sequences", "3", "--decode-steps", "2"), "ShmTransport"),
        (("--world-size", "3", "--transport", "torch"), "TorchTransport"),
        (("--world-size", "2", "--transport", "shm"), "ShmTransport"),
    ],
)
def test_demo_runs_and_every_rank_agrees(args: tuple[str, ...], transport: str) -> None:
    result = demo(*args)
    assert result.returncode == 0, result.stderr
    world_size = int(args[1]) if args else 2
    lines = result.stdout.splitlines()
    assert any(line.endswith(f"({transport} over gloo)") for line in lines), lines
    digests = {line.split()[-1] for line in lines if "slot digest" in line}
    assert len(digests) == 1 and sum("slot digest" in line for line in lines) == world_size
    assert f"all {world_size} ranks agree" in lines
    assert any(line.startswith("[head] decode step") for line in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--world-size", "0"), "argument --world-size: must be at least 1, got 0"),
        (("--sequences", "many"), "argument --sequences: must be a whole number, got 'many'"),
        (("--transport", "tcp"), "argument --transport: invalid choice: 'tcp'"),
    ],
)
def test_demo_refuses_bad_arguments(args: tuple[str, ...], message: str) -> None:
    result = demo(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_demo_refuses_a_bad_protocol_variable_in_one_line() -> None:
    env = {**os.environ, "METRALE_EP_PROTOCOL": "garbage"}
    result = subprocess.run(
        [sys.executable, "-m", "metrale_model_engine.demo"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: METRALE_EP_PROTOCOL='garbage' is not a protocol version; accepted: 'v1', 'v2' (or unset/empty for 'v1')"
    ]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_demo_refuses_nccl_without_cuda() -> None:
    result = demo("--backend", "nccl")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --backend nccl needs a CUDA device, and this machine has none" in result.stderr


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


def test_a_large_run_stays_bounded_and_its_summary_adds_up(tmp_path: Path) -> None:
    sequences, prompt, steps = 1500, 5, 2
    summary_path = tmp_path / "summary.json"
    started = time.monotonic()
    result = demo(
        "--sequences", str(sequences), "--prompt-tokens", str(prompt), "--decode-steps", str(steps),
        "--json", str(summary_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < 150.0
    lines = result.stdout.splitlines()
    assert len(lines) < 60, f"{len(lines)} lines of output for {sequences} sequences"
    assert f"[head] alloc + prefill: {sequences}/{sequences}" in lines
    summary = json.loads(summary_path.read_text())
    # alloc + prefill per sequence, a decode per sequence and step, all but one freed
    assert summary["commands"] == 2 * sequences + sequences * steps + sequences - 1
    assert summary["words"] == sequences * steps  # one token word per decode
    assert summary["tokens"] == sequences * prompt
    assert (summary["transport"], summary["backend"], summary["ranks"]) == ("ShmTransport", "gloo", 2)
    latency = summary["command_latency_us"]
    assert 0 < latency["median"] <= latency["p99"]
    served = next(line for line in lines if line.startswith("[worker 1] served"))
    assert f"served {summary['commands']} commands, 0 failed" in served
    printed = next(line for line in lines if line.startswith("[head] summary:"))
    assert f"{summary['commands']} commands, {summary['words']} follow-up words, {summary['tokens']} tokens" in printed


def test_a_bad_protocol_variable_under_torchrun_is_reported_once_by_rank_0() -> None:
    env = {**os.environ, "METRALE_EP_PROTOCOL": "garbage"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "metrale_model_engine.demo"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=150)
    assert result.returncode != 0  # torchrun reports the ranks' exit code 2 as a failure of its own
    ours = [line for line in result.stderr.splitlines() if "METRALE_EP_PROTOCOL" in line]
    assert ours == [
        "error: METRALE_EP_PROTOCOL='garbage' is not a protocol version; accepted: 'v1', 'v2' (or unset/empty for 'v1')"
    ]
    assert "metrale_model_engine/" not in result.stderr  # no traceback from the ranks themselves
