"""The programs under examples/ run as written, and every README code block is one of them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 120.0


def test_every_readme_python_block_is_part_of_an_example() -> None:
    readme = (ROOT / "README.md").read_text()
    sources = [path.read_text() for path in EXAMPLES.glob("*.py")]
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README has no python blocks"
    for block in blocks:
        assert any(block in source for source in sources), f"README block not found in examples/:\n{block}"


def run_example(name: str, protocol: str = "v1") -> subprocess.CompletedProcess[str]:
    """Run ``examples/<name>`` as a user would, with ``METRALE_EP_PROTOCOL`` set; it must exit 0."""
    env = {**os.environ, "METRALE_EP_PROTOCOL": protocol}
    env.pop("RANK", None)  # not under a launcher
    done = subprocess.run(
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
    done = run_example("scheduler_test.py", protocol)
    assert f"protocol {protocol}: the worker's slots equal the head's" in done.stdout


@pytest.mark.ranks
def test_shm_example_runs_without_torch_and_every_rank_agrees() -> None:
    done = run_example("shm_local.py")
    digests = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if ": slot digest " in line]
    assert len(digests) == 3 and len(set(digests)) == 1, done.stdout


def slot_lines(output: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in output.splitlines() if re.match(r"rank \d+ of \d+: slots", line)]


@pytest.mark.ranks
@pytest.mark.torch
@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_ep_example_starts_its_own_ranks(protocol: str) -> None:
    pytest.importorskip("torch")
    done = run_example("ep_model.py", protocol)
    lines = slot_lines(done.stdout)
    assert len(lines) == 2 and lines[0] == lines[1], done.stdout
    assert "2: [100, 101" in lines[0] and "5: [11, 12, 13, 20, 21, 22]" in lines[0]


def launch(script: Path, world_size: int, protocol: str) -> list[tuple[int, str]]:
    """Start ``script`` as ``world_size`` plain processes with torchrun's env:// variables."""
    from metrale_model_engine.torch import free_port

    port = free_port()
    processes = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "METRALE_EP_PROTOCOL": protocol,
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append((process.returncode, output))
    return results


@pytest.mark.ranks
@pytest.mark.torch
@pytest.mark.parametrize(
    "script",
    [EXAMPLES / "ep_model.py", ROOT / "tests" / "exit_without_teardown.py"],
    ids=["readme-example", "no-teardown"],
)
def test_ranks_exit_cleanly_ten_times(script: Path) -> None:
    pytest.importorskip("torch")
    for attempt in range(10):
        results = launch(script, 2, "v1" if attempt % 2 else "v2")
        assert [code for code, _ in results] == [0, 0], f"run {attempt}: {results}"
        if script.name == "ep_model.py":
            lines = [slot_lines(output) for _, output in results]
            assert lines[0] == lines[1] and len(lines[0]) == 1
