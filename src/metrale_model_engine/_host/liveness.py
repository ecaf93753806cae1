"""Telling whether peer processes of this machine are still alive, without a pid-reuse race."""

from __future__ import annotations

import errno
import hashlib
import os
import select
import signal
from collections.abc import Mapping


class ProcessWatch:
    """Watches a set of processes, by pid, for their exit.

    Each pid is opened as a pidfd (Linux 5.3+), which becomes readable when that
    process exits, zombie included, and can never be confused with a later process
    that reuses the pid.  Where pidfds are not available it falls back to
    ``os.kill(pid, 0)``, which sees a zombie as alive and a reused pid as the same
    process.  Not thread-safe; call ``close`` to release the descriptors.
    """

    __slots__ = ("_fds", "_pids", "_poll", "_signalled")

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._signalled: set[int] = set()  # pids watched by os.kill
        self._poll = select.poll()

    def __len__(self) -> int:
        """How many processes are watched."""
        return len(self._pids)

    def add(self, pid: int) -> None:
        """Watch ``pid`` (a process that has exited already is reported dead at once); again: no-op."""
        if pid in self._pids:
            return
        self._pids.add(pid)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._signalled.add(pid)  # gone already: os.kill reports it
            return
        except (AttributeError, OSError) as error:
            if isinstance(error, OSError) and error.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            self._signalled.add(pid)
            return
        self._fds[fd] = pid
        self._poll.register(fd, select.POLLIN)

    def dead(self) -> list[int]:
        """The watched pids whose process has exited (one ``poll`` system call)."""
        gone = [self._fds[fd] for fd, _ in self._poll.poll(0)] if self._fds else []
        gone += [pid for pid in self._signalled if not process_exists(pid)]
        return gone

    def halted(self) -> list[int]:
        """The watched pids whose process is stopped (by a signal, or a debugger): it lives, but cannot run.

        Read from ``/proc/<pid>/stat`` (Linux); elsewhere none is found.
        """
        return [pid for pid in sorted(self._pids) if process_state(pid) in ("T", "t")]

    def close(self) -> None:
        """Release the descriptors; the watch is then empty.  Idempotent."""
        for fd in self._fds:
            self._poll.unregister(fd)
            os.close(fd)
        self._fds.clear()
        self._pids.clear()
        self._signalled.clear()


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts; so would a later one reusing the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), ``""`` if unknown."""
    fields = _stat(pid)
    return fields[0] if fields else ""


def ended_processes(pids: Mapping[int, int]) -> dict[int, str]:
    """Of ``pids`` (each under a key, a rank say), the processes that ended, each with how (``exit_status``; else
    ``"exited"``).  A zombie has ended; a pid whose process is gone too (its parent reaped it)."""
    ended = {}
    for key, pid in pids.items():
        state = process_state(pid)
        if state in ("Z", "X") or (not state and not process_exists(pid)):
            ended[key] = exit_status(pid) or "exited"
    return ended


def exit_status(pid: int) -> str:
    """How process ``pid`` ended, while its parent has not reaped it: ``"was killed by SIGKILL"``, ``"exited with
    status 1"``; ``""`` when that cannot be told (it lives, or was reaped: then its pid means nothing any more).

    Read from the zombie's ``/proc/<pid>/stat`` (its last field is the status ``waitpid`` would give its parent),
    so a sibling can tell it too; Linux only, elsewhere ``""``.
    """
    fields = _stat(pid)
    if len(fields) < 50 or fields[0] != "Z":
        return ""
    status = int(fields[49])
    number = status & 0x7F
    if not number:
        return f"exited with status {status >> 8}"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"was killed by {name}"


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command's name (the state first); empty if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def host_fingerprint() -> tuple[int, int]:
    """Two u32 words that two processes share exactly when they see one host: its name, boot, pid namespace
    and ``/dev/shm`` (those of them this platform has).  Equal words mean that pids and shared memory of one
    process mean the same to the other."""
    facts = [os.uname().nodename]
    for path in ("/dev/shm", "/proc/self/ns/pid"):
        try:
            stat = os.stat(path)
        except OSError:
            facts.append("")
        else:
            facts.append(f"{stat.st_dev}:{stat.st_ino}")
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            facts.append(file.read().strip())
    except OSError:
        pass
    digest = hashlib.blake2b("\0".join(facts).encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")
