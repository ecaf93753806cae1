"""What a program leaves running once it has exited: ``python -m helpers.outlived HOW DELAY -- COMMAND...``.

It runs ``COMMAND`` as a child subreaper (Linux), so that any process the command
started and left behind is reparented here, and prints one line of JSON: the
command's exit code, its stderr's lines, the seconds from the fault to its exit,
every process still alive the moment it exited, and the ``/dev/shm`` names its
processes' pids made and left.  ``HOW`` is ``interrupt`` (SIGINT to the command's
process group, as a terminal's Ctrl-C, ``DELAY`` seconds after the start) or
``kill-worker`` (SIGKILL to the second pid of the demo's first line, as soon as it
is printed).  Imports nothing but the standard library.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

_PR_SET_CHILD_SUBREAPER = 36


def _children(parent: int) -> dict[int, str]:
    """The live processes whose parent is ``parent``, with their command lines.

    Read from the parent's own ``/proc/PID/task/*/children``, not by a walk of every
    process of the machine, which this loop, every 5 ms, would make a busy core's work.
    """
    pids: list[str] = []
    try:
        for task in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{task}/children") as children:
                pids += children.read().split()
    except OSError:  # the parent, or one of its threads, gone meanwhile
        pass
    found = {}
    for entry in pids:
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
            line = open(f"/proc/{entry}/cmdline").read().replace("\0", " ").strip()  # noqa: SIM115
        except OSError:  # gone meanwhile
            continue
        if stat[0] != "Z":
            found[int(entry)] = line
    return found


def main(argv: list[str]) -> None:
    how, delay = argv[0], float(argv[1])
    command = argv[argv.index("--") + 1 :]
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, start_new_session=True)
        started = time.monotonic()
        pids: set[int] = set()
        while process.poll() is None and time.monotonic() - started < delay:
            pids |= set(_children(process.pid))
            time.sleep(0.01)
        if how == "kill-worker":
            first = ""
            while "pids " not in first and process.poll() is None:
                out.seek(0)
                first = out.readline()
                time.sleep(0.01)
            os.kill(int(first.rsplit("pids ", 1)[1].split()[1]), signal.SIGKILL)
        else:
            os.killpg(process.pid, signal.SIGINT)
        struck = time.monotonic()
        while process.poll() is None:
            pids |= set(_children(process.pid))
            time.sleep(0.005)
        took = time.monotonic() - struck
        left = _children(os.getpid())
        shm = [name for name in os.listdir("/dev/shm") if any(f"-{pid}-" in name for pid in pids)]
        err.seek(0)
        print(json.dumps({"code": process.returncode, "stderr": err.read().splitlines(), "seconds": took,
                          "left": left, "shm": shm}))  # fmt: skip
    for pid in left:
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
