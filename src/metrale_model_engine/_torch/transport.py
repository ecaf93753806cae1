"""``TorchTransport``: messages over a torch.distributed group's own broadcasts (gloo, NCCL)."""

from __future__ import annotations

import datetime
import functools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Final

import torch
import torch.distributed as dist
from typing_extensions import Buffer

from .._core.codec import FRAME_PAYLOAD, FRAME_WORDS, answer_bytes, frame_length, frame_message
from .._core.transport import TransportClosed, TransportCorrupt, TransportTimeout
from .answers import append_text, last_words_key, pack_answers, unpack_answers
from .heartbeat import DEFAULT_HEAD_LOST_AFTER, DEFAULT_HEARTBEAT, Heartbeat, checked_liveness, tcp_store
from .watch import HeadWatch

_MAX_MESSAGE_WORDS: Final[int] = 1 << 30
"""A frame announcing more is corruption, not a message (4 GiB)."""
_FRAME_BYTES: Final[int] = 4 * FRAME_WORDS
_PAYLOAD_BYTES: Final[int] = 4 * FRAME_PAYLOAD
if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

_STORE_PAUSE: Final[float] = 0.01
"""Seconds between two looks of the head in the group's store."""
_LOGGER = logging.getLogger("metrale_model_engine.torch")


@functools.lru_cache(maxsize=8)
def _broadcast_options(timeout: float | None) -> dist.BroadcastOptions:
    """Options of a broadcast from the group's rank 0, bounded by ``timeout`` seconds.

    ``None`` keeps the group's own timeout.  Cached: a link uses one or two values.
    """
    options = dist.BroadcastOptions()
    options.rootRank = 0  # rank 0 of the group, whatever its global rank
    if timeout is not None:
        options.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
    return options


class TorchTransport:
    """An [`EpTransport`][metrale_model_engine.EpTransport] over a torch.distributed group.

    A message travels as one broadcast of a 16-word frame (its length and up to 15
    words) and, when longer, one broadcast of the rest (see
    [`metrale_model_engine.wire`][metrale_model_engine.wire]): at most two collectives per message, each of
    exactly the size the receivers expect.  Words travel as ``int32`` tensors
    holding the u32 bits (gloo and NCCL have no u32 type).  Under NCCL (or any
    non-CPU ``device``) the frame and the bulk are copied to and from device
    tensors.  A broadcast's ``timeout`` goes to the collective itself, so a wait
    that fires leaves nothing pending in the backend.  Errors are the backend's
    own (``RuntimeError`` from gloo; [`TransportTimeout`][metrale_model_engine.transport.TransportTimeout] when it says
    it timed out); ``EpLink`` maps them.

    The way back: a worker's answers are held until the head receives them at a
    sync point, point to point.  A worker that leaves with answers still held (it
    stopped the run) puts them in the group's store (``ProcessGroup.get_group_store``,
    torch's own rendezvous store, which outlives a broken collective) when it
    closes; the head reads them there ([`poll_answers`][metrale_model_engine.torch.TorchTransport.poll_answers]) once a
    collective or a send has failed.

    Liveness across hosts: every worker beats in the same store (see
    ``metrale_model_engine.torch``): the head names the workers that went silent
    when a send or a sync point fails ([`silent_ranks`][metrale_model_engine.torch.TorchTransport.silent_ranks]);
    workers silent for ``head_lost_after`` seconds while the head waits on them (a send, a sync point,
    an all-reduce of ``Collectives``) are lost ([`lost_ranks`][metrale_model_engine.torch.TorchTransport.lost_ranks]),
    and the wait ends then; and a worker that cannot reach the store for ``head_lost_after``
    seconds logs why and ends its process with status
    [`HEAD_LOST_EXIT_CODE`][metrale_model_engine.torch.HEAD_LOST_EXIT_CODE].  One bound, both ways.

    Args:
        group: the process group; default the world group.  Its rank 0 is the head.
        device: where collective tensors live; default CPU for gloo and the current
            CUDA device for NCCL.
        heartbeat: seconds between two beats of a worker; ``None``: no beats (then
            nothing is watched across hosts).
        head_lost_after: seconds a worker goes on without reaching the store before
            it ends its process, and the head waits on workers whose heartbeat
            stopped, at least 4 heartbeats; ``None``: each waits as long as its own
            bound allows.

    Raises:
        RuntimeError: torch.distributed is not initialised, or this process is not
            in ``group``.
        TypeError, ValueError: ``heartbeat`` or ``head_lost_after`` is not a
            positive number of seconds or ``None``, or ``head_lost_after`` is
            shorter than 4 heartbeats.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        heartbeat: float | None = DEFAULT_HEARTBEAT,
        head_lost_after: float | None = DEFAULT_HEAD_LOST_AFTER,
    ) -> None:
        liveness = checked_liveness(heartbeat, head_lost_after)
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(torchrun) or metrale_model_engine.torch.init_local_group first"
            )
        if group is None:
            group = dist.group.WORLD
            assert group is not None  # initialised above
        self._group: dist.ProcessGroup | None = group
        rank = dist.get_rank(group)
        if rank < 0:
            raise RuntimeError("this process is not a member of the given process group")
        self.rank: Final = rank
        self.world_size: Final = dist.get_world_size(group)
        if device is None:
            uses_nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl else torch.device("cpu")
        self._device = device
        self._frame = bytearray(_FRAME_BYTES)
        self._frame_host = torch.frombuffer(self._frame, dtype=torch.int32)
        on_host = device.type == "cpu"
        self._frame_tensor = self._frame_host if on_host else torch.empty_like(self._frame_host, device=device)
        self._frame_words = memoryview(self._frame).cast("I")
        self._inbox = bytearray(4096)
        self._held: list[bytes] = []  # a worker's answers, until the next flush
        self._head = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        self._store: Store | None = _group_store(group)
        self._gathered = False  # the first gather (the link's setup) has run
        self._taken: dict[int, int] = {}  # by worker: how much of its last words (hex digits) the head has read
        self._next_look = 0.0  # the head's next look in the store, by time.monotonic()
        self._heartbeat: Heartbeat | None = None
        self._watch: HeadWatch | None = None
        # The head's waits on the group run inside it, so that workers found lost end them (.watch).
        self._blocking: Callable[[], AbstractContextManager[object]] = nullcontext
        watch_liveness(self, *liveness)
        OPEN_TRANSPORTS.add(self)

    @property
    def device(self) -> torch.device:
        """Where the collective tensors live."""
        return self._device

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group; ``None`` once closed."""
        return self._group

    def close(self) -> None:
        """Drop this transport's reference to its process group; later sends and receives fail.

        A worker with answers still held puts them in the group's store first (best
        effort), for a head whose collective failed.  Idempotent.  Called for every
        open transport when the interpreter exits (see ``metrale_model_engine.torch``);
        the group itself is the program's to destroy.
        """
        OPEN_TRANSPORTS.discard(self)
        held, self._held = self._held, []
        self.leave_answers(self.rank, held)
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._watch is not None:
            self._watch.stop()
        self._group = None
        self._store = None

    def leave_answers(self, rank: int, answers: Sequence[bytes]) -> None:
        """Worker: put worker ``rank``'s answers that will not reach a sync point in the group's store.

        Best effort: a failure is only logged.  What [`close`][metrale_model_engine.torch.TorchTransport.close] does
        with this rank's held answers; a transport that relays other ranks' answers (a host's
        leader in [`HostsTransport`][metrale_model_engine.torch.HostsTransport]) calls it for theirs.  Appended to what
        the rank left before; the head reads each answer once
        ([`poll_answers`][metrale_model_engine.torch.TorchTransport.poll_answers]).
        """
        if not answers or self._store is None or self._group is None:
            return
        try:  # appended: a leader may leave a reader's answers as the reader leaves its own
            append_text(self._store, last_words_key(rank), pack_answers(answers).hex())  # the store takes text
        except Exception as error:  # noqa: BLE001  (the head, which serves the store, may be gone)
            _LOGGER.debug("worker rank %d could not leave its answers in the store: %s", rank, error)

    def silent_ranks(self) -> list[int]:
        """Head: the workers whose heartbeat stopped; waits a few beats at most (see the class).

        Empty without heartbeats, and when the store cannot be read.
        """
        return [] if self._watch is None else self._watch.silent(range(1, self.world_size))

    def lost_ranks(self) -> dict[int, float]:
        """Head: the workers found silent for ``head_lost_after`` while the head waited on them, each with how long.

        Once some are, every wait of this process on the group has been ended (see
        ``metrale_model_engine.torch``); empty while none is, and without heartbeats.
        """
        return {} if self._watch is None else self._watch.lost()

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Head: the message as its frame, then, past 15 words, one bulk broadcast."""
        group = self._open_group()
        if self.world_size == 1:
            return
        message = parts[0] if len(parts) == 1 else bytearray().join(parts)
        frame, rest = frame_message(message)
        self._frame[:] = frame
        self._broadcast(group, self._frame_host, self._frame_tensor, timeout, sending=True)
        if rest is not None:
            bulk = torch.frombuffer(bytearray(rest) if rest.readonly else rest, dtype=torch.int32)
            self._broadcast(group, bulk, None, timeout, sending=True)

    def receive(self, timeout: float | None) -> memoryview:
        """Worker: the frame, then the bulk it announces; the message is valid until the next receive."""
        group = self._open_group()
        self._broadcast(group, self._frame_host, self._frame_tensor, timeout, sending=False)
        words = frame_length(self._frame_words)
        if words > _MAX_MESSAGE_WORDS:
            raise TransportCorrupt(f"a frame announced a message of {words} words: the link is out of step")
        size = 4 * words
        if size <= _PAYLOAD_BYTES:
            return memoryview(self._frame)[4 : 4 + size]
        if size > len(self._inbox):
            self._inbox = bytearray(max(size, 2 * len(self._inbox)))  # a new one: views of the old stay valid
        inbox = memoryview(self._inbox)
        inbox[:_PAYLOAD_BYTES] = memoryview(self._frame)[4:]
        bulk = torch.frombuffer(inbox[_PAYLOAD_BYTES:size], dtype=torch.int32)
        self._broadcast(group, bulk, None, timeout, sending=False)
        return inbox[:size]

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Every rank's ``words``: one all-reduce of a row per rank, bounded by ``timeout`` (``None``: the group's)."""
        values = list(words)
        rows = torch.zeros(self.world_size, len(values), dtype=torch.int64, device=self._device)
        rows[self.rank] = torch.tensor(values, dtype=torch.int64)
        options = dist.AllreduceOptions()
        if timeout is not None:
            options.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        group = self._open_group()
        group.allreduce([rows], options).wait()
        if not self._gathered:  # every rank is past its setup: last words of an earlier link are stale
            self._gathered = True
            self._forget_last_words()
            # and no rank leaves new ones before they are gone (one more collective, at the first gather only)
            group.allreduce([torch.zeros(1, device=self._device)], options).wait()
        return [row.tolist() for row in rows.cpu()]

    # -- the way back: answers travel point to point, at sync points only -------

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Worker: hold one answer until ``flush_answers`` (a worker sends only while the head receives)."""
        if self.rank == 0:
            raise TransportClosed("the head does not answer")
        self._held.append(bytes(answer_bytes(answer)))

    def flush_answers(self, timeout: float | None) -> None:
        """Worker, at a sync point: every held answer to the head, as a count and one payload (two sends)."""
        held, self._held = self._held, []
        self.send_answers(held, timeout)

    def send_answers(self, answers: Sequence[bytes], timeout: float | None) -> None:
        """Worker, at a sync point: ``answers`` (any size) to the head, which takes them with ``receive_answers``.

        What [`flush_answers`][metrale_model_engine.torch.TorchTransport.flush_answers] sends; a host's leader in
        [`HostsTransport`][metrale_model_engine.torch.HostsTransport] sends its host's answers with it.
        """
        group = self._open_group()
        payload = pack_answers(answers)
        self._point_to_point(group, torch.tensor([len(answers), len(payload) // 4], dtype=torch.int32), timeout, True)
        if payload:
            self._point_to_point(group, torch.frombuffer(payload, dtype=torch.int32), timeout, True)

    def answers_ready(self) -> bool:
        """Nothing arrives between sync points over a group."""
        return False

    def poll_answers(self) -> list[tuple[int, bytes]]:
        """Head: the answers workers left in the store (see the class), each taken once, by worker in the order left.

        Between sync points nothing else arrives over a group.  A look costs a store
        round trip per worker, so it happens at most every 10 ms; the link looks only
        once something has failed.
        """
        store = self._store
        now = time.monotonic()
        if store is None or self.rank != 0 or now < self._next_look:
            return []
        self._next_look = now + _STORE_PAUSE
        found: list[tuple[int, bytes]] = []
        for rank in range(1, self.world_size):
            key = last_words_key(rank)
            if not store.check([key]):
                continue
            words = store.get(key).decode()
            taken, self._taken[rank] = self._taken.get(rank, 0), len(words)
            found += [(rank, answer) for answer in unpack_answers(bytes.fromhex(words[taken:]))]
        return found

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Head, at a sync point: worker ``rank``'s flushed answers (after ``timeout``, the group is broken)."""
        group = self._open_group()
        count = torch.zeros(2, dtype=torch.int32)
        self._point_to_point(group, count, timeout, False, rank)
        _, words = count.tolist()
        if not words:
            return []
        payload = torch.zeros(words, dtype=torch.int32)
        self._point_to_point(group, payload, timeout, False, rank)
        return unpack_answers(payload.numpy().tobytes())

    def _forget_last_words(self) -> None:
        """Head, once every rank is past the setup: remove answers an earlier link over this group left."""
        if self.rank != 0 or self._store is None:
            return
        for rank in range(1, self.world_size):
            try:
                self._store.delete_key(last_words_key(rank))
            except Exception as error:  # noqa: BLE001  (a store without deletion: the look stays harmless)
                _LOGGER.debug("could not clear the store's key for worker rank %d: %s", rank, error)

    def _point_to_point(
        self, group: dist.ProcessGroup, host: torch.Tensor, timeout: float | None, sending: bool, rank: int = 0
    ) -> None:
        peer = self._head if sending else dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank
        tensor = host if self._device.type == "cpu" else host.to(self._device)
        work = dist.isend(tensor, dst=peer, group=group) if sending else dist.irecv(tensor, src=peer, group=group)
        assert work is not None  # this process is a member of the group
        try:
            with self._blocking():
                if timeout is None:
                    work.wait()
                else:
                    work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as error:
            if _timed_out(error):
                raise TransportTimeout(str(error)) from error
            raise
        if not sending and tensor is not host:
            host.copy_(tensor)

    def _broadcast(
        self,
        group: dist.ProcessGroup,
        host: torch.Tensor,
        device_tensor: torch.Tensor | None,
        timeout: float | None,
        *,
        sending: bool,
    ) -> None:
        # The process group's own broadcast, called directly: the same collective as
        # torch.distributed.broadcast without its per-call Python checks, which cost
        # more than the transfer of a header (measured in
        # docs/benchmarks.md, 'The protocol over gloo and over shared memory').  The
        # timeout goes to the collective itself, not to the wait: a wait that timed
        # out would leave the receive pending inside the backend, where it would
        # swallow the head's next broadcast and block the process at exit.
        try:
            with self._blocking():
                if self._device.type == "cpu":
                    group.broadcast([host], _broadcast_options(timeout)).wait()
                    return
                tensor = device_tensor if device_tensor is not None else torch.empty_like(host, device=self._device)
                if sending:
                    tensor.copy_(host)
                group.broadcast([tensor], _broadcast_options(timeout)).wait()
        except RuntimeError as error:
            if _timed_out(error):
                raise TransportTimeout(str(error)) from error
            raise
        if not sending:
            host.copy_(tensor)

    def _open_group(self) -> dist.ProcessGroup:
        group = self._group
        if group is None:
            raise TransportClosed("the TorchTransport was closed; its process group is no longer used")
        return group


def _group_store(group: dist.ProcessGroup) -> Store | None:
    """The group's own store, where torch offers it (``ProcessGroup.get_group_store``), else ``None``."""
    try:
        return group.get_group_store()
    except Exception as error:  # noqa: BLE001  (an older torch, or a backend without a store)
        _LOGGER.debug("no store for this process group: %s", error)
        return None


def group_waits(transport: TorchTransport) -> Callable[[], AbstractContextManager[object]]:
    """What each of this process's waits on ``transport``'s group runs inside.

    On a head that watches its workers' heartbeats: the watch, which ends every
    wait on the group once a worker is found lost; otherwise ``nullcontext``.  Read
    once the transport is kept (``open_transport`` starts the watch last).
    """
    return transport._blocking


def watch_liveness(transport: TorchTransport, period: float | None, lost_after: float | None) -> None:
    """Start a worker's heartbeat, or the head's reading of them (arguments of ``checked_liveness``).

    Called once per transport: at its construction, or by ``open_transport`` once it keeps
    the transport it made with ``heartbeat=None`` to choose.
    """
    group = transport._group
    if period is None or transport.world_size == 1 or group is None:
        return
    if transport.rank == 0:
        tcp = tcp_store(transport._store)
        workers = range(1, transport.world_size)
        if tcp is not None:
            transport._watch = HeadWatch.start(group.group_name, tcp, workers, period, lost_after)
        if transport._watch is not None:
            transport._blocking = transport._watch.blocking
    else:
        transport._heartbeat = Heartbeat.start(group.group_name, transport._store, transport.rank, period, lost_after)


def _timed_out(error: RuntimeError) -> bool:
    """Whether the backend's error says it waited its whole timeout (gloo and NCCL raise a ``RuntimeError``)."""
    return "timed out" in str(error).lower()


OPEN_TRANSPORTS: Final[set[TorchTransport]] = set()
"""Every transport not yet closed, held until its close: the exit hook closes them.

Held, not weakly referenced: a worker that drops its link without closing it (its
program ends on an error) still says in the store, at exit, that it left, so the
head does not name it silent; its heartbeat beats until then.
"""
