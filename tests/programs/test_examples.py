"""The programs under examples/ run as a user runs them, and end cleanly (ten times over), and so does the
README's model program, put together from its blocks; that the README's blocks are part of the examples is
checked in ``tests/in_process/test_docs.py``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import programs
from helpers.readme import model_program

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 120.0


def run_example(name: str, protocol: str = "v1", *, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` as a user would, with ``METRALE_EP_PROTOCOL`` set, forked from the program server
    (``fresh``: a fresh interpreter); it must exit 0."""
    env = {**os.environ, "METRALE_EP_PROTOCOL": protocol}
    env.pop("RANK", None)  # not under a launcher
    done = (subprocess.run if fresh else programs.run)(
        [sys.executable, str(EXAMPLES / name)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_single_gpu_example() -> None:
    pytest.importorskip("torch")
    assert "single-GPU defaults hold" in run_example("single_gpu.py").stdout


@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_scheduler_example_replays_to_the_same_state(protocol: str) -> None:
    done = run_example("scheduler_test.py", protocol, fresh=True)  # no torch: a fresh start costs little
    assert f"protocol {protocol}: the worker's slots equal the head's" in done.stdout


def test_shm_example_runs_without_torch_and_every_rank_agrees() -> None:
    done = run_example("shm_local.py", fresh=True)  # without torch: not from the server, which imported it
    digests = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if ": slot digest " in line]
    assert len(digests) == 3 and len(set(digests)) == 1, done.stdout


def slot_lines(output: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in output.splitlines() if re.match(r"rank \d+ of \d+: slots", line)]


SLOTS_SERVED = "slots {0: [65, 97, 66, 97, 67, 97], 2: [65, 99, 66, 99, 67, 99]}, last output "
"""How each rank's line of the README's model program and ``examples/ep_model.py`` starts."""


@pytest.mark.torch
def test_ep_example_starts_its_own_ranks() -> None:
    """Under v1 (v2: the clean-exit runs below, every other one); a fresh start, its ranks spawned as a user's are
    (their target and arguments pickled, ``__main__`` imported again in each)."""
    pytest.importorskip("torch")
    done = run_example("ep_model.py", "v1", fresh=True)
    lines = slot_lines(done.stdout)
    assert len(lines) == 2 and lines[0] == lines[1], done.stdout
    assert lines[0].startswith(SLOTS_SERVED)


@pytest.mark.torch
def test_the_readmes_model_program_runs_as_shown(tmp_path: Path) -> None:
    """The README's model blocks and the block that starts them, copied into one file as a user would, and started
    afresh: its ranks spawned, as a user's are."""
    pytest.importorskip("torch")
    program, _ = model_program()
    script = tmp_path / "readme_model.py"
    script.write_text(program)
    env = {key: value for key, value in os.environ.items() if key != "RANK"}  # not under a launcher
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    lines = slot_lines(done.stdout)
    assert len(lines) == 2 and lines[0] == lines[1], done.stdout
    assert lines[0].startswith(SLOTS_SERVED)


@pytest.mark.torch
@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.serial  # within 30 s
def test_ep_example_with_a_worker_bug_stops_every_rank_at_once_and_the_head_names_it(transport: str) -> None:
    pytest.importorskip("torch")
    started = time.monotonic()
    done = programs.run(
        [sys.executable, str(EXAMPLES / "ep_model.py"), "--bug", "--transport", transport],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30.0  # the processes' start included: not hung
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    head = [line for line in errors if line.startswith("error: head: ")]
    assert len(errors) == 2 and len(head) == 1, done.stderr
    assert head[0].startswith("error: head: the run stopped in command 3 (seq_id=0, cmd=2): worker rank 1"), head
    assert "failed command 3 (seq_id=0, cmd=2): KeyError: 'slot 0 is free'" in head[0], head
    assert "which runs collectives, failed here, so the run stops on every rank: KeyError" in done.stderr
    assert not slot_lines(done.stdout)


ATTEMPTS = 10
"""Runs of a clean-exit test: without the exit hook, one run in a few aborted (exit -6)."""


def run_repeatedly(script: Path, world_size: int, attempts: int) -> list[str]:
    """Run ``script`` ``attempts`` times as ``world_size`` ranks with torchrun's env:// variables; each rank's output.

    Each rank is one process, forked from the program server, that forks a fresh run
    of the script per attempt (``tests/helpers/run_repeatedly.py``): the runs exit as
    programs do, without a second's import each.
    """
    probes = [socket.create_server(("127.0.0.1", 0)) for _ in range(attempts)]  # held open: distinct ports
    ports = ",".join(str(probe.getsockname()[1]) for probe in probes)
    for probe in probes:
        probe.close()
    driver = ROOT / "tests" / "helpers" / "run_repeatedly.py"
    processes = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "METRALE_TEST_PORTS": ports,
        }
        processes.append(
            programs.Popen(
                [sys.executable, str(driver), str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=RUN_TIMEOUT)
            outputs.append(output)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return outputs


def attempts_of(output: str) -> list[tuple[int, str]]:
    """One rank's attempts in the output of ``run_repeatedly.py``: (exit code, what the run printed) each."""
    parts = re.split(r"^attempt \d+: exit (-?\d+)\n", output, flags=re.MULTILINE)
    return [(int(code), printed) for printed, code in zip(parts[0:-1:2], parts[1::2], strict=True)]


@pytest.mark.torch
@pytest.mark.parametrize(
    "script",
    [EXAMPLES / "ep_model.py", ROOT / "tests" / "helpers" / "exit_without_teardown.py"],
    ids=["readme-example", "no-teardown"],
)
def test_ranks_exit_cleanly_ten_times(script: Path) -> None:
    pytest.importorskip("torch")
    ranks = [attempts_of(output) for output in run_repeatedly(script, 2, ATTEMPTS)]
    for attempt in range(ATTEMPTS):
        results = [rank[attempt] if attempt < len(rank) else (None, "") for rank in ranks]
        assert [code for code, _ in results] == [0, 0], f"run {attempt}: {results}"
        if script.name == "ep_model.py":  # under v2, then v1, by turns
            lines = [slot_lines(printed) for _, printed in results]
            assert lines[0] == lines[1] and len(lines[0]) == 1, f"run {attempt}: {results}"
            assert lines[0][0].startswith(SLOTS_SERVED), f"run {attempt}: {results}"


def launched_both_ranks(launcher: int) -> bool:
    """Whether ``launcher`` has started its 2 ranks, its children with multiprocessing's resource tracker: it holds
    SIGINT back while it starts each (the rank inherits that), and ``SigBlk`` in its status says when that is over."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    status = Path(f"/proc/{launcher}/status").read_text()
    held = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return len(children) >= 3 and not held & (1 << (signal.SIGINT - 1))


@pytest.mark.torch
def test_ctrl_c_ends_the_ep_example_with_one_line() -> None:
    """A fresh start, as a user's: the interrupt lands while the spawned ranks import torch."""
    pytest.importorskip("torch")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "ep_model.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not launched_both_ranks(process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # (the ranks then import torch, for seconds: the interrupt lands in their start)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, stderr.strip().splitlines(), stdout) == (130, ["interrupted"], "")
