"""A process's own namespaces, entered from Python: what ``ip netns exec`` and ``unshare`` do for a simulated host.

``isolate(spec)`` runs in a single-threaded process (a program server's child, before the
program runs): it joins a network namespace, then unshares a mount namespace (its mounts
private, so nothing leaks to the machine's), a UTS namespace for a hostname and a pid
namespace; it mounts a ``/dev/shm`` of its own, ``/sys`` for the network namespace and
binds files (``/etc/hosts``).  With a pid namespace it forks: the child goes on as the
namespace's first process (``/proc`` its own, killed when the parent dies, as ``unshare
--fork --kill-child --mount-proc`` makes it); the parent waits and ends as the child
ended.  Linux and root only (``CAP_SYS_ADMIN``); a failed call raises ``OSError`` naming it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
from typing import TypedDict

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG = 1


class Isolation(TypedDict, total=False):
    """What ``isolate`` sets up; each key optional."""

    netns: str
    """A network namespace's name (``ip netns add``) to join."""
    hostname: str
    """The hostname, in a UTS namespace of its own."""
    shm: str
    """The options of a tmpfs mounted on ``/dev/shm`` (``"size=64k"``, ``"mode=1777"``)."""
    binds: list[tuple[str, str]]
    """``(file, over)`` pairs: ``file`` bind-mounted over ``over``."""
    pid: bool
    """A pid namespace of its own, whose first process the program is."""


_libc = ctypes.CDLL(None, use_errno=True)


def _call(what: str, result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if text is None else text.encode() for text in (source, target, fstype, data)]
    _call(f"mount {target}", _libc.mount(*encoded[:3], ctypes.c_ulong(flags), encoded[3]))


def isolate(spec: Isolation) -> None:
    """Set up ``spec`` for this process (and, with ``pid``, return in the forked first process of its namespace)."""
    netns = spec.get("netns")
    if netns is not None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _call(f"setns {netns}", _libc.setns(fd, _CLONE_NEWNET))
        finally:
            os.close(fd)
    flags = _CLONE_NEWNS | (_CLONE_NEWUTS if "hostname" in spec else 0) | (_CLONE_NEWPID if spec.get("pid") else 0)
    _call("unshare", _libc.unshare(flags))
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    if netns is not None:  # the network namespace's own devices under /sys, as ip netns exec shows them
        _call("umount /sys", _libc.umount2(b"/sys", _MNT_DETACH))
        _mount(netns, "/sys", "sysfs", 0)
    if "shm" in spec:
        _mount("tmpfs", "/dev/shm", "tmpfs", 0, spec["shm"])
    for file, over in spec.get("binds", []):
        _mount(file, over, None, _MS_BIND)
    if "hostname" in spec:
        name = spec["hostname"].encode()
        _call("sethostname", _libc.sethostname(name, len(name)))
    if spec.get("pid"):
        _become_the_first_process()


def _become_the_first_process() -> None:
    """Fork into the new pid namespace; the parent relays the child's end and never returns."""
    parent_alive, alive = os.pipe()  # its read end ends when the parent does (getppid() says 0 in the namespace)
    child = os.fork()
    if child == 0:
        os.close(alive)
        _call("prctl", _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if select.select([parent_alive], [], [], 0)[0]:  # the parent died before the line above
            os._exit(1)
        os.close(parent_alive)
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        return
    os.close(parent_alive)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the program's streams are its own: this relay holds none of them open
        os.dup2(null, fd)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF if code >= 0 else 1)
