"""Peers for the benchmarks: how other Python engines broadcast a head's commands to its workers on one host.

* :class:`PickleRing`: vLLM's ``MessageQueue`` over its ``ShmRingBuffer``
  (``vllm/distributed/device_communicators/shm_broadcast.py``), local readers only: a shared-memory ring of
  chunks with per-reader flags, one pickle per message, a 1-byte wake-up per message and readers that spin for
  a second after each read before they block.
* :class:`ShmEventChannel`: nano-vllm's ``ModelRunner.write_shm``/``read_shm``
  (``nanovllm/engine/model_runner.py``): one shared block and one ``multiprocessing.Event`` per worker.
* :func:`broadcast_pyobj`: SGLang's ``broadcast_pyobj`` (``sglang/srt/utils.py``): pickle plus two
  ``torch.distributed`` broadcasts (size, bytes); :func:`broadcast_object_list_peer`: torch's own
  ``broadcast_object_list``.

Readers and workers are meant to be started with the ``spawn`` method, their handle passed as a ``Process``
argument.  ``python benchmarks/peers.py`` runs :func:`selfcheck` (exit status 0 when every check passes).
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import math
import multiprocessing
import os
import pickle
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, TypeVar

import tests_path  # noqa: F401  (puts tests/ on the path, for helpers)

from helpers.usage import cpu_share

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from multiprocessing.context import BaseContext, SpawnContext
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event, Semaphore
    from types import TracebackType

    from torch.distributed import ProcessGroup

SPIN_WINDOW_S = 1.0  # a reader busy-waits this long after its last read before it blocks (vLLM: 1 s)
POLL_CAP_MS = 5000  # an idle reader re-reads the flags at least this often (vLLM's recheck interval)
_LEN = 4  # bytes of the native length word at the head of a chunk
_FENCE = threading.Lock()
_PATCH = threading.Lock()
_C = TypeVar("_C", bound="_Closing")


def _fence() -> None:
    """Full memory barrier as vLLM's ``memory_fence`` makes it: take and release an uncontended lock."""
    with _FENCE:
        pass


def _open_untracked(name: str) -> SharedMemory:
    """Attach to the block ``name`` without this process's resource tracker ever unlinking it.

    Unregistering after attaching is wrong for spawned children: they share their parent's tracker, so the
    unregister drops the creator's own registration and the creator's ``unlink`` then makes the tracker print a
    ``KeyError``.  Like vLLM, keep ``register`` from running at all (Python 3.13+: ``track=False``).
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    with _PATCH:
        saved = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = saved


def _buf(shm: SharedMemory) -> memoryview:
    if shm.buf is None:
        raise ValueError("the shared memory block is closed")
    return shm.buf


class _Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class PickleRingHandle:
    """What a reader needs to attach: the block's name, the ring's geometry, one wake-up socket per reader.

    The sockets cross to a child only through multiprocessing's own pickler (a ``Process`` argument).
    """

    name: str
    readers: int
    max_chunks: int
    chunk_bytes: int
    notify: tuple[socket.socket, ...]
    writer_ends: tuple[socket.socket, ...] = ()
    """The writer's ends of the wake-up sockets, for :meth:`PickleRing.attach_writer` in another process."""


class PickleRing(_Closing):
    """One writer, ``readers`` readers: vLLM's ``MessageQueue``/``ShmRingBuffer`` for readers on the same host.

    Layout: ``max_chunks`` chunks of ``chunk_bytes`` (a native 4-byte length, then the pickle), then per chunk one
    *written* byte and one *read* byte per reader.  Strict FIFO on both sides.  The writer spins with
    ``os.sched_yield`` until its next chunk was never written or was read by every reader (so it never overwrites
    an unread chunk), publishes it behind lock fences, then writes one byte to every reader's socket (vLLM: a
    1-byte zmq message per enqueue; a full socket drops it, as zmq's high-water mark of 1 does).  A reader spins
    for :data:`SPIN_WINDOW_S` after its last read, then blocks in ``poll`` (at most :data:`POLL_CAP_MS` a time);
    a wake-up is only a hint, the flags decide.  It unpickles straight from the chunk and marks it read even when
    unpickling fails.  Messages whose pickle does not fit a chunk raise ``ValueError`` (vLLM sends those over
    zmq).  As in vLLM, a writer waits for ever on a dead reader unless given a timeout.  Beyond vLLM, only what
    the sockets force: a reader whose writer closed raises ``EOFError`` once the ring is empty, instead of
    waking in a loop.
    """

    def __init__(
        self, shm: SharedMemory, handle: PickleRingHandle, reader: int | None, socks: tuple[socket.socket, ...]
    ) -> None:
        self.handle, self._shm, self._reader, self._socks = handle, shm, reader, socks
        chunks, size, width, buf = handle.max_chunks, handle.chunk_bytes, 1 + handle.readers, _buf(shm)
        meta = chunks * size
        self._data = [buf[i * size : (i + 1) * size] for i in range(chunks)]
        self._lens = [d[:_LEN].cast("I") for d in self._data]
        self._meta = [buf[meta + i * width : meta + (i + 1) * width] for i in range(chunks)]
        self._idx = 0
        self._last_read = time.monotonic()
        self._writer_gone = False
        self._closed = False
        self._attached = False  # a writer by attach_writer: its close leaves the block and the handle alone
        self._poller = select.poll()
        if reader is not None:
            self._poller.register(socks[0], select.POLLIN)

    @classmethod
    def create(cls, readers: int, *, max_chunks: int = 10, chunk_bytes: int = 1 << 20) -> PickleRing:
        """Create the block and the wake-up sockets; the caller is the writer and must ``close()`` (unlinks)."""
        if readers < 1 or max_chunks < 1 or chunk_bytes <= _LEN or chunk_bytes % 8:
            raise ValueError("need readers >= 1, max_chunks >= 1 and chunk_bytes a positive multiple of 8")
        meta = max_chunks * chunk_bytes
        shm = SharedMemory(create=True, size=meta + max_chunks * (1 + readers))
        _buf(shm)[meta : meta + max_chunks * (1 + readers)] = bytes(max_chunks * (1 + readers))
        pairs = [socket.socketpair() for _ in range(readers)]
        writer_ends = tuple(a for a, _ in pairs)
        handle = PickleRingHandle(shm.name, readers, max_chunks, chunk_bytes, tuple(b for _, b in pairs), writer_ends)
        return cls(shm, handle, None, writer_ends)

    @classmethod
    def attach_writer(cls, handle: PickleRingHandle) -> PickleRing:
        """Be the writer of a ring another process created (the creator stays its owner: it unlinks)."""
        ring = cls(_open_untracked(handle.name), handle, None, tuple(end.dup() for end in handle.writer_ends))
        ring._attached = True
        return ring

    @classmethod
    def attach(cls, handle: PickleRingHandle, reader: int) -> PickleRing:
        """Attach as reader ``reader`` (0 .. readers-1), in any process; ``close()`` never unlinks."""
        if not 0 <= reader < handle.readers:
            raise ValueError(f"reader {reader} out of range for {handle.readers} readers")
        return cls(_open_untracked(handle.name), handle, reader, (handle.notify[reader].dup(),))

    def enqueue(self, obj: object, timeout: float | None = None) -> None:
        """Publish ``obj`` to every reader; waits for a free chunk (``TimeoutError`` after ``timeout`` s)."""
        if self._reader is not None:
            raise RuntimeError("only the creator of a PickleRing enqueues")
        with io.BytesIO() as bio:
            pickler = pickle.Pickler(bio, protocol=5)
            # vLLM copies copyreg's table for every message (to add its tensor reducer): same cost here.
            pickler.dispatch_table = dict(copyreg.dispatch_table)
            pickler.dump(obj)
            data = bio.getvalue()
        n = len(data)
        if _LEN + n > self.handle.chunk_bytes:
            raise ValueError(f"pickle of {n} bytes does not fit a {self.handle.chunk_bytes}-byte chunk")
        idx, readers = self._idx, self.handle.readers
        meta = self._meta[idx]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            _fence()
            if not meta[0] or sum(meta[1:]) == readers:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("PickleRing: no free chunk")
            os.sched_yield()
        meta[0] = 0
        self._lens[idx][0] = n
        self._data[idx][_LEN : _LEN + n] = data
        for r in range(1, readers + 1):
            meta[r] = 0
        _fence()
        meta[0] = 1
        _fence()
        self._idx = (idx + 1) % self.handle.max_chunks
        for sock in self._socks:
            # A full socket already holds a wake-up; a closed one belongs to a reader that is gone.
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
                sock.send(b"\x00", socket.MSG_DONTWAIT)

    def dequeue(self, timeout: float | None = None) -> object:
        """Next object in FIFO order; ``TimeoutError`` after ``timeout`` s (0 or less: only if none is ready)."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("the writer of a PickleRing cannot dequeue")
        idx, flag = self._idx, 1 + reader
        meta = self._meta[idx]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            _fence()
            if meta[0] and not meta[flag]:
                break
            if self._writer_gone:
                raise EOFError("PickleRing: the writer closed")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError("PickleRing: nothing to read")
            if now - self._last_read < SPIN_WINDOW_S:
                os.sched_yield()
                continue
            wait_ms = POLL_CAP_MS if deadline is None else min(POLL_CAP_MS, math.ceil((deadline - now) * 1000))
            if self._poller.poll(wait_ms):
                self._drain()
        try:
            return pickle.loads(self._data[idx][_LEN : _LEN + self._lens[idx][0]])
        finally:
            meta[flag] = 1
            _fence()
            self._idx = (idx + 1) % self.handle.max_chunks
            self._last_read = time.monotonic()

    def _drain(self) -> None:
        while True:
            try:
                got = self._socks[0].recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not got:
                self._writer_gone = True
                return

    def close(self) -> None:
        """Release the views and sockets; the creator also unlinks the block.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for view in (*self._lens, *self._data, *self._meta):
            view.release()
        owner = self._reader is None and not self._attached
        for sock in (*self._socks, *self.handle.notify, *self.handle.writer_ends) if owner else self._socks:
            sock.close()
        self._shm.close()
        if owner:
            self._shm.unlink()


@dataclass(frozen=True)
class ShmEventHandle:
    """The block's name and size and one ``Event`` per worker (pass it to ``spawn`` as a ``Process`` argument)."""

    name: str
    size: int
    events: tuple[Event, ...]


class ShmEventChannel(_Closing):
    """nano-vllm's head-to-workers path: one shared block, one ``multiprocessing.Event`` per worker.

    ``call`` pickles (default protocol, as nano-vllm) into the block as a 4-byte little-endian length and the
    pickle, then sets every worker's event; ``receive`` waits for its event, reads the length, unpickles and
    then clears the event, in nano-vllm's order.  There is no acknowledgement: a ``call`` may overwrite the block
    before a slow worker read it, and an event set between a worker's unpickle and its clear is lost.  nano-vllm
    relies on the model's collectives to keep the ranks in lockstep; a benchmark must do the same (an ack).
    """

    def __init__(self, shm: SharedMemory, handle: ShmEventHandle, reader: int | None) -> None:
        self.handle, self._shm, self._reader = handle, shm, reader
        self._closed = False
        self._attached = False  # a head by attach_head: its close leaves the block to its creator

    @classmethod
    def create(cls, readers: int, *, size: int = 1 << 20, context: BaseContext) -> ShmEventChannel:
        """Create block and events on the head, before spawning; the head must ``close()`` (unlinks)."""
        shm = SharedMemory(create=True, size=size)
        return cls(shm, ShmEventHandle(shm.name, size, tuple(context.Event() for _ in range(readers))), None)

    @classmethod
    def attach_head(cls, handle: ShmEventHandle) -> ShmEventChannel:
        """Be the head of a channel another process created (the creator stays its owner: it unlinks)."""
        channel = cls(_open_untracked(handle.name), handle, None)
        channel._attached = True
        return channel

    @classmethod
    def attach(cls, handle: ShmEventHandle, reader: int) -> ShmEventChannel:
        """Attach as worker ``reader`` (0 .. readers-1); ``close()`` never unlinks."""
        if not 0 <= reader < len(handle.events):
            raise ValueError(f"reader {reader} out of range for {len(handle.events)} readers")
        return cls(_open_untracked(handle.name), handle, reader)

    def call(self, obj: object) -> None:
        """Head: write ``obj`` and wake every worker (``ValueError`` if the pickle does not fit)."""
        data = pickle.dumps(obj)
        n = len(data)
        if n + 4 > self.handle.size:
            raise ValueError(f"pickle of {n} bytes does not fit a {self.handle.size}-byte block")
        buf = _buf(self._shm)
        buf[0:4] = n.to_bytes(4, "little")
        buf[4 : n + 4] = data
        for event in self.handle.events:
            event.set()

    def receive(self, timeout: float | None = None) -> object:
        """Worker: the object of the latest ``call``; ``TimeoutError`` after ``timeout`` s."""
        if self._reader is None:
            raise RuntimeError("the head of a ShmEventChannel cannot receive")
        event = self.handle.events[self._reader]
        if not event.wait(None if timeout is None else max(0.0, timeout)):
            raise TimeoutError("ShmEventChannel: no call")
        buf = _buf(self._shm)
        obj = pickle.loads(buf[4 : int.from_bytes(buf[0:4], "little") + 4])
        event.clear()
        return obj

    def close(self) -> None:
        """Unmap; the head also unlinks.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shm.close()
        if self._reader is None and not self._attached:
            self._shm.unlink()


def broadcast_pyobj(obj: object, group: ProcessGroup | None = None) -> object:
    """SGLang's ``broadcast_pyobj`` over ``group`` (a gloo group; its rank 0 is the source).

    The source pickles, broadcasts the size as one int64 and the bytes as a uint8 tensor, and returns ``obj``;
    the others receive the size, allocate, receive and unpickle.  An empty list sends only the size 0 (SGLang's
    idle step), and a receiver returns ``[]`` for it.
    """
    import torch
    import torch.distributed as dist

    if dist.get_rank(group) == 0:
        if isinstance(obj, list) and not obj:
            dist.broadcast(torch.tensor([0], dtype=torch.long), group=group, group_src=0)
            return obj
        data = pickle.dumps(obj)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), group=group, group_src=0)
        dist.broadcast(payload, group=group, group_src=0)
        return obj
    size = torch.tensor([0], dtype=torch.long)
    dist.broadcast(size, group=group, group_src=0)
    n = int(size.item())
    if n == 0:
        return []
    payload = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(payload, group=group, group_src=0)
    return pickle.loads(bytes(payload.numpy()))


def broadcast_object_list_peer(obj: object, group: ProcessGroup | None = None) -> object:
    """``torch.distributed.broadcast_object_list([obj])`` from rank 0 of ``group``; returns the object."""
    import torch.distributed as dist

    box = [obj if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


# --- selfcheck: python benchmarks/peers.py ----------------------------------------------------------------------

_SIZES = (0, 1, 7, 100, 4096, 65_536, 200_000)
_GLOO_OBJECTS: tuple[object, ...] = ([], ("step", 7, [1, 2, 3]), None, list(range(1000)), {"k": b"\x01" * 100_000})


def _message(i: int, cap: int = 200_000) -> tuple[str, int, bytes]:
    """Message ``i``: its bytes repeat ``i``, so that a torn or stale read cannot pass for it."""
    base = _SIZES[i % len(_SIZES)]
    size = min(cap, base - (i * 31) % 64 if base > 64 else base)
    return ("msg", i, (i.to_bytes(4, "little") * (size // 4 + 1))[:size])


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _raises(kind: type[BaseException], call: Callable[[], object]) -> float:
    """Seconds until ``call()`` raised ``kind``; ``AssertionError`` if it returned."""
    start = time.monotonic()
    try:
        call()
    except kind:
        return time.monotonic() - start
    raise AssertionError(f"expected {kind.__name__}")


def _ring_reader(handle: PickleRingHandle, reader: int, count: int, cap: int, delay_s: float) -> None:
    with PickleRing.attach(handle, reader) as ring:
        for i in range(count):
            _check(ring.dequeue(timeout=30) == _message(i, cap), f"PickleRing reader {reader}: message {i} wrong")
            time.sleep(delay_s)


def _idle_reader(handle: PickleRingHandle, out: Queue[float]) -> None:
    with PickleRing.attach(handle, 0) as ring:
        _check(ring.dequeue(timeout=30) == "first", "PickleRing idle reader: first message wrong")
        out.put(0.0)
        sent = ring.dequeue(timeout=30)
        out.put(time.monotonic() - sent if isinstance(sent, float) else 99.0)


def _event_worker(handle: ShmEventHandle, reader: int, count: int, ack: Semaphore) -> None:
    with ShmEventChannel.attach(handle, reader) as chan:
        for i in range(count):
            _check(chan.receive(timeout=30) == _message(i), f"ShmEventChannel worker {reader}: message {i} wrong")
            ack.release()


def _gloo_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for obj in _GLOO_OBJECTS:
            for peer in (broadcast_pyobj, broadcast_object_list_peer):
                got = peer(obj if rank == 0 else None)
                _check(got == obj, f"{peer.__name__} on rank {rank}: {obj!r:.40} came back as {got!r:.40}")
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _children(ctx: SpawnContext, target: Callable[..., None], *arg_lists: tuple[object, ...]) -> Iterator[list[int]]:
    """Start one child per argument tuple and yield their pids; then join them all by one deadline (at once if the
    body raised), kill any left, and require every exit status to be 0."""
    procs = [ctx.Process(target=target, args=args, daemon=True) for args in arg_lists]
    for proc in procs:
        proc.start()
    try:
        yield [proc.pid or 0 for proc in procs]
        deadline = time.monotonic() + 120
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    _check(all(proc.exitcode == 0 for proc in procs), f"children exited with {[p.exitcode for p in procs]}")


def _check_ring(ctx: SpawnContext, names: list[str]) -> str:
    for readers in (2, 3):
        with PickleRing.create(readers) as ring:
            names.append(ring.handle.name)
            with _children(ctx, _ring_reader, *[(ring.handle, r, 2000, 200_000, 0.0) for r in range(readers)]):
                for i in range(2000):
                    ring.enqueue(_message(i), timeout=30)
    count, delay = 40, 0.01
    with PickleRing.create(2, max_chunks=4, chunk_bytes=4096) as ring:
        names.append(ring.handle.name)
        with _children(ctx, _ring_reader, (ring.handle, 0, count, 2000, 0.0), (ring.handle, 1, count, 2000, delay)):
            ring.enqueue(_message(0, 2000), timeout=30)
            start = time.monotonic()
            for i in range(1, count):
                ring.enqueue(_message(i, 2000), timeout=30)
            waited = time.monotonic() - start
    _check(waited > (count - 6) * delay * 0.8, f"the writer did not wait for the slow reader ({waited:.3f} s)")
    return f"2,000 messages to 2 and to 3 readers, all in order; 4 chunks, a 10 ms reader: writer waited {waited:.2f} s"


def _check_ring_local(ctx: SpawnContext, names: list[str]) -> str:
    writer = PickleRing.create(1, max_chunks=2, chunk_bytes=4096)
    names.append(writer.handle.name)
    with writer, PickleRing.attach(writer.handle, 0) as reader:
        for timeout in (0.0, -1.0, 0.2):
            took = _raises(TimeoutError, lambda: reader.dequeue(timeout))  # noqa: B023 (called at once)
            _check(max(0.0, timeout) <= took < max(0.0, timeout) + 0.5, f"timeout {timeout}: {took:.3f} s")
        _raises(ValueError, lambda: writer.enqueue(b"x" * 4096))
        writer.enqueue(1)
        writer.enqueue(2)
        _raises(TimeoutError, lambda: writer.enqueue(3, timeout=0.1))  # full: no overwrite of unread chunks
        _check(reader.dequeue(0) == 1, "FIFO broken")
        writer.enqueue(3, timeout=1)
        _check([reader.dequeue(0), reader.dequeue(0)] == [2, 3], "FIFO broken")
        writer.close()
        _raises(EOFError, lambda: reader.dequeue(timeout=5))
    return "dequeue timeouts 0, -1, 0.2 s; oversize; full ring; FIFO; EOFError after the writer closed"


def _check_ring_idle(ctx: SpawnContext, names: list[str]) -> str:
    out: Queue[float] = ctx.Queue()
    with PickleRing.create(1, max_chunks=4, chunk_bytes=4096) as ring:
        names.append(ring.handle.name)
        with _children(ctx, _idle_reader, (ring.handle, out)) as pids:
            ring.enqueue("first", timeout=30)
            out.get(timeout=30)
            read_at = time.monotonic()
            spinning = cpu_share(0.6, pids[0])
            time.sleep(max(0.0, read_at + 1.5 - time.monotonic()))
            idle = cpu_share(1.0, pids[0])
            ring.enqueue(time.monotonic(), timeout=30)
            wake = out.get(timeout=30)
    _check(idle < 0.10, f"an idle reader used {idle:.0%} of a core")
    _check(wake < 1.0, f"an idle reader took {wake:.3f} s to wake")
    return f"reader CPU {spinning:.0%} of a core in its spin window, {idle:.0%} idle; woke in {wake * 1e3:.2f} ms"


def _check_events(ctx: SpawnContext, names: list[str]) -> str:
    ack = ctx.Semaphore(0)
    for readers in (2, 3):
        with ShmEventChannel.create(readers, context=ctx) as chan:
            names.append(chan.handle.name)
            with _children(ctx, _event_worker, *[(chan.handle, r, 2000, ack) for r in range(readers)]):
                for i in range(2000):
                    chan.call(_message(i))
                    for _ in range(readers):  # the lockstep nano-vllm gets from the model's collectives
                        _check(ack.acquire(timeout=30), f"no ack for message {i}")
    with ShmEventChannel.create(1, size=4096, context=ctx) as head, ShmEventChannel.attach(head.handle, 0) as worker:
        names.append(head.handle.name)
        for timeout in (0.0, -1.0, 0.2):
            _raises(TimeoutError, lambda: worker.receive(timeout))  # noqa: B023 (called at once)
        _raises(ValueError, lambda: head.call(b"x" * 4096))
        head.call(("run", 1))
        _check(worker.receive(timeout=1) == ("run", 1), "round trip broken")
    return "2,000 acked messages to 2 and to 3 workers, all in order; timeouts 0, -1, 0.2 s; oversize"


def _check_gloo(ctx: SpawnContext, names: list[str]) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with _children(ctx, _gloo_rank, (0, port), (1, port)):
        pass
    return f"{len(_GLOO_OBJECTS)} objects (an empty list among them) each way, on 2 gloo ranks"


def selfcheck() -> None:
    """Check every peer, readers and ranks in spawned processes; ``AssertionError`` at the first failure."""
    ctx = multiprocessing.get_context("spawn")
    names: list[str] = []
    begin = time.monotonic()
    for title, run in [
        ("PickleRing streams", _check_ring),
        ("PickleRing in one process", _check_ring_local),
        ("PickleRing idle reader", _check_ring_idle),
        ("ShmEventChannel", _check_events),
        ("broadcast_pyobj, broadcast_object_list_peer", _check_gloo),
    ]:
        start = time.monotonic()
        detail = run(ctx, names)
        print(f"ok  {title}: {detail} ({time.monotonic() - start:.1f} s)", flush=True)
    left = [name for name in names if os.path.exists(f"/dev/shm/{name}")]
    _check(not left, f"shared memory left behind: {left}")
    print(f"all checks passed in {time.monotonic() - begin:.1f} s, no /dev/shm block left behind", flush=True)


if __name__ == "__main__":
    selfcheck()
