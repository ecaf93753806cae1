"""Running one function in N fresh processes: the local launchers' common part."""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

from ._checks import check_int, check_seconds


def check_launch(world_size: object, timeout: object, *, max_world_size: int | None = None) -> float | None:
    """Check a launcher's arguments; return the timeout in seconds (``None``: none).

    Raises:
        TypeError, ValueError: ``world_size`` is not an int in ``1 ..= max_world_size``,
            or ``timeout`` is neither ``None`` nor a positive number of seconds.
    """
    check_int("world_size", world_size, 1, max_world_size)
    return check_seconds("timeout", timeout, allow_none=True)


def join_all(processes: Sequence[BaseProcess], timeout: float | None) -> list[int]:
    """Wait for every started process; with a ``timeout``, kill those still running after it and raise.

    Returns:
        Every exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TimeoutError: ranks still ran ``timeout`` seconds after the start; they were
            killed, and the message names them, the timeout and every exit code.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for process in processes:
        process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in stuck:
        processes[rank].kill()
        processes[rank].join()
    codes = [process.exitcode if process.exitcode is not None else -9 for process in processes]
    if stuck:
        raise TimeoutError(
            f"rank(s) {stuck} still ran {timeout} s after the start and were killed (exit codes by rank: {codes}); "
            "pass a larger timeout, or timeout=None to wait as long as they run"
        )
    return codes
