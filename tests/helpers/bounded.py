"""Waiting for a process started in its own session, with a bound: on timeout, its whole session is killed."""

from __future__ import annotations

import os
import signal
import subprocess

from helpers import programs


def finish(process: subprocess.Popen[str] | programs.Popen, timeout: float) -> tuple[int, str, str]:
    """Wait for ``process`` (its pipes text): its exit code, stdout and stderr.

    After ``timeout`` seconds its whole session is killed and the test fails with what it printed.
    """
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{process.args!r} still ran after {timeout} s:\n{stdout}\n{stderr}") from None
    return process.wait(), stdout, stderr
