"""A ``/dev/shm`` too small for the ring, for real: the demo and the shm example, run as a user runs them in a
private mount namespace with a 64 KiB ``/dev/shm`` (root and ``unshare``; skipped with the reason otherwise),
say why in one ``error:`` line and exit 2, or serve over gloo where ``auto`` falls back."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from metrale_model_engine.shm import shm_supported

from helpers import programs
from helpers.setup_texts import NO_ROOM

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory transport needs Linux")

ROOT = Path(__file__).resolve().parents[2]
TINY_SHM_OPTIONS = "size=64k"
TINY_SHM = f"mount -t tmpfs -o {TINY_SHM_OPTIONS} tmpfs /dev/shm"


@functools.cache
def private_mounts() -> str | None:
    """``None`` when this process can run a command in a mount namespace of its own, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    if os.geteuid() != 0:
        return "a private mount namespace with its own /dev/shm needs root"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", TINY_SHM],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if probe.returncode == 0 else f"unshare --mount failed here: {probe.stderr.strip()}"


def with_tiny_dev_shm(*command: str, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``command`` where ``/dev/shm`` is a 64 KiB tmpfs of its own (skip if this process cannot), forked from the
    program server into a mount namespace of its own (``fresh``: a fresh interpreter under ``unshare``)."""
    reason = private_mounts()
    if reason is not None:
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    if not fresh:
        return programs.run(
            command, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT, isolate={"shm": TINY_SHM_OPTIONS}
        )
    script = f'{TINY_SHM} && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command],
        check=False,
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )


def test_the_shm_example_without_room_says_why_in_one_line() -> None:
    done = with_tiny_dev_shm(sys.executable, "examples/shm_local.py", fresh=True)  # without torch, as a user's
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [NO_ROOM])


def test_the_demo_over_shm_without_room_says_why_in_one_line() -> None:
    pytest.importorskip("torch", reason="the demo needs the torch extra")
    done = with_tiny_dev_shm(sys.executable, "-m", "metrale_model_engine.demo", "--transport", "shm")
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [NO_ROOM])


def test_the_demo_under_torchrun_without_room_says_why_once() -> None:
    pytest.importorskip("torch", reason="the demo needs the torch extra")
    from metrale_model_engine.torch import free_port

    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    done = with_tiny_dev_shm(*run, "-m", "metrale_model_engine.demo", "--transport", "shm")
    assert done.returncode != 0  # torchrun reports its ranks' exit code 2 as a failure of its own
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [NO_ROOM]
    assert "metrale_model_engine/" not in done.stderr  # no traceback from the ranks


def test_the_demo_by_default_without_room_serves_over_gloo() -> None:
    """``--transport auto`` (the default) without room for a ring serves over gloo instead."""
    pytest.importorskip("torch", reason="the demo needs the torch extra")
    done = with_tiny_dev_shm(sys.executable, "-m", "metrale_model_engine.demo", "--max-new-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert "2 ranks over TorchTransport" in done.stdout
