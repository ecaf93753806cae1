"""The programs under examples/ run as written, and every README code block is one of them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT = 120.0


DOCUMENTS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md")])


def test_every_python_block_of_the_readme_and_the_docs_is_part_of_an_example() -> None:
    sources = [path.read_text() for path in EXAMPLES.glob("*.py")]
    readme_blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert readme_blocks, "the README has no python blocks"
    for document in DOCUMENTS:
        for block in re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.DOTALL):
            assert any(block in source for source in sources), f"{document.name}: block not in examples/:\n{block}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_of_the_readme_and_the_docs_resolves(document: Path) -> None:
    """A moved or renamed file, or a heading that changed, fails here (a link to a heading is checked too)."""
    text = document.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        assert linked.exists(), f"{document.name}: the link {target!r} names a missing file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.MULTILINE)
            slugs = {re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-") for heading in headings}
            assert anchor in slugs, f"{document.name}: no heading {anchor!r} in {linked.name}"


def test_the_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


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


@pytest.mark.programs
def test_shm_example_runs_without_torch_and_every_rank_agrees() -> None:
    done = run_example("shm_local.py")
    digests = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if ": slot digest " in line]
    assert len(digests) == 3 and len(set(digests)) == 1, done.stdout


def slot_lines(output: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in output.splitlines() if re.match(r"rank \d+ of \d+: slots", line)]


@pytest.mark.programs
@pytest.mark.torch
@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_ep_example_starts_its_own_ranks(protocol: str) -> None:
    pytest.importorskip("torch")
    done = run_example("ep_model.py", protocol)
    lines = slot_lines(done.stdout)
    assert len(lines) == 2 and lines[0] == lines[1], done.stdout
    assert lines[0].startswith("slots {0: [65, 97, 66, 97, 67, 97], 2: [65, 99, 66, 99, 67, 99]}, last output ")


@pytest.mark.programs
@pytest.mark.torch
@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_ep_example_with_a_worker_bug_stops_every_rank_at_once_and_the_head_names_it(transport: str) -> None:
    pytest.importorskip("torch")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "ep_model.py"), "--bug", "--transport", transport],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30.0  # the processes' start and torch's import included: not hung
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    head = [line for line in errors if line.startswith("error: head: ")]
    assert len(errors) == 2 and len(head) == 1, done.stderr
    assert head[0].startswith("error: head: the run stopped in command 3 (seq_id=0, cmd=2): worker rank 1"), head
    assert "failed command 3 (seq_id=0, cmd=2): KeyError: 'slot 0 is free'" in head[0], head
    assert "which runs collectives, failed here, so the run stops on every rank: KeyError" in done.stderr
    assert not slot_lines(done.stdout)


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


@pytest.mark.programs
@pytest.mark.torch
@pytest.mark.parametrize(
    "script",
    [EXAMPLES / "ep_model.py", ROOT / "tests" / "helpers" / "exit_without_teardown.py"],
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


@pytest.mark.programs
@pytest.mark.torch
def test_ctrl_c_ends_the_ep_example_with_one_line() -> None:
    pytest.importorskip("torch")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "ep_model.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(children.read_text().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the launcher has started both ranks (they then import torch, for seconds)
        time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stdout, stderr = process.communicate(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, stderr.strip().splitlines(), stdout) == (130, ["interrupted"], "")
