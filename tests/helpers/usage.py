"""What a process uses, a core's share and memory: the one sampler and reader of the tests and the benchmarks.

The benchmarks import it from here too (``benchmarks/tests_path.py`` puts ``tests/``
on their path), so the package itself never holds a test's instrument.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path


def cpu_seconds(pid: int | None = None) -> float:
    """The CPU time, user and system, that process ``pid`` has used so far, in seconds.

    ``None``: this process, read with ``getrusage`` (microseconds, finer than the clock
    ticks of ``/proc/<pid>/stat``, which another process's time is read from).
    """
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(window: float, pid: int | None = None) -> float:
    """The share of one core that process ``pid`` (``None``: this one) uses over the next ``window`` seconds.

    Blocks for the window.
    """
    start = cpu_seconds(pid)
    time.sleep(window)
    return (cpu_seconds(pid) - start) / window


class IdleSampler:
    """This process's :func:`cpu_share` over ``window`` seconds that start ``idle`` seconds from now, on a thread.

    For a process whose own thread waits meanwhile (a worker in its receive): start it,
    wait, then read :meth:`share`.
    """

    def __init__(self, idle: float, window: float) -> None:
        self._idle = idle
        self._window = window
        self._share: float | None = None
        self._thread = threading.Thread(target=self._sample, name="idle sampler")
        self._thread.start()

    def _sample(self) -> None:
        time.sleep(self._idle)
        self._share = cpu_share(self._window)

    def share(self) -> float:
        """The share measured: waits for the window's end."""
        self._thread.join()
        assert self._share is not None, "the sampler's thread failed"
        return self._share


def memory(key: str, default: int | None = None) -> int:
    """A memory figure of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...), in bytes.

    Raises ``KeyError`` where the kernel gives no such line, unless a ``default`` is given.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    if default is None:
        raise KeyError(key)
    return default
