"""Choosing the transport for a group, with every rank: shared memory on one host, else the group itself."""

from __future__ import annotations

import datetime
import itertools
import logging
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Final, Literal

import torch
import torch.distributed as dist

from .._core.checks import check_choice, disagreement
from .._core.errors import EpLinkError, EpSetupError, ring_setup_failed
from .._core.protocol import ProtocolVersion
from .._core.transport import EpTransport
from .._core.words import U32_TYPECODE
from .._engine.link import EpLink, side_of
from .._engine.settings import DEFAULT_COMMAND_TIMEOUT
from .._host.liveness import host_fingerprint
from .._shm.transport import RING_SETUP_ERRORS, ShmTransport, setup_reason, shm_supported
from .._shm.waiting import DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME
from .._torch.heartbeat import DEFAULT_HEAD_LOST_AFTER, DEFAULT_HEARTBEAT, checked_liveness, tcp_store
from .._torch.hosts import HostsTransport
from .._torch.regroup import GroupRegroup, beats_of
from .._torch.transport import TorchTransport, watch_liveness
from .groups import DEFAULT_IDLE_TIMEOUT

_LOGGER = logging.getLogger("metrale_model_engine.torch")

TransportKind = Literal["auto", "shm", "torch"]
"""Which transport carries the protocol: see [`open_transport`][metrale_model_engine.torch.open_transport]."""

TRANSPORT_KINDS: Final[tuple[TransportKind, ...]] = ("auto", "shm", "torch")
_NAME_WORDS: Final[int] = 16
"""u32 words that carry the ring's name from the head in the rendezvous (64 bytes)."""
_LINKS = itertools.count()
"""Links this process opened over the default group: each one's keys in the store (every rank counts alike)."""


def open_transport(
    kind: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
    max_spin_time: float = DEFAULT_MAX_SPIN_TIME,
    heartbeat: float | None = DEFAULT_HEARTBEAT,
    head_lost_after: float | None = DEFAULT_HEAD_LOST_AFTER,
) -> TorchTransport | ShmTransport | HostsTransport:
    """The transport for ``group`` (default: the world group), chosen by every rank together.

    Collective over the group.  The ranks first agree on ``kind`` (each must pass
    the same; a plain ``str``, say from configuration, is checked here) and compare
    where they run, then:

    * ``"auto"`` (the default): shared memory when every rank is on one host with a
      usable ``/dev/shm`` (Linux on x86-64 or arm64); across hosts, a
      [`HostsTransport`][metrale_model_engine.torch.HostsTransport] (one broadcast to a leader per remote host, a ring
      on each host of several ranks), or [`TorchTransport`][metrale_model_engine.torch.TorchTransport] when no host
      holds two ranks; if a ring cannot be set up on some rank, rank 0 logs a warning and
      every rank uses [`TorchTransport`][metrale_model_engine.torch.TorchTransport];
    * ``"shm"``: shared memory, else [`EpSetupError`][metrale_model_engine.EpSetupError] on every rank, with the
      same text on each (which ranks failed, and why);
    * ``"torch"``: the group's own broadcasts ([`TorchTransport`][metrale_model_engine.torch.TorchTransport]).

    Each host's lowest rank creates its ring, the name travels over the group, the
    others attach; the ring's name is removed from ``/dev/shm`` once all attached.
    ``device``, ``heartbeat`` and ``head_lost_after`` go to
    [`TorchTransport`][metrale_model_engine.torch.TorchTransport] (the liveness of ranks across hosts), ``spin_time``
    and ``max_spin_time`` to [`ShmTransport`][metrale_model_engine.shm.ShmTransport].

    Returns:
        The chosen transport, the caller's to close (or an ``EpLink``'s, given it).
        Code that needs a [`TorchTransport`][metrale_model_engine.torch.TorchTransport]'s ``group`` or ``device`` checks
        the type first: a ``ShmTransport`` or a [`HostsTransport`][metrale_model_engine.torch.HostsTransport] has
        neither.

    Raises:
        TypeError, ValueError: ``kind`` is not one of ``TRANSPORT_KINDS``, or
            ``heartbeat`` or ``head_lost_after`` is not a positive number of seconds
            or ``None``, or ``head_lost_after`` is shorter than 4 heartbeats
            (checked before the group is touched).
        EpSetupError: the ranks asked for different kinds, or ``"shm"`` cannot be had.
        EpLinkError: an exchange over the group failed (the message names which); a ring this
            rank made or attached is closed first.
    """
    chosen = check_choice("transport", kind, TRANSPORT_KINDS)
    liveness = checked_liveness(heartbeat, head_lost_after)
    base = TorchTransport(group, device=device, heartbeat=None)  # beats only once it is kept: not for a ring
    try:
        transport = _choose(base, chosen, (spin_time, max_spin_time))
    except BaseException:
        base.close()
        raise
    if not isinstance(transport, ShmTransport):  # base itself, or the whole group's part of a HostsTransport
        watch_liveness(base, *liveness)
    return transport


def _choose(
    base: TorchTransport, chosen: TransportKind, spins: tuple[float, float]
) -> TorchTransport | ShmTransport | HostsTransport:
    """``open_transport`` past its checks: every rank's kind and host over ``base``, then the choice."""
    with _exchange(base, "gathering every rank's kind and host"):
        everyone = base.gather([TRANSPORT_KINDS.index(chosen), *_host_words()])
    problem = disagreement(base.rank, "transport", [TRANSPORT_KINDS[words[0]] for words in everyone], repr)
    if problem is not None:
        raise EpSetupError(problem)
    hosts = ranks_by_host(everyone)
    if chosen == "shm" and len(hosts) > 1:
        elsewhere = sorted(rank for host in hosts[1:] for rank in host)
        raise EpSetupError(
            f"transport='shm' needs every rank on one Linux host with /dev/shm, but rank(s) "
            f"{elsewhere} are not on rank 0's host, or cannot run it; use transport='auto' or 'torch'"
        )
    if chosen == "torch" or base.world_size == 1 or all(len(host) == 1 for host in hosts):
        return base
    ring = _host_rings(base, chosen, hosts, spins)
    if isinstance(ring, TorchTransport):  # auto, and a ring failed somewhere
        return ring
    if len(hosts) == 1:
        assert ring is not None  # one host of several ranks: every rank holds its ring
        base.close()  # only the choice used it: the ranks of one host watch each other through pidfds
        return ring
    try:
        return _leaders(base, hosts, ring)
    except BaseException:
        if ring is not None:
            ring.close()
        raise


def open_link(
    kind: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    num_slots: int,
    protocol: ProtocolVersion | None = None,
    seq_id_on_wire: bool = True,
    command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    device: torch.device | None = None,
    spin_time: float = DEFAULT_SPIN_TIME,
    max_spin_time: float = DEFAULT_MAX_SPIN_TIME,
    heartbeat: float | None = DEFAULT_HEARTBEAT,
    head_lost_after: float | None = DEFAULT_HEAD_LOST_AFTER,
) -> EpLink:
    """An [`EpLink`][metrale_model_engine.EpLink] over the transport ``open_transport`` chooses.

    Collective over the group.  The link owns the transport (closing it closes
    both); if the link's setup fails, the transport is closed before the error
    propagates.  Arguments as [`open_transport`][metrale_model_engine.torch.open_transport] and
    [`EpLink`][metrale_model_engine.EpLink].

    A link over the default group (``group=None``) whose model re-forms
    ([`LinkedEp.ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms]) forms again over the ranks left after a
    loss through the group's store: a new default group of them, renumbered, and over it
    the transport ``kind`` chooses (see [`reform_link`][metrale_model_engine.reform.reform_link]).
    """
    make = partial(
        open_transport,
        kind,
        device=device,
        spin_time=spin_time,
        max_spin_time=max_spin_time,
        heartbeat=heartbeat,
        head_lost_after=head_lost_after,
    )
    number = next(_LINKS)
    transport = make(group)
    try:
        link = EpLink(
            transport,
            num_slots=num_slots,
            protocol=protocol,
            seq_id_on_wire=seq_id_on_wire,
            command_timeout=command_timeout,
        )
    except BaseException:
        transport.close()
        raise
    regroup = _group_regroup(transport, group, partial(make, None), f"metrale_model_engine/reform/{number}", heartbeat)
    if regroup is not None:
        side_of(link).offer(regroup)
    return link


def _group_regroup(
    transport: EpTransport,
    group: dist.ProcessGroup | None,
    make: Callable[[], EpTransport],
    keys: str,
    period: float | None,
) -> GroupRegroup | None:
    """How ``transport``'s ranks form the next epoch of a link through the default group's store; ``None`` over
    another group, or a store that is not a ``TCPStore``."""
    world = dist.group.WORLD
    store = None if world is None or group not in (None, world) else tcp_store(world.get_group_store())
    if world is None or store is None:
        return None
    backend = dist.get_backend(world)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    bound = getattr(world, "bound_device_id", None)
    return GroupRegroup(
        store,
        keys,
        transport.rank,
        period,
        beats_of(transport, period),
        make,
        backend,
        bound,
        _timeout_of(world, device),
    )


def _host_words() -> list[int]:
    """[can run shm, the two words of ``host_fingerprint``]."""
    return [1, *host_fingerprint()] if shm_supported() else [0, 0, 0]


def ranks_by_host(rows: list[list[int]]) -> list[list[int]]:
    """The ranks by host, the head's first, from the gathered rows (a rank that cannot run a ring: a host alone)."""
    hosts: dict[tuple[int, ...], list[int]] = {}
    for rank, words in enumerate(rows):
        hosts.setdefault(tuple(words[1:]) if words[1] else (-1, rank), []).append(rank)
    return list(hosts.values())


def _host_rings(
    base: TorchTransport, kind: TransportKind, hosts: list[list[int]], spins: tuple[float, float]
) -> TorchTransport | ShmTransport | None:
    """One ring per host of several ranks: its lowest rank creates it, the name travels over ``base``, the others
    attach, every rank confirms.  This rank's ring (``None`` on a host alone), or ``base`` when ``auto`` falls back.

    A failed exchange over ``base`` raises ``EpLinkError`` naming its step; this rank's ring is closed on
    every way out but its return (its name removed from ``/dev/shm`` where this rank created it).
    """
    members = next(host for host in hosts if base.rank in host)
    ring: ShmTransport | None = None
    problem: str | None = None
    name_words = [0] * _NAME_WORDS
    try:
        if base.rank == members[0] and len(members) > 1:
            try:
                ring = ShmTransport.create(len(members), spin_time=spins[0], max_spin_time=spins[1])
                name_words = array(U32_TYPECODE, ring.name.encode().ljust(4 * _NAME_WORDS, b"\0")).tolist()
            except RING_SETUP_ERRORS as error:
                problem = setup_reason(error)
        with _exchange(base, "passing each ring's name to its host"):
            name = array(U32_TYPECODE, base.gather(name_words)[members[0]]).tobytes().rstrip(b"\0").decode()
        if base.rank != members[0] and name:
            try:
                ring = ShmTransport.attach(name, members.index(base.rank), spin_time=spins[0], max_spin_time=spins[1])
            except RING_SETUP_ERRORS as error:
                problem = setup_reason(error)
        failed = _failures(base, problem, "gathering whether every rank has its ring")
        if not failed and len(hosts) > 1:  # every rank, so that one ring's failed exchange fails every rank
            if ring is not None:
                try:
                    ring.gather([0])  # every reader attached: the head of the ring removes its name
                except Exception as error:  # noqa: BLE001  (said to every rank just below)
                    problem = f"the ring's setup exchange failed: {error}"
            failed = _failures(base, problem, "gathering whether every ring's setup exchange passed")
    except BaseException:
        if ring is not None:
            ring.close()
        raise
    if not failed:
        return ring
    if ring is not None:
        ring.close()
    failure = ring_setup_failed(failed)
    if kind == "auto":
        if base.rank == 0:
            _LOGGER.warning("%s; every rank uses torch.distributed", failure)
        return base
    raise failure


def _failures(base: TorchTransport, problem: str | None, step: str) -> dict[int, str]:
    """Every rank's setup problem over the whole group, by rank (collective; ``step`` names it in its error)."""
    reasons: list[object] = [None] * base.world_size
    with _exchange(base, step):
        dist.all_gather_object(reasons, problem, group=base.group)
    return {rank: str(reason) for rank, reason in enumerate(reasons) if reason is not None}


@contextmanager
def _exchange(base: TorchTransport, step: str) -> Iterator[None]:
    """One exchange of the choice over ``base``: its failure is an ``EpLinkError`` that names ``step``."""
    try:
        yield
    except Exception as error:
        raise EpLinkError(
            f"rank {base.rank}: choosing the transport failed while {step}: {type(error).__name__}: {error}"
        ) from error


def _leaders(base: TorchTransport, hosts: list[list[int]], ring: ShmTransport | None) -> HostsTransport:
    """The ``HostsTransport`` of this rank, with the group of the head and each host's lowest rank.

    Only those ranks make that group (``use_local_synchronization``), with the whole
    group's timeout: a leader's idle wait for the next command is bounded by it.
    """
    group = base.group
    assert group is not None  # open: the choice has just used it
    leaders = [host[0] for host in hosts]
    if base.rank not in leaders:
        return HostsTransport(base, None, ring, hosts=hosts)
    in_world = [rank if group is dist.group.WORLD else dist.get_global_rank(group, rank) for rank in leaders]
    subgroup = dist.new_group(in_world, timeout=_timeout_of(group, base.device), use_local_synchronization=True)
    assert subgroup is not None  # this rank is one of in_world
    leading = TorchTransport(subgroup, device=base.device, heartbeat=None)
    return HostsTransport(base, leading, ring, subgroup, hosts=hosts)


def _timeout_of(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta:
    """``group``'s own timeout, as its backend holds it (torch has no public reader); else the idle limit."""
    try:
        timeout = group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001  (a backend that does not say)
        return DEFAULT_IDLE_TIMEOUT
    return timeout if isinstance(timeout, datetime.timedelta) else DEFAULT_IDLE_TIMEOUT
