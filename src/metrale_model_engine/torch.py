"""The protocol over torch.distributed: gloo on CPU, NCCL on CUDA (extra ``torch``).

* :class:`TorchEp` is a :class:`~metrale_model_engine.WireEp` over a process group:
  inherit it and the model has the whole protocol; override ``ep_run_command``.
* :class:`TorchTransport` is the transport underneath, for models written against
  any transport (``ToyModel(TorchTransport(), num_slots=8)``).
* :func:`open_transport` picks the transport for a group, collectively: shared
  memory (:class:`~metrale_model_engine.shm.ShmTransport`) when every rank is on
  one host, torch.distributed otherwise; :class:`TorchEp` calls it.
* :func:`init_local_group` and :func:`run_local` start a group of N ranks on
  loopback for scripts and tests; under ``torchrun`` the caller's own
  ``init_process_group`` is used as it is.

Why shared memory by default: each gloo broadcast between two ranks of one host
is a loopback TCP round trip of 150-250 µs, against a few microseconds for the
ring, and commands are many small messages.  Only the command words take that
path; tensors stay wherever the model keeps them.

Timeouts.  A worker waits for the next header as long as the group's own timeout
allows; that is the idle limit, which :func:`init_local_group` sets to
:data:`DEFAULT_IDLE_TIMEOUT` (pass ``timeout=`` to ``init_process_group`` under
torchrun).  Follow-up words and payloads of a command in flight are bounded by the
model's ``command_timeout``.  A dead peer closes its sockets, which gloo reports at
once: the other ranks' next receive or send fails with an ``EpLinkError``.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import logging
import multiprocessing
import os
import socket
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import Final, Literal, cast

try:
    import torch
    import torch.distributed as dist
except ImportError as _missing:  # pragma: no cover - exercised in a torch-less venv
    raise ImportError(
        f"metrale_model_engine.torch needs PyTorch (import of {_missing.name or 'torch'!r} failed): install "
        "the 'torch' extra, pip install 'metrale-model-engine[torch]' (CPU build: pip install torch==2.13.0 first)"
    ) from _missing
try:
    import numpy  # noqa: F401  (torch's tensor/buffer conversions used here need it)
except ImportError as _missing:
    raise ImportError(
        "metrale_model_engine.torch needs numpy (torch's tensor/buffer conversions and "
        "broadcast_object_list use it): pip install 'metrale-model-engine[torch]' or pip install numpy"
    ) from _missing

from typing_extensions import Buffer, TypeVarTuple, Unpack

from ._errors import EpSetupError
from ._launch import check_launch, join_all
from ._model import S
from ._protocol import EpProtocol
from ._tokens import U32_TYPECODE, TokenArray
from ._transport import Broadcast
from ._wire import DEFAULT_COMMAND_TIMEOUT, WireEp
from ._words import U32_MAX, check_u32
from .shm import DEFAULT_SPIN_TIME, ShmTransport, shm_supported

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "TRANSPORT_KINDS",
    "TorchEp",
    "TorchTransport",
    "TransportKind",
    "cuda_available",
    "default_backend",
    "free_port",
    "init_group_from_env",
    "init_local_group",
    "open_transport",
    "run_local",
]

_LOGGER = logging.getLogger("metrale_model_engine.torch")

DEFAULT_IDLE_TIMEOUT: Final[datetime.timedelta] = datetime.timedelta(days=7)
"""Group timeout :func:`init_local_group` sets: how long an idle worker waits for a header."""


@functools.lru_cache(maxsize=8)
def _broadcast_options(timeout: float | None) -> dist.BroadcastOptions:
    """Options of a broadcast from the group's rank 0, bounded by ``timeout`` seconds.

    ``None`` keeps the group's own timeout.  Cached: a model uses one or two values.
    """
    options = dist.BroadcastOptions()
    options.rootRank = 0  # rank 0 of the group, whatever its global rank
    if timeout is not None:
        options.timeout = datetime.timedelta(seconds=timeout)
    return options


class TorchTransport:
    """An :class:`~metrale_model_engine.EpTransport` over a torch.distributed group.

    Words travel as ``int32`` tensors holding the u32 bits (gloo and NCCL have no
    u32 type); they wrap the caller's buffer without copying.  Under NCCL (or any
    non-CPU ``device``) a device tensor of the same size is kept per bound buffer
    and copied to and from.

    Args:
        group: the process group; default the world group.  Its rank 0 is the head.
        device: where collective tensors live; default CPU for gloo and the current
            CUDA device for NCCL.

    Raises:
        RuntimeError: torch.distributed is not initialised, or this process is not
            in ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None) -> None:
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

        _OPEN_TRANSPORTS.add(self)

    @property
    def device(self) -> torch.device:
        """Where the collective tensors live."""
        return self._device

    def close(self) -> None:
        """Drop this transport's reference to its process group; later broadcasts fail.

        Idempotent.  Called for every open transport when the interpreter exits (see
        :func:`_release_at_exit`); call it earlier to free the group sooner.
        """
        self._group = None

    def _open_group(self) -> dist.ProcessGroup:
        group = self._group
        if group is None:
            raise RuntimeError("the TorchTransport was closed; its process group is no longer used")
        return group

    def bind(self, words: Buffer) -> Broadcast:
        host = torch.frombuffer(words, dtype=torch.int32)
        # The process group's own broadcast, called directly: the same collective as
        # torch.distributed.broadcast without its per-call Python checks, which cost
        # more than the transfer of a header (see the README's benchmark).
        on_device = self._device.type != "cpu"
        tensors = [torch.empty_like(host, device=self._device) if on_device else host]
        is_head = self.rank == 0

        def broadcast(timeout: float | None) -> None:
            if on_device and is_head:
                tensors[0].copy_(host)
            # The timeout goes to the collective itself, not to the wait: a wait that
            # times out would leave the receive pending inside the backend, where it
            # would swallow the head's next broadcast and block the process at exit.
            self._open_group().broadcast(tensors, _broadcast_options(timeout)).wait()
            if on_device and not is_head:
                host.copy_(tensors[0])

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        mine = torch.tensor(list(words), dtype=torch.int64, device=self._device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._open_group())
        return [tensor.tolist() for tensor in everyone]


_OPEN_TRANSPORTS: Final[weakref.WeakSet[TorchTransport]] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Make a rank's exit clean even when its program never tore the group down.

    A gloo process group destroyed during interpreter teardown, after the modules
    it needs are half gone, aborts the process in about half of the exits
    ("terminate called without an active exception"); that happens whenever a
    Python reference to it (ours, in a live model) outlives
    ``destroy_process_group``.  At exit, before teardown, this drops the references
    of every open transport and destroys the default group if the program did not.
    """
    for transport in list(_OPEN_TRANSPORTS):
        transport.close()
    if dist.is_initialized():
        dist.destroy_process_group()


TransportKind = Literal["auto", "shm", "torch"]
"""Which transport carries the protocol: see :func:`open_transport`."""

TRANSPORT_KINDS: Final[tuple[TransportKind, ...]] = ("auto", "shm", "torch")
_NAME_WORDS: Final[int] = 16
"""u32 words that carry the ring's name from the head in the rendezvous (64 bytes)."""


def open_transport(
    kind: TransportKind = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
) -> TorchTransport | ShmTransport:
    """The transport for ``group`` (default: the world group), chosen by every rank together.

    Collective over the group.  The ranks first agree on ``kind`` (each must pass
    the same) and compare where they run, then:

    * ``"auto"`` (the default): shared memory when every rank is on one host with a
      usable ``/dev/shm`` (Linux on x86-64 or arm64), torch.distributed otherwise;
      if the ring cannot be set up on some rank, a warning is logged and every
      rank uses torch.distributed;
    * ``"shm"``: shared memory, else :class:`EpSetupError` on every rank;
    * ``"torch"``: the group's own broadcasts (:class:`TorchTransport`).

    The head creates the ring, its name travels over the group, the workers
    attach; the ring's name is removed from ``/dev/shm`` at the model's setup
    exchange.  ``device`` goes to :class:`TorchTransport`, ``spin_time`` to
    :class:`~metrale_model_engine.shm.ShmTransport`.

    Raises:
        TypeError, ValueError: ``kind`` is not one of :data:`TRANSPORT_KINDS`.
        EpSetupError: the ranks asked for different kinds, or ``"shm"`` cannot be
            had (the message names the ranks and why).
    """
    if not isinstance(kind, str):
        raise TypeError(f"transport must be one of {TRANSPORT_KINDS}, got {type(kind).__name__} {kind!r}")
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"transport={kind!r} is not a transport kind; accepted: {', '.join(TRANSPORT_KINDS)}")
    base = TorchTransport(group, device=device)
    everyone = base.gather([TRANSPORT_KINDS.index(kind), *_host_words()])
    kinds = [TRANSPORT_KINDS[words[0]] for words in everyone]
    if len(set(kinds)) > 1:
        per_rank = ", ".join(f"rank {rank}: {k!r}" for rank, k in enumerate(kinds))
        raise EpSetupError(f"rank {base.rank}: the ranks disagree on the transport ({per_rank})")
    elsewhere = [rank for rank, words in enumerate(everyone) if words[1:] != everyone[0][1:] or not words[1]]
    if kind == "torch" or base.world_size == 1 or (kind == "auto" and elsewhere):
        return base
    if elsewhere:
        raise EpSetupError(
            f"rank {base.rank}: transport='shm' needs every rank on one Linux host with /dev/shm, but rank(s) "
            f"{elsewhere} are not on rank 0's host, or cannot run it; use transport='auto' or 'torch'"
        )
    return _rendezvous(base, kind, spin_time)


def _host_words() -> list[int]:
    """[can run shm, two words of a fingerprint of this host's /dev/shm and pid namespace]."""
    if not shm_supported():
        return [0, 0, 0]
    facts = [os.uname().nodename, str(os.stat("/dev/shm").st_dev), str(os.stat("/proc/self/ns/pid").st_ino)]
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            facts.append(file.read().strip())
    except OSError:
        pass
    digest = hashlib.blake2b("\0".join(facts).encode(), digest_size=8).digest()
    return [1, int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]


def _rendezvous(base: TorchTransport, kind: TransportKind, spin_time: float) -> TorchTransport | ShmTransport:
    """Create the ring on the head, pass its name over ``base``, attach on the workers, confirm."""
    ring: ShmTransport | None = None
    problem: Exception | None = None
    name_words = [0] * _NAME_WORDS
    if base.rank == 0:
        try:
            ring = ShmTransport.create(base.world_size, spin_time=spin_time)
            name_words = array(U32_TYPECODE, ring.name.encode().ljust(4 * _NAME_WORDS, b"\0")).tolist()
        except (OSError, RuntimeError, ValueError) as error:  # no space, no platform, a bad segment
            problem = error
    name = array(U32_TYPECODE, base.gather(name_words)[0]).tobytes().rstrip(b"\0").decode()
    if base.rank != 0 and problem is None:
        try:
            ring = ShmTransport.attach(name, base.rank, spin_time=spin_time) if name else None
        except (OSError, RuntimeError, ValueError) as error:  # no space, no platform, a bad segment
            problem = error
        if ring is None and problem is None:
            problem = RuntimeError("the head could not create the ring")
    failed = [rank for rank, (ok,) in enumerate(base.gather([int(problem is None)])) if not ok]
    if not failed:
        assert ring is not None
        return ring
    if ring is not None:
        ring.close()
    reason = f"rank(s) {failed} could not set up the shared-memory ring" + (f" (here: {problem})" if problem else "")
    if kind == "auto":
        _LOGGER.warning("%s; every rank uses torch.distributed instead", reason)
        return base
    raise EpSetupError(f"rank {base.rank}: {reason}")


class TorchEp(WireEp[S]):
    """A model with the whole protocol over a torch.distributed process group.

    Inherit it (beside ``torch.nn.Module`` if the model is one) and override
    ``ep_run_command``; the head side of each command calls the broadcast methods.
    Construction is collective over the group: the ranks choose the transport
    (:func:`open_transport`: shared memory when they share a host) and check that
    they agree (see :class:`~metrale_model_engine.WireEp`).  Besides the core's
    token arrays, ``ep_broadcast_tokens`` takes a 1-D integer tensor.

    Args:
        num_slots: the slot count (``--max-batch-size``).
        group: the process group; default the world group, e.g. made by torchrun.
        protocol: default :meth:`EpProtocol.from_env`.
        v1_slot: ``seq_id`` in v1 headers too (see ``WireEp``).
        command_timeout: seconds for a command in flight (see ``WireEp``).
        device: see :class:`TorchTransport`.
        transport: ``"auto"`` (default), ``"shm"`` or ``"torch"``: see :func:`open_transport`.
        spin_time: seconds a waiting rank spins before it sleeps, over shared memory.
    """

    __slots__ = ()

    def __init__(
        self,
        *,
        num_slots: int,
        group: dist.ProcessGroup | None = None,
        protocol: EpProtocol | None = None,
        v1_slot: bool = True,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        device: torch.device | None = None,
        transport: TransportKind = "auto",
        spin_time: float = DEFAULT_SPIN_TIME,
    ) -> None:
        super().__init__(
            open_transport(transport, group, device=device, spin_time=spin_time),
            num_slots=num_slots,
            protocol=protocol,
            v1_slot=v1_slot,
            command_timeout=command_timeout,
        )

    def ep_broadcast_tokens(self, tokens: TokenArray | torch.Tensor) -> list[int]:
        """As :meth:`WireEp.ep_broadcast_tokens`; a tensor is checked and sent without a Python loop."""
        if not isinstance(tokens, torch.Tensor):
            return super().ep_broadcast_tokens(tokens)
        if self.rank != 0:
            return self.ep_recv_tokens(tokens.numel())
        words = _tensor_as_u32(tokens)
        super().ep_broadcast_tokens(words)
        return memoryview(words).tolist()


def _tensor_as_u32(tokens: torch.Tensor) -> Buffer:
    """A u32 buffer of a 1-D integer tensor's values; raises like the core's check."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D token array, got a {tokens.dim()}-D tensor")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integers, got a tensor of dtype {tokens.dtype}")
    values = tokens.detach().to(device="cpu", dtype=torch.int64)
    bad = ((values < 0) | (values > U32_MAX)).nonzero()
    if bad.numel():
        index = int(bad[0])
        check_u32(f"tokens[{index}]", int(values[index]))
    # int64 -> int32 keeps the low 32 bits: the u32 bit pattern.  numpy's stubs do
    # not declare the buffer protocol before Python 3.12, hence the cast.
    return memoryview(cast(Buffer, values.to(torch.int32).numpy())).cast("B").cast("I")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a local group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def cuda_available() -> bool:
    """Whether this process sees at least one CUDA device."""
    return torch.cuda.device_count() > 0


def default_backend(local_ranks: int) -> str:
    """NCCL when this machine has a CUDA device for each of its ``local_ranks``, else gloo."""
    return "nccl" if torch.cuda.device_count() >= local_ranks else "gloo"


def init_local_group(
    rank: int,
    world_size: int,
    *,
    port: int,
    backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_IDLE_TIMEOUT,
) -> None:
    """Initialise this process as ``rank`` of a ``world_size``-rank group on loopback.

    ``backend`` defaults to NCCL when there is a CUDA device per rank and gloo
    otherwise; under NCCL the process uses CUDA device ``rank % device_count``.
    ``timeout`` is the group timeout, which bounds an idle worker's wait for the
    next header.

    Raises:
        ValueError: ``rank`` is not in ``0 ..= world_size - 1``.
        RuntimeError: ``backend="nccl"`` on a machine without CUDA devices.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size} (0 ..= {world_size - 1})")
    _init_group(backend, rank, world_size, timeout, f"tcp://127.0.0.1:{port}", rank, world_size)


def init_group_from_env(*, backend: str | None = None, timeout: datetime.timedelta = DEFAULT_IDLE_TIMEOUT) -> None:
    """Initialise the default group from torchrun's variables (``env://``).

    The same backend and device choice as :func:`init_local_group`, per node:
    ``LOCAL_RANK`` picks the CUDA device, ``LOCAL_WORLD_SIZE`` (else
    ``WORLD_SIZE``) the default backend.

    Raises:
        RuntimeError: ``backend="nccl"`` on a machine without CUDA devices.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    _init_group(backend, local_rank, local_ranks, timeout, None, -1, -1)


def _init_group(
    backend: str | None,
    local_rank: int,
    local_ranks: int,
    timeout: datetime.timedelta,
    init_method: str | None,
    rank: int,
    world_size: int,
) -> None:
    if backend is None:
        backend = default_backend(local_ranks)
    device_id = None
    if backend == "nccl":
        devices = torch.cuda.device_count()
        if devices == 0:
            raise RuntimeError(
                "backend 'nccl' needs a CUDA device, and this machine has none "
                "(torch.cuda.device_count() == 0); use backend 'gloo'"
            )
        torch.cuda.set_device(local_rank % devices)
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


Ts = TypeVarTuple("Ts")


def _local_rank_main(
    target: Callable[..., None],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: tuple[object, ...],
) -> None:
    init_local_group(rank, world_size, port=port, backend=backend)
    try:
        target(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_local(
    target: Callable[[int, int, Unpack[Ts]], None],
    world_size: int,
    *args: Unpack[Ts],
    backend: str | None = None,
    timeout: float = 300.0,
) -> list[int]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Each process joins a local group (:func:`init_local_group`) first and leaves it
    after.  ``target`` and ``args`` must be picklable (the ``spawn`` start method).
    Processes still running after ``timeout`` seconds are killed.

    Returns:
        Every rank's exit code, by rank (0 for success; negative: killed by that signal).

    Raises:
        TypeError: ``world_size`` is not an int, or ``timeout`` not a number.
        ValueError: ``world_size < 1`` or ``timeout <= 0``.
    """
    check_launch(world_size, timeout)
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        context.Process(target=_local_rank_main, args=(target, rank, world_size, port, backend, args))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return join_all(processes, timeout)
