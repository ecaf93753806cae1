"""``HostSum``: the all-reduce (a sum) of CPU tensors between the ranks of one host, through shared memory.

A file under ``/dev/shm``, named as the ring's segments are (``metrale-ep-<creator pid>-<random>``), unlinked
once every rank has mapped it, so nothing is left there even if a rank crashes later.  Layout (byte offsets):

========================  ==================================================================
rank lines                one 64-byte line per rank: its generation u64 (the last call whose
                          bytes it published), its left byte (1: it left these all-reduces), then
                          for each buffer the bytes u64 and the item size u64 of the tensor whose
                          piece it holds
buffers (page-aligned)    2 buffers, each of ``world_size`` slots of ``SLOT_BYTES``
========================  ==================================================================

Call ``g`` (counted from 1, a piece of a large tensor counting as one call) uses buffer ``g % 2``: a rank copies
its bytes into its slot, publishes ``g`` in its line, waits until every rank's generation is ``g`` or more, and
sums the slots in rank order into its tensor, so every rank computes the same bits (two ranks: ``a + b``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from typing import Final

import torch
import torch.distributed as dist

from .._core.checks import ranks_disagree
from .._host.liveness import ProcessWatch
from .._shm import futex
from .._shm.segment import NAME_PREFIX, create_file, segment_path, unlink_segment

__all__ = ["SLOT_BYTES", "HostSum", "PeerLeft"]

SLOT_BYTES: Final[int] = 1 << 20
"""Bytes of one rank's slot: a larger tensor goes through in pieces of this size, each one call."""
SPIN_TIME: Final[float] = 0.001
"""Seconds a waiting rank spins (yielding its core) before it sleeps."""
FIRST_NAP: Final[float] = 50e-6
"""The first sleep after the spin, in seconds; each next one doubles, up to ``LAST_NAP``."""
LAST_NAP: Final[float] = 0.001
CHECK_INTERVAL: Final[float] = 0.01
"""Seconds between a waiting rank's checks of its peers' processes."""

_LINE: Final[int] = 64
_LEFT_AT: Final[int] = 8
"""The left byte's offset in a rank's line."""
_SIZE_WORD: Final[int] = 2
"""The u64 word of a rank's line with the bytes of its tensor in buffer 0; then its item size; then buffer 1's."""
_LOGGER = logging.getLogger(__name__)


class PeerLeft(RuntimeError):
    """A rank the all-reduce waits for exited, or left the all-reduces (its own failed); the message names them."""


class HostSum:
    """Sums CPU tensors over the ranks of the default process group, all on this host, through a shared file.

    Made by ``form``, a collective over the default group; every rank then calls ``all_reduce`` in the same
    order, as with ``torch.distributed``.  A wait spins for ``SPIN_TIME`` and then sleeps, checking its peers'
    processes (pidfds: a zombie is dead) every ``CHECK_INTERVAL``.  Not thread-safe; ``close`` lets go of the
    mapping.
    """

    __slots__ = ("_buffers", "_file", "_generation", "_generations", "_lines", "_pids", "_rank", "_watch", "_world")

    def __init__(self, file: mmap.mmap, rank: int, pids: list[int]) -> None:
        self._file = file
        self._rank = rank
        self._world = len(pids)
        self._pids = pids
        self._generation = 0
        self._lines = memoryview(file)[: self._world * _LINE]
        self._generations = self._lines.cast("Q")
        buffers = torch.frombuffer(file, dtype=torch.uint8, offset=_buffers_at(self._world))
        self._buffers = buffers.view(2, self._world, SLOT_BYTES)
        self._watch = ProcessWatch()
        for peer, pid in enumerate(pids):
            if peer != rank:
                self._watch.add(pid)

    @classmethod
    def form(cls) -> HostSum | None:
        """Every rank of the default group, at the same point: the file made and mapped; ``None`` where it cannot be.

        Rank 0 creates the file and broadcasts its name; every rank maps it and gathers the pids (and whether
        each mapped it); after a barrier rank 0 unlinks it.  Where rank 0 cannot create it (``/dev/shm`` too
        small) or a rank cannot map it, every rank returns ``None`` (and logs why at debug level): keep to
        the backend's all-reduce.

        Raises:
            RuntimeError: the default group's own collectives failed (a rank gone or late).
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        names, created = [""], None
        if rank == 0:
            try:
                names[0], created = create_file(_buffers_at(world) + 2 * world * SLOT_BYTES, os.getpid())
            except OSError as error:
                _LOGGER.debug("no shared-memory all-reduce: %s", error)
        try:
            dist.broadcast_object_list(names, src=0)
            file = created if rank == 0 else _map(names[0]) if names[0] else None
            mine = (os.getpid(), file is not None)
            everyone: list[tuple[int, bool]] = [mine] * world
            dist.all_gather_object(everyone, mine)
            dist.barrier()
        finally:  # every rank mapped it (or failed): its name goes, and nothing is left in /dev/shm
            if rank == 0 and names[0]:
                unlink_segment(names[0])
        if file is None or not all(mapped for _, mapped in everyone):
            if file is not None:
                file.close()
            return None
        return cls(file, rank, [pid for pid, _ in everyone])

    def all_reduce(self, tensor: torch.Tensor, deadline: float | None) -> None:
        """Sum the CPU ``tensor`` (strided) over the ranks, in place (any dtype ``torch.add`` takes).

        Args:
            tensor: this rank's part; its shape and dtype must be every rank's.
            deadline: a ``time.monotonic()`` value past which a wait fails; ``None``: none.

        Raises:
            PeerLeft: a rank exited (or left) before it published its part: the message names it.
            TimeoutError: the deadline passed; the message names the ranks that did not arrive.
            ValueError: the ranks' tensors differ in bytes or item size (every rank raises it, naming each's).
        """
        with torch.no_grad():  # on the tensor's data, as the backend's all-reduce
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            flat = work.reshape(-1).view(torch.uint8)
            try:
                size = (flat.numel(), work.element_size())
                for start in range(0, flat.numel(), SLOT_BYTES):
                    self._reduce_piece(flat[start : start + SLOT_BYTES], work.dtype, size, deadline)
            except BaseException:
                self._lines[self._rank * _LINE + _LEFT_AT] = 1  # the peers fail at once, not at their deadline
                raise
            if work is not tensor:
                tensor.copy_(work)

    def _reduce_piece(
        self, piece: torch.Tensor, dtype: torch.dtype, size: tuple[int, int], deadline: float | None
    ) -> None:
        """One call: ``piece`` (bytes of ``dtype``, of a tensor of ``size``: bytes, item size) published, every
        rank's awaited and checked against it, their sum written into it."""
        self._generation += 1
        generation, count = self._generation, piece.numel()
        slots = self._buffers[generation % 2, :, :count]
        slots[self._rank].copy_(piece)
        at = _word(self._rank, _SIZE_WORD + 2 * (generation % 2))  # by buffer, as the bytes
        self._generations[at], self._generations[at + 1] = size
        if not futex.TOTAL_STORE_ORDER:
            futex.full_fence()  # the bytes are visible before the generation that publishes them
        self._generations[_word(self._rank)] = generation
        # One wait a call is enough with two buffers: a rank writes buffer g % 2 again at call g + 2, after its
        # wait of call g + 1 saw every rank publish g + 1, which each did only after summing call g's slots.
        self._wait(generation, deadline)
        if not futex.TOTAL_STORE_ORDER:
            futex.full_fence()  # the generations are read before the bytes they publish
        self._check_sizes(generation % 2)
        parts = slots.view(dtype)
        out = piece.view(dtype)
        torch.add(parts[0], parts[1], out=out)
        for peer in range(2, self._world):
            out.add_(parts[peer])

    def _check_sizes(self, buffer: int) -> None:
        """Raise ``ValueError`` where the ranks' tensors of this call (in ``buffer``) differ in bytes or item size:
        gloo refuses such an all-reduce, and a sum of them would be wrong."""
        words, first = self._generations, _SIZE_WORD + 2 * buffer
        sizes = [(words[_word(peer, first)], words[_word(peer, first + 1)]) for peer in range(self._world)]
        differ = ranks_disagree(
            {"the all-reduce's tensor": sizes}, lambda size: f"{size[0]} bytes in items of {size[1]}"
        )
        if differ is not None:
            raise ValueError(differ)

    def _late(self, generation: int) -> list[int]:
        """The ranks that have not published ``generation`` yet."""
        generations = self._generations
        return [peer for peer in range(self._world) if generations[_word(peer)] < generation]

    def _wait(self, generation: int, deadline: float | None) -> None:
        """Return once every rank published ``generation``: spin, then sleep longer and longer, checking peers."""
        if not self._late(generation):
            return
        now = time.monotonic()
        spin_until, next_check, nap = now + SPIN_TIME, now + CHECK_INTERVAL, FIRST_NAP
        while late := self._late(generation):
            now = time.monotonic()
            if now >= next_check:
                self._check(late)
                next_check = now + CHECK_INTERVAL
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"rank(s) {late} did not reach the all-reduce in time")
            if now < spin_until:
                os.sched_yield()
                continue
            time.sleep(nap)
            nap = min(2 * nap, LAST_NAP)

    def _check(self, late: list[int]) -> None:
        """Raise ``PeerLeft`` if a rank of ``late`` exited or left."""
        dead = set(self._watch.dead())
        gone = [peer for peer in late if self._pids[peer] in dead or self._lines[peer * _LINE + _LEFT_AT]]
        if gone:
            raise PeerLeft(f"rank(s) {gone} exited or left the all-reduces before this one")

    def close(self) -> None:
        """Let go of the mapping and the peers' descriptors (the tensors' views must be gone).  Idempotent."""
        if self._file.closed:
            return
        self._watch.close()
        self._generations.release()
        self._lines.release()
        del self._buffers
        with contextlib.suppress(BufferError):  # a view outlives this (a caller's traceback): the mapping goes with it
            self._file.close()


def _word(rank: int, word: int = 0) -> int:
    """The index, in u64 words, of word ``word`` of ``rank``'s line (0: its generation)."""
    return rank * _LINE // 8 + word


def _buffers_at(world: int) -> int:
    """Where the buffers start: the first page after the ranks' lines."""
    return -(-world * _LINE // mmap.PAGESIZE) * mmap.PAGESIZE


def _map(name: str) -> mmap.mmap | None:
    """The file ``name`` (of this library's prefix) mapped; ``None`` where it cannot be (logged at debug level)."""
    if not name.startswith(NAME_PREFIX) or os.sep in name:
        raise ValueError(f"name={name!r} is not a segment name of this library")
    try:
        fd = os.open(segment_path(name), os.O_RDWR)
    except OSError as error:
        _LOGGER.debug("cannot open the shared-memory all-reduce's file: %s", error)
        return None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    except OSError as error:
        _LOGGER.debug("cannot map the shared-memory all-reduce's file: %s", error)
        return None
    finally:
        os.close(fd)
