"""Running one function in N fresh processes, bounded in time: the local launchers' common part."""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess


def check_launch(world_size: object, timeout: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``world_size`` is an int >= 1 and ``timeout`` > 0."""
    if type(world_size) is not int:
        raise TypeError(f"world_size must be an int >= 1, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a positive number of seconds, got {type(timeout).__name__} {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")


def join_all(processes: Sequence[BaseProcess], timeout: float) -> list[int]:
    """Wait for every started process up to ``timeout`` seconds in all; kill those still running.

    Returns every exit code, by position (0 for success; negative: killed by that signal).
    """
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode if process.exitcode is not None else -9 for process in processes]
