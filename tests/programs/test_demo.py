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

import torch

from metrale_model_engine.demo import PROMPTS
from metrale_model_engine.demo import main as demo_main
from metrale_model_engine.torch import free_port

from helpers import programs
from helpers.bounded import finish
from helpers.demo_env import leave_torchrun
from helpers.serial import Alone

pytestmark = pytest.mark.torch

INTERRUPT_BOUND = 1.0
"""Seconds from Ctrl-C to the demo's exit, its ranks gone: within the start-up and mid-run alike."""
INTERRUPT_SLACK = 1.0
"""Allowed past it on a loaded 2-core machine (measured: 0.01-0.53 s in 20 tries at 0.3-3 s after the start)."""


def run_bounded(
    command: list[str], timeout: float = 180.0, env: dict[str, str] | None = None, *, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session, forked from the program server (``fresh``: a fresh interpreter); on
    timeout kill the whole session (its ranks too)."""
    start = subprocess.Popen if fresh else programs.Popen
    process = start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    code, stdout, stderr = finish(process, timeout)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def demo(*args: str, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    return run_bounded([sys.executable, "-m", "metrale_model_engine.demo", *args], fresh=fresh)


def test_the_demo_serves_license_text_on_two_ranks_and_every_rank_agrees(tmp_path: Path) -> None:
    """A fresh start, as a user's: the interpreter imports torch, the ranks are spawned."""
    result = demo("--json", str(tmp_path / "two.json"), fresh=True)
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
        assert request["prompt"] == prompt and request["prompt_ids"] == list(prompt.encode())
        assert len(request["tokens"]) == 48 and request["finish_reason"] == "length" and request["seed"] is None
        assert request["text"] == bytes(request["tokens"]).decode("utf-8", errors="replace")
    shares = summary["decode_step"]
    assert abs(shares["compute_share"] + shares["collectives_share"] + shares["protocol_share"] - 1) < 1e-3


def test_a_bad_argument_ends_the_program_with_one_line_and_exit_2() -> None:
    """The refusals themselves are checked in this process (``tests/in_process/test_demo.py``)."""
    result = demo("--world-size", "5")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "error: --world-size 5 cannot split the model: each rank holds one of its 4 attention heads at least "
        "(world sizes that can: 1 ..= 4)"
    ]


def test_a_bad_checkpoint_ends_the_program_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """Every kind of spoilt checkpoint is refused in this process (``tests/in_process/test_demo.py``)."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    result = demo("--model", str(tmp_path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}/config.json: architectures=['LlamaForCausalLM'] is not supported: the architectures "
        "served are MixtralForCausalLM, Qwen3MoeForCausalLM"
    ]


def test_a_worker_killed_mid_run_ends_the_demo_with_one_line() -> None:
    process = programs.Popen(
        [sys.executable, "-m", "metrale_model_engine.demo", "--max-new-tokens", "200", "--on-lost-rank", "stop"],
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
    assert "[head] 6 requests" not in stdout and "recovered from" not in stdout + stderr


RECOVERED = ("--slots", "2", "--max-new-tokens", "24")
"""The recovered run's options: the six prompts two at a time, each to 24 tokens (half the default 48: a short run
that still has four requests waiting or running when the first ends)."""


def test_a_worker_killed_mid_run_is_recovered_from_and_the_demo_exits_0_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 ranks over shared memory, the default ``--on-lost-rank recover``, 2 slots (the six prompts run two at a
    time, ``RECOVERED``): worker 3 killed (SIGKILL) as soon as the first request has ended, the others running or
    waiting.  The recovery carries the running requests on; every request's tokens equal a run that lost nothing (one
    rank, served in this process: ``demo.main``); the summary counts one recovery; the demo exits 0, its last line
    naming the rank it recovered from."""
    leave_torchrun(monkeypatch)
    threads = torch.get_num_threads()  # a one-rank demo sets them
    try:
        assert demo_main(["--world-size", "1", *RECOVERED, "--json", str(tmp_path / "unfailed.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    command = [sys.executable, "-m", "metrale_model_engine.demo", "--world-size", "4", "--transport", "shm"]
    command += [*RECOVERED, "--json", str(tmp_path / "recovered.json")]
    process = programs.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        said = [process.stdout.readline()]
        pids = [int(pid) for pid in said[0].rsplit("pids ", 1)[1].split()]
        for line in process.stdout:
            said.append(line)
            if line.startswith("[request "):
                os.kill(pids[3], signal.SIGKILL)
                break
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    lines = "".join(said).splitlines() + stdout.splitlines()
    assert process.returncode == 0, stderr
    assert lines[-1] == (
        "worker rank(s) [3] lost and recovered from: the run went on over the ranks left "
        "(worker rank exit codes [0, 0, -9])"
    )
    assert "[head] recovered from lost workers (worker rank 3 was killed by SIGKILL): 4 -> 3 rank(s)" in stderr
    assert not [line for line in stderr.splitlines() if line.startswith("error")], stderr
    assert any(line.startswith("[head] all 3 ranks agree: KV bookkeeping compared at") for line in lines), lines
    summary = json.loads((tmp_path / "recovered.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["ranks_before"], recovery["ranks"], recovery["lost"][0]["rank"]) == (4, 3, 3)
    assert recovery["carried_on"] and recovery["failed"] == []  # the kill landed mid-run: requests in flight
    assert "[head] 1 recovery from lost workers (4 -> 3 ranks)" in "\n".join(lines)
    want = json.loads((tmp_path / "unfailed.json").read_text())["requests"]
    assert [r["tokens"] for r in summary["requests"]] == [r["tokens"] for r in want]
    assert len(want) == len(PROMPTS) and all(len(r["tokens"]) == 24 for r in want)


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
    result = programs.run(command, check=False, capture_output=True, text=True, env=env, timeout=150)
    assert result.returncode != 0  # torchrun reports the ranks' exit code 2 as a failure of its own
    ours = [line for line in result.stderr.splitlines() if "METRALE_EP_PROTOCOL" in line]
    assert ours == [
        "error: METRALE_EP_PROTOCOL='garbage' is not a protocol version; accepted: 'v1', 'v2' (or unset/empty for 'v1')"
    ]
    assert "metrale_model_engine/" not in result.stderr  # no traceback from the ranks themselves


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.serial  # within 2 s
def test_ctrl_c_ends_the_demo_with_one_line_every_rank_gone_nothing_left(transport: str) -> None:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    process = programs.Popen(
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
    assert time.monotonic() - interrupted < INTERRUPT_BOUND + INTERRUPT_SLACK  # the ranks leave or are killed
    for pid in pids:  # every rank is gone
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    by_its_ranks = tuple(f"metrale-ep-{pid}-" for pid in pids)  # a segment is named by its creator's pid
    assert not {name for name in after - before if name.startswith(by_its_ranks)}


def outlived(how: str, delay: float, *args: str) -> dict[str, object]:
    """The demo run by ``helpers.outlived`` (a subreaper): what it printed, how long it took, and what it left."""
    tests = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "helpers.outlived", how, str(delay), "--"]
    command += [sys.executable, "-m", "metrale_model_engine.demo", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    result = run_bounded(command, env=env, fresh=True)  # what it left: a fresh start's helpers included
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return found


@pytest.mark.parametrize("delay", [0.4, 1.5, 2.5])  # importing torch, ranks starting, the link's setup
@pytest.mark.serial  # within 2 s, torch's import included
def test_ctrl_c_during_the_start_up_ends_the_demo_at_once_with_one_line_and_leaves_nothing(delay: float) -> None:
    found = outlived("interrupt", delay)
    assert (found["code"], found["stderr"]) == (130, ["interrupted"]), found
    assert float(found["seconds"]) < INTERRUPT_BOUND + INTERRUPT_SLACK, found  # type: ignore[arg-type]
    assert found["left"] == {} and found["shm"] == [], found  # no process it started, no ring of its ranks


def test_a_worker_killed_the_demo_exits_only_once_every_process_it_started_has_ended() -> None:
    found = outlived("kill-worker", 0.0, "--max-new-tokens", "200", "--transport", "torch", "--on-lost-rank", "stop")
    assert found["code"] == 1 and len(found["stderr"]) == 1, found  # type: ignore[arg-type]
    assert found["left"] == {} and found["shm"] == [], found


SLOW_TO_LEAVE = """
import os, signal, sys, time
from metrale_model_engine.torch import run_group

def rank(rank, world_size, out):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank that does not leave when interrupted
    with open(os.path.join(out, str(rank)), "w") as pid:
        pid.write(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    try:
        run_group(rank, 2, sys.argv[1])
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def test_a_launcher_interrupted_twice_returns_only_once_every_rank_has_ended(tmp_path: Path, alone: Alone) -> None:
    script = tmp_path / "slow_to_leave.py"
    script.write_text(SLOW_TO_LEAVE)
    process = programs.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        pids = [int((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
        with alone():  # a second Ctrl-C within the 0.5 s grace (the ranks sleep for a minute)
            time.sleep(0.2)
            os.kill(process.pid, signal.SIGINT)
            time.sleep(0.2)  # inside the launcher's grace for its ranks: a second Ctrl-C
            os.kill(process.pid, signal.SIGINT)
            stdout, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert stdout == "interrupted\n"
    for pid in pids:  # killed after the grace, before the launcher returned
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
