"""The shared-memory segment of the ring: its layout, its lifecycle, its views.

One segment per group of ranks, a file under ``/dev/shm`` named
``metrale-ep-<creator pid>-<random>``: the creator's pid lets a later run remove
what a crashed one left, and the random part makes every run's name new, so a stale
segment can never be mistaken for a live one.

Layout (byte offsets; every field is written by one rank only):

========================  ==================================================================
line 0 (identity)         magic u64, layout version, world size, ring bytes, chunk bytes,
                          head pid, head state, gather bell (u32 each)
line 1 (writer)           writer-parked flag u32
line 2 (parked)           one byte per reader: it sleeps on a record's stamp
line 3 (gone)             one byte per reader: 0 while it serves, else why it left
line 4 (answered)         one byte per reader: the low byte of its answers published
line 5 (head waits)       one byte: the head sleeps waiting for an answer
line 6 (re-form)          the head's word to the ranks once some are lost: epoch u32, state u32
                          (0 none, 1 formed, 2 ended), members u64 (one bit per rank), the
                          name of the next epoch's ring
reader lines              one line per reader: consumed position u64 (the head's futex
                          word when the ring is full), pid u32
gather lines              one line per rank: generation, acknowledgement, count, GATHER_WORDS words
answer blocks             per reader: a line with its answers published u64 and its
                          parked byte, a line with the head's answers consumed u64, then
                          ``ANSWER_SLOTS`` slots of a length u32 and up to
                          ``ANSWER_BYTES`` of answer
ring (page-aligned)       ``ring_bytes`` of records, each at a 64-byte boundary: a line
                          with the stamp u64, the message's bytes u64 and the record's
                          offset in its message u64, then up to ``chunk_bytes`` of payload
========================  ==================================================================

A counter and each flag have their own cache line, or share one only with fields
that are written rarely, so that the ranks do not invalidate each other's lines on
every message.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Final

from .._core.codec import ANSWER_BYTES
from .._core.transport import GATHER_WORDS, TransportCorrupt
from .._host.liveness import process_exists

SHM_DIR: Final[str] = "/dev/shm"
NAME_PREFIX: Final[str] = "metrale-ep-"
LINE: Final[int] = 64
"""Bytes per cache line: every field group starts on its own."""
MAGIC: Final[int] = 0x3153_4D48_5350_454D  # b"MEPSHMS1", little-endian
LAYOUT_VERSION: Final[int] = 4
"""2: every record carries its offset in its message; 3: each worker has an answer ring back to the head; 4: the
re-form line, where the head tells the ranks of a ring that lost some which ring the rest form next."""
MAX_WORLD_SIZE: Final[int] = LINE
"""Ranks in one segment at most: the parked and gone lines hold one byte per reader."""
assert GATHER_WORDS <= LINE // 4 - 3, "a rank's gather line holds a generation, an acknowledgement, a count, the words"

HEAD_OPEN: Final[int] = 0
HEAD_CLOSED: Final[int] = 1
HEAD_BROKEN: Final[int] = 2
"""A send of the head failed: what it published last may be a cut message, and nothing follows."""
GONE_CLOSED: Final[int] = 1
GONE_FAILED: Final[int] = 2

# Fixed offsets, in bytes.
WORLD_SIZE_AT: Final[int] = 12
RING_BYTES_AT: Final[int] = 16
CHUNK_BYTES_AT: Final[int] = 20
HEAD_PID_AT: Final[int] = 24
HEAD_STATE_AT: Final[int] = 28
BELL_AT: Final[int] = 32
WRITER_PARKED_AT: Final[int] = LINE
PARKED_AT: Final[int] = 2 * LINE
GONE_AT: Final[int] = 3 * LINE
ANSWERED_AT: Final[int] = 4 * LINE
HEAD_WAITS_AT: Final[int] = 5 * LINE
REFORM_AT: Final[int] = 6 * LINE
"""The re-form line: epoch u32, state u32, members u64, then the next ring's name (``REFORM_NAME_BYTES``)."""
REFORM_NAME_BYTES: Final[int] = LINE - 16
_READERS_AT: Final[int] = 7 * LINE
ANSWER_SLOTS: Final[int] = 16
"""Answers a worker can have waiting for the head before it waits for room."""
ANSWER_SLOT_BYTES: Final[int] = ANSWER_BYTES + 8
"""A slot of a worker's answer ring: a length word, padding, then one answer of at most ``wire.ANSWER_BYTES``."""
_PAGE: Final[int] = mmap.PAGESIZE
_LOGGER = logging.getLogger("metrale_model_engine.shm")


RECORD_HEADER: Final[int] = LINE
"""Bytes before a record's payload: a line of its own for the stamp, the message's length and
the record's offset in its message, so that the line a waiting reader polls is written a
few times per record, not once per payload store."""


@dataclass(frozen=True)
class Layout:
    """Where everything lies in a segment for ``world_size`` ranks and a ring of ``ring_bytes``.

    A record carries at most ``chunk_bytes`` of payload.
    """

    world_size: int
    ring_bytes: int
    chunk_bytes: int

    @property
    def readers(self) -> int:
        return self.world_size - 1

    def reader_at(self, reader: int) -> int:
        """Offset of reader ``reader``'s line (rank ``reader + 1``): consumed u64, then pid u32."""
        return _READERS_AT + LINE * reader

    def pid_at(self, reader: int) -> int:
        """Offset of reader ``reader``'s pid (u32), in its line after the consumed counter."""
        return self.reader_at(reader) + 8

    def gather_at(self, rank: int) -> int:
        """Offset of rank ``rank``'s gather line: generation, ack, count, then the words."""
        return _READERS_AT + LINE * (self.readers + rank)

    def answer_at(self, reader: int) -> int:
        """Offset of reader ``reader``'s answer block: its published line, the head's consumed line, the slots."""
        block = 2 * LINE + ANSWER_SLOTS * ANSWER_SLOT_BYTES
        return self.gather_at(self.world_size) + block * reader

    @property
    def ring_at(self) -> int:
        """Offset of the ring (page-aligned)."""
        end = self.answer_at(self.readers)
        return -(-end // _PAGE) * _PAGE

    @property
    def size(self) -> int:
        return self.ring_at + self.ring_bytes


class Segment:
    """A mapped segment with its byte, u32 and u64 views and its base address.

    Not thread-safe.  ``close`` releases the views and the mapping; the
    segment itself lives until its name is unlinked and every rank has closed it.
    Several holders in one process share it with ``share``: the last one's close unmaps.
    """

    __slots__ = ("_file", "_holders", "address", "bytes", "layout", "name", "u32", "u64")

    name: str
    layout: Layout
    bytes: memoryview
    """The segment as bytes."""
    u32: memoryview
    """The segment as native u32 words."""
    u64: memoryview
    """The segment as native u64 words."""
    address: int
    """Where the mapping starts in this process, for futex calls; valid until ``close``."""

    def __init__(self, name: str, file: mmap.mmap, layout: Layout) -> None:
        self.name = name
        self.layout = layout
        self._file = file
        self.bytes = memoryview(file)
        self.u32 = self.bytes.cast("I")
        self.u64 = self.bytes.cast("Q")
        anchor = ctypes.c_char.from_buffer(file)
        self.address = ctypes.addressof(anchor)  # the anchor may go; the address stays valid
        del anchor
        self._holders = 1

    def share(self) -> Segment:
        """This segment for one more holder, whose ``close`` counts as its own."""
        self._holders += 1
        return self

    @property
    def path(self) -> str:
        return segment_path(self.name)

    def close(self) -> None:
        """Let go of this holder's share; the last one's releases the views and unmaps (later calls do nothing)."""
        self._holders -= 1
        if self._file.closed or self._holders > 0:
            return
        self.u64.release()
        self.u32.release()
        self.bytes.release()
        self._file.close()


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_segment(layout: Layout, head_pid: int) -> Segment:
    """Create, size and initialise a new segment for ``layout``; the caller is its head.

    The pages are reserved at once (``posix_fallocate``), so that a full ``/dev/shm``
    fails here with a clear message instead of killing a rank with ``SIGBUS`` later.

    Raises:
        OSError: ``/dev/shm`` lacks the space (``ENOSPC``, the message says how
            much is free and needed) or cannot be written.
    """
    name, file = create_file(layout.size, head_pid)
    segment = Segment(name, file, layout)
    words = segment.u32
    words[WORLD_SIZE_AT // 4] = layout.world_size
    words[RING_BYTES_AT // 4] = layout.ring_bytes
    words[CHUNK_BYTES_AT // 4] = layout.chunk_bytes
    words[HEAD_PID_AT // 4] = head_pid
    words[2] = LAYOUT_VERSION
    segment.u64[0] = MAGIC  # last: a segment with its magic is initialised
    return segment


def create_file(size: int, creator_pid: int) -> tuple[str, mmap.mmap]:
    """Create a new file of ``size`` zero bytes under ``/dev/shm``, named for ``creator_pid``; its name and mapping.

    The name is ``metrale-ep-<creator_pid>-<random>`` (so ``remove_stale_segments`` removes it once its creator
    is gone), which runs first.  The pages are reserved at once (``posix_fallocate``).

    Raises:
        OSError: ``/dev/shm`` lacks the space (``ENOSPC``, the message says how much is free and needed) or
            cannot be written; nothing is left there.
    """
    remove_stale_segments()
    _check_free_space(size)
    name = f"{NAME_PREFIX}{creator_pid}-{secrets.token_hex(8)}"
    path = segment_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise _no_space(size) from error
            raise
        file = mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name, file


def attach_segment(name: str) -> Segment:
    """Map the segment ``name`` that a head created, after checking what it is.

    Raises:
        ValueError: ``name`` is not a segment name of this library.
        FileNotFoundError: no such segment (a wrong name, or the head removed it).
        TransportCorrupt: it is not a segment of this library's layout version.
    """
    if not name.startswith(NAME_PREFIX) or os.sep in name:
        raise ValueError(f"name={name!r} is not a segment name of this library (they start with {NAME_PREFIX!r})")
    try:
        fd = os.open(segment_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"no shared-memory segment {name!r} in {SHM_DIR}: the head has not created it, or removed it "
            "(it does once every worker has attached)",
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < _READERS_AT:
            raise TransportCorrupt(f"{segment_path(name)} is {size} bytes: not an initialised ring segment")
        file = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    identity = memoryview(file)[:LINE]
    words = identity.cast("I")
    magic, version = identity.cast("Q")[0], words[2]
    layout = Layout(words[WORLD_SIZE_AT // 4], words[RING_BYTES_AT // 4], words[CHUNK_BYTES_AT // 4])
    words.release()
    identity.release()
    if magic != MAGIC or version != LAYOUT_VERSION or layout.size != size:
        file.close()
        raise TransportCorrupt(
            f"{segment_path(name)} is not a ring of this library's layout version {LAYOUT_VERSION} "
            f"(magic {magic:#x}, version {version}, {size} bytes)"
        )
    return Segment(name, file, layout)


def unlink_segment(name: str) -> None:
    """Remove the segment's name (mappings stay valid); a missing one is no error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


def remove_stale_segments() -> list[str]:
    """Unlink the segments whose creating process no longer exists; return their names.

    What cannot be removed is skipped (logged at debug level): ``/dev/shm`` is sticky,
    so another user's stale segment, or a file any local user planted under the
    prefix, is theirs to remove, and must never stop this user's runs.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        pid_text = name[len(NAME_PREFIX) :].split("-", 1)[0]
        if not name.startswith(NAME_PREFIX) or not pid_text.isdigit():
            continue
        if process_exists(int(pid_text)):
            continue
        try:
            os.unlink(segment_path(name))
        except FileNotFoundError:
            continue  # another run removed it first
        except OSError as error:
            _LOGGER.debug("left the stale segment %s in place: %s", name, error)
            continue
        removed.append(name)
    return removed


def _check_free_space(size: int) -> None:
    stats = os.statvfs(SHM_DIR)
    if stats.f_bavail * stats.f_frsize < size:
        raise _no_space(size, stats.f_bavail * stats.f_frsize)


def _no_space(size: int, free: int | None = None) -> OSError:
    have = "" if free is None else f"{free / 2**20:.1f} MiB free, "
    return OSError(
        errno.ENOSPC,
        f"{SHM_DIR} has {have}too little for the ring's {size / 2**20:.1f} MiB: give the machine a larger "
        f"{SHM_DIR} (a container: docker run --shm-size), use the transport 'torch' ('auto' falls back to it "
        "by itself), or create the ring with a smaller ring_bytes (ShmTransport.create)",
    )
