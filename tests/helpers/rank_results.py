"""What rank programs of the multi-process tests leave for the test that started them.

Every program writes what it saw to ``<out>/rank<N>.pkl`` (a dict); the test reads
them back with :func:`load`.  Torch-free, so the shared-memory tests can use it.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path


def save(out: str, rank: int, /, **result: object) -> None:
    note(out, f"rank{rank}", **result)


def note(out: str, label: str, /, **result: object) -> None:
    """Write ``result`` as ``<out>/<label>.pkl`` (a note besides the ranks' results)."""
    with open(Path(out) / f"{label}.pkl", "wb") as file:
        pickle.dump(result, file)


def read_note(out: Path, name: str) -> dict[str, object]:
    """What :func:`note` wrote as ``name``."""
    result: dict[str, object] = pickle.loads((out / f"{name}.pkl").read_bytes())
    return result


def load(out: Path, world_size: int) -> dict[int, dict[str, object]]:
    """Every rank's saved dict, by rank (ranks that saved nothing are missing)."""
    results = {}
    for rank in range(world_size):
        path = out / f"rank{rank}.pkl"
        if path.exists():
            results[rank] = pickle.loads(path.read_bytes())
    return results


def wait_for_file(path: Path, *, timeout: float) -> bool:
    """Wait until ``path`` exists (a file another process of the test makes); whether it did within ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def wait_for_result(out: str, rank: int, *, timeout: float) -> bool:
    """Wait until rank ``rank`` has saved its result in ``out`` (it has begun to: the file exists); whether it did
    within ``timeout`` seconds."""
    return wait_for_file(Path(out) / f"rank{rank}.pkl", timeout=timeout)


def wait_until_dead(pid: int, *, timeout: float) -> None:
    """Wait until process ``pid`` (a sibling, so not ours to join) has died: gone or a zombie."""
    deadline = time.monotonic() + timeout
    stat = Path(f"/proc/{pid}/stat")
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still alive after {timeout} s")
