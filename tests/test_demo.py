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

from metrale_model_engine.demo import PROMPTS, main, parse_args
from metrale_model_engine.torch import free_port

pytestmark = [pytest.mark.torch, pytest.mark.programs]


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


def test_the_demo_serves_license_text_on_two_ranks_and_every_rank_agrees(tmp_path: Path) -> None:
    result = demo("--json", str(tmp_path / "two.json"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    served = [line for line in lines if line.startswith("[request ")]
    assert len(served) == len(PROMPTS) == 6
    assert "[request 0] 'Licensed under the' -> ' Apache License, Version 2.0" in result.stdout
    assert sum(", arrived after step 6]" in line for line in served) == 2  # the late ones
    assert any(line.startswith("[head] 6 requests, 288 tokens in ") and line.endswith(" tokens/s") for line in lines)
    step = next(line for line in lines if line.startswith("[head] a decode step"))
    assert "compute " in step and "collectives " in step and "protocol " in step
    assert "[head] all 2 ranks agree: KV bookkeeping compared at" in result.stdout
    assert any(line.startswith("[worker 1] served ") and line.endswith(" 0 failed") for line in lines)
    summary = json.loads((tmp_path / "two.json").read_text())
    assert (summary["ranks"], summary["transport"], summary["backend"]) == (2, "ShmTransport", "gloo")
    assert [r["id"] for r in summary["requests"]] == list(range(6))
    for request, prompt in zip(summary["requests"], PROMPTS, strict=True):
        assert request["prompt"] == prompt and len(request["tokens"]) == 48
        assert request["text"] == bytes(request["tokens"]).decode("utf-8", errors="replace")
    shares = summary["decode_step"]
    assert abs(shares["compute_share"] + shares["collectives_share"] + shares["protocol_share"] - 1) < 1e-3


@pytest.mark.parametrize(
    ("args", "transport"),
    [
        (("--world-size", "1"), "SoloTransport"),
        (("--world-size", "4", "--transport", "torch", "--protocol", "v2"), "TorchTransport"),
    ],
)
def test_every_world_size_generates_the_same_text(args: tuple[str, ...], transport: str, tmp_path: Path) -> None:
    short = ("--max-new-tokens", "12")
    two, other = tmp_path / "two.json", tmp_path / "other.json"
    assert demo(*short, "--json", str(two)).returncode == 0
    result = demo(*args, *short, "--json", str(other))
    assert result.returncode == 0, result.stderr
    summary = json.loads(other.read_text())
    assert summary["transport"] == transport
    assert summary["requests"] == json.loads(two.read_text())["requests"]
    if transport == "SoloTransport":
        assert "[head] one rank: the single-GPU path, no command sent (is_ep() is false)" in result.stdout
        assert "1 rank," in result.stdout


def test_a_worker_killed_mid_run_ends_the_demo_with_one_line() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "metrale_model_engine.demo", "--max-new-tokens", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        worker = int(first.rsplit("pids ", 1)[1].split()[1])
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - killed < 30.0
    assert process.returncode == 1
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: ") and "rank(s) [1]" in line, line
    assert "[head] 6 requests" not in stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--world-size", "0"), "argument --world-size: must be at least 1, got 0"),
        (("--slots", "many"), "argument --slots: must be a whole number, got 'many'"),
        (("--world-size", "3"), "argument --world-size: must divide the model's 4 attention heads and 4 experts"),
        (("--world-size", "65"), "argument --world-size: must be at most 64 (the most ranks one ring serves)"),
        (("--transport", "tcp"), "argument --transport: invalid choice: 'tcp'"),
        (("--json", "/nonexistent/x.json"), "argument --json: '/nonexistent/x.json' is in a directory that does not"),
        (("--json", "/tmp"), "argument --json: '/tmp' is a directory; name a file to write"),
        (("--slots", "4294967296"), "argument --slots: must be at most 4294967295, got 4294967296"),
    ],
)
def test_demo_refuses_bad_arguments(args: tuple[str, ...], message: str) -> None:
    result = demo(*args)
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()  # one line, no usage block, no traceback
    assert line.startswith(f"error: {message}") and line.endswith(" (--help lists the options)")


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
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "error: --backend nccl needs a CUDA device per local rank: 2 rank(s), 0 CUDA devices on this machine; "
        "use --backend gloo"
    ]


@pytest.mark.parametrize(
    ("devices", "args", "message"),
    [
        (
            1,
            ("--backend", "nccl"),
            "--backend nccl needs a CUDA device per local rank: 2 rank(s), 1 CUDA device on "
            "this machine; use --world-size 1 or --backend gloo",
        ),
        (
            1,
            ("--device", "cuda", "--world-size", "4"),
            "--device cuda needs a CUDA device per local rank: 4 rank(s), "
            "1 CUDA device on this machine; use --world-size 1 or --device cpu",
        ),
        (
            0,
            ("--world-size", "1", "--device", "cuda"),
            "--device cuda needs a CUDA device per local rank: 1 rank(s), "
            "0 CUDA devices on this machine; use --device cpu",
        ),
        (
            2,
            ("--device", "cpu", "--backend", "nccl"),
            "--backend nccl all-reduces CUDA tensors: it needs --device cuda; use --backend gloo",
        ),
        (
            0,
            ("--cuda-graphs",),
            "--cuda-graphs needs --device cuda (the model is on the CPU here, with 0 CUDA devices)",
        ),
        (4, ("--cuda-graphs", "--world-size", "2", "--device", "cpu"), "--cuda-graphs needs --device cuda"),
        (
            4,
            ("--cuda-graphs", "--world-size", "2"),
            "--cuda-graphs is for one rank (a replayed all-reduce could not be bounded by the collective timeout); "
            "use --world-size 1",
        ),
    ],
)
def test_demo_refuses_a_device_it_lacks_before_any_rank_starts(
    devices: int,
    args: tuple[str, ...],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(list(args)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


def test_the_device_defaults_to_a_gpu_per_rank_else_the_cpu() -> None:
    from metrale_model_engine._demo_choices import device_and_backend

    for devices, ranks, expected in ((0, 1, "cpu"), (1, 1, "cuda"), (1, 2, "cpu"), (2, 2, "cuda"), (8, 4, "cuda")):
        args = parse_args(["--world-size", str(ranks)])
        assert device_and_backend(args, ranks, devices) == (expected, "nccl" if expected == "cuda" else "gloo")
    assert device_and_backend(parse_args(["--device", "cuda", "--backend", "gloo"]), 2, 2) == ("cuda", "gloo")
    assert device_and_backend(parse_args(["--backend", "gloo"]), 2, 2) == ("cpu", "gloo")  # gloo: a CPU model


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
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[head] all 2 ranks agree: KV bookkeeping compared at" in result.stdout


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


def test_demo_refuses_slots_whose_caches_would_not_fit_before_any_rank_starts() -> None:
    started = time.monotonic()
    result = demo("--slots", "4294967295")
    assert (result.returncode, result.stdout) == (2, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --slots 4294967295: the KV caches of 2 rank(s) would take "), line
    assert "GiB of memory" in line and time.monotonic() - started < 60.0


def test_a_request_cut_short_by_its_slot_says_so(tmp_path: Path) -> None:
    result = demo("--max-new-tokens", "240", "--world-size", "1", "--json", str(tmp_path / "cut.json"))
    assert result.returncode == 0, result.stderr
    cut = [line for line in result.stdout.splitlines() if line.endswith("(cut short: its slot's cache is full)")]
    summary = json.loads((tmp_path / "cut.json").read_text())
    reasons = {request["id"]: request["finish_reason"] for request in summary["requests"]}
    assert set(reasons.values()) == {"context"} and len(cut) == len(reasons) == 6  # every prompt + 240 > 256
    assert all(len(r["tokens"]) < 240 for r in summary["requests"])


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_ctrl_c_ends_the_demo_with_one_line_every_rank_gone_nothing_left(transport: str) -> None:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    process = subprocess.Popen(
        [sys.executable, "-m", "metrale_model_engine.demo", "--max-new-tokens", "5000", "--transport", transport],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        pids = [int(pid) for pid in first.rsplit("pids ", 1)[1].split()]
        time.sleep(0.5)  # well inside the run
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        interrupted = time.monotonic()
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130
    assert stderr.strip().splitlines() == ["interrupted"], stderr
    assert time.monotonic() - interrupted < 15.0
    for pid in pids:  # every rank is gone
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    by_its_ranks = tuple(f"metrale-ep-{pid}-" for pid in pids)  # a segment is named by its creator's pid
    assert not {name for name in after - before if name.startswith(by_its_ranks)}


def test_missing_weights_end_the_demo_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from metrale_model_engine import demo, reference

    monkeypatch.setattr(reference, "SHIPPED_WEIGHTS", tmp_path / "gone.bin")
    assert demo.main(["--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gone.bin" in err and err.count("\n") == 1, err
