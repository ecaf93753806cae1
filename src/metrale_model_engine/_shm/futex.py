"""Sleeping and waking across processes on a shared word (Linux futex), and the memory fence.

The shared-memory ring parks an idle rank in the kernel on a 32-bit word of the
segment and wakes it from another process.  Both go through the ``futex`` system
call by ctypes: non-private operations (the word lives in a shared mapping that the
processes reached independently), with a relative timeout, and with the GIL
released for the duration of the call.

``FUTEX_WAIT`` sleeps only while the word still holds the value the caller passes,
and the kernel checks that under the same lock that ``FUTEX_WAKE`` takes, so a
wake-up that lands between a rank's last look at the word and its sleep is never
lost: the sleep returns at once instead.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from typing import Final

_FUTEX_SYSCALL: Final[dict[str, int]] = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT: Final[int] = 0
_FUTEX_WAKE: Final[int] = 1
_WAKE_ALL: Final[int] = 0x7FFF_FFFF

MACHINE: Final[str] = platform.machine()
SUPPORTED: Final[bool] = platform.system() == "Linux" and MACHINE in _FUTEX_SYSCALL
"""Whether this platform has the futex call this module speaks (Linux on x86-64 or arm64)."""

TOTAL_STORE_ORDER: Final[bool] = MACHINE == "x86_64"
"""Whether plain stores become visible in program order, and loads are not reordered
with each other (x86-64).  Where false (arm64), the ring adds ``full_fence``
between a payload and the stamp that publishes it, and between reading a stamp or
counter and reading what it guards."""


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


if SUPPORTED:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = (
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    )
    _SYS_FUTEX = _FUTEX_SYSCALL[MACHINE]


def futex_wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the u32 at ``address`` equals ``expected``, at most ``timeout`` seconds.

    Returns on a wake-up, a changed word (at once), the timeout, or a signal; the
    caller re-reads shared memory in every case (a wake-up is only a hint).
    ``timeout`` must be positive.
    """
    whole = int(timeout)
    limit = _Timespec(whole, int((timeout - whole) * 1e9))
    _syscall(_SYS_FUTEX, address, _FUTEX_WAIT, expected & 0xFFFF_FFFF, ctypes.addressof(limit), None, 0)


def futex_wake(address: int) -> None:
    """Wake every process sleeping in ``futex_wait`` on the u32 at ``address``."""
    _syscall(_SYS_FUTEX, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


_FENCE: Final[threading.Lock] = threading.Lock()


def full_fence() -> None:
    """Order every load and store before the call before every one after it.

    An uncontended lock's acquire and release are atomic read-modify-write
    instructions in every CPython from 3.10 to 3.13 (glibc semaphores, then
    ``PyMutex``); on x86-64 each is a ``lock``-prefixed instruction, a full barrier.
    Python itself promises no memory model: this is the cheapest barrier it
    reaches without a compiled extension (about 0.1 µs).
    """
    _FENCE.acquire()
    _FENCE.release()
