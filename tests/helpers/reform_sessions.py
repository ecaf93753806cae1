"""Rank programs that kill ranks of a run whose model re-forms its link; each runs in a process of ``run_group``.

:class:`Sharded` is a tensor-parallel MLP like the README's: each rank holds its
share of the hidden units, a FORWARD command's all-reduce sums them; its weights
and inputs are small integers, so every sum is exact in float32 whatever the world
size and order: the head checks each output against the whole MLP, computed alone.
It opts in (``ep_reforms``) and reshards in ``ep_reformed``.  A NOTE command (no
collective) is what a sync point waits behind.

A *plan* says, by step, which rank (by its rank at the start) dies and where:

* ``idle``: the head kills it between two commands, then sends the next;
* ``hook``: it kills itself in its FORWARD hook, before the all-reduce (mid-command);
* ``all-reduce``: it kills itself inside the all-reduce (the head enters it late);
* ``sync``: it kills itself while the head waits at a sync point (behind a NOTE);

and ``forming`` (a rank at the start, or -1) is killed by the head as it forms the
first re-form's epoch, before the ranks' setup agreement over it: a loss during the
recovery, which begins again without it; ``fails`` (a rank at the start, or -1) lives
but fails the setup agreement of the first epoch it joins, before the agreement's
collective, while the other members wait on it there.  A model that does not opt in
(``fixed``) shows what a run without re-forms does.

Every rank saves what it saw (``rank_results``): the head its outputs, each stop's
message, each re-form and when each kill struck; every rank whether sockets and
threads of the old group are left, and its pid, for the test to look for leftovers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from metrale_model_engine import EpLink, EpTransport, LinkedEp, RunStopped, SequenceState, run_worker
from metrale_model_engine._engine.link import side_of
from metrale_model_engine.reform import Reform, reform_link
from metrale_model_engine.shm import ShmTransport
from metrale_model_engine.torch import Collectives, open_link
from metrale_model_engine.toy import ToyModel, ToyState, slots_digest
from metrale_model_engine.transport import Regroup, TransportTimeout

from helpers.rank_results import note, save

FORWARD, NOTE = 2, 3
HIDDEN, WIDTH = 12, 4
"""Hidden units (12: shared evenly by 1, 2, 3 and 4 ranks) and the width of an output."""
TIMEOUT = 20.0
"""Seconds a command, an all-reduce and a re-form may take in these programs."""
QUIET = logging.getLogger("tests.reform.quiet")
QUIET.setLevel(logging.CRITICAL)

Slots = MutableSequence[SequenceState | None]
Plan = dict[int, tuple[str, int]]
"""By step: what kills which rank (its rank at the start), as the module says."""


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole MLP: small integers, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    up = torch.randint(-2, 3, (HIDDEN, WIDTH), generator=generator).float()
    down = torch.randint(-2, 3, (WIDTH, HIDDEN), generator=generator).float()
    return up, down


def expected(step: int) -> list[float]:
    """The whole MLP's output for ``step``, computed alone."""
    up, down = weights()
    return (torch.relu(torch.full((1, WIDTH), float(step)) @ up.T) @ down.T).flatten().tolist()


class Sharded(LinkedEp[SequenceState]):
    """The tensor-parallel MLP (see the module); ``origin`` is this process's rank at the start."""

    __slots__ = ("collectives", "down", "ep_link", "origin", "out", "plan", "reforms", "up")
    ep_collective_commands = frozenset({FORWARD})
    ep_reforms = True

    def __init__(self, link: EpLink, plan: Plan, out: str) -> None:
        self.ep_link = link
        self.collectives = Collectives(link, timeout=TIMEOUT)
        self.origin = link.rank
        self.plan = plan
        self.out = out
        self.reforms: list[tuple[int, int, int]] = []  # (epoch, rank, world size) after each re-form
        self.shard()

    def shard(self) -> None:
        """This rank's share of the hidden units, for its rank and world size now."""
        rank, size = self.ep_link.rank, self.ep_link.world_size
        up, down = weights()
        mine = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
        self.up, self.down = up[mine], down[:, mine]

    def mlp(self, step: int) -> torch.Tensor:
        out = torch.relu(torch.full((1, WIDTH), float(step)) @ self.up.T) @ self.down.T
        fault = self.fault(step)
        if fault == "hook":
            self.strike()
        elif fault == "all-reduce":
            threading.Timer(0.03, self.strike).start()  # the head enters its all-reduce 0.1 s late
        self.collectives.all_reduce(out)
        return out

    def fault(self, step: int) -> str:
        """This rank's fault at ``step`` of the plan, if any."""
        what, victim = self.plan.get(step, ("", -1))
        return what if victim == self.origin else ""

    def strike(self) -> None:
        """Die now, noting when (``time.monotonic()``: one clock for the host)."""
        note(self.out, f"struck{self.origin}", at=time.monotonic())
        os.kill(os.getpid(), signal.SIGKILL)

    # -- head ------------------------------------------------------------------

    def forward(self, step: int) -> list[float]:
        self.ep_link.send_command(0, FORWARD, step)
        with self.ep_link.collective():
            if self.plan.get(step, ("", 0))[0] == "all-reduce":
                time.sleep(0.1)  # so that the victim waits inside the all-reduce when it dies
            return self.mlp(step).flatten().tolist()

    # -- worker ------------------------------------------------------------------

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        step = self.ep_link.recv_word()
        if cmd == FORWARD:
            self.mlp(step)
        elif cmd == NOTE and self.fault(step) == "sync":
            threading.Timer(0.03, self.strike).start()
            time.sleep(1.0)  # dies here, while the head waits at its sync point
        elif cmd != NOTE:
            super().ep_run_command(seq_id, cmd, slots)

    def ep_reformed(self, reform: Reform, slots: Slots) -> None:
        self.reforms.append((reform.epoch, reform.rank, reform.world_size))
        self.shard()


class Fixed(Sharded):
    """The same model, not opting in: a lost worker ends the run as without re-forms."""

    __slots__ = ()
    ep_reforms = False


def kill_as_it_forms(regroup: Regroup, pid: int, out: str, victim: int) -> None:
    """Head: kill ``pid`` (rank ``victim`` at the start) as ``regroup`` forms the first epoch, once its transport is
    made and before the setup agreement over it (its class's ``form`` wrapped, in this process alone)."""
    kind = type(regroup)
    form = kind.form

    def forming(self: Regroup, epoch: int, members: Sequence[int], deadline: float) -> EpTransport:
        transport = form(self, epoch, members, deadline)
        if epoch == 1 and victim in members:
            note(out, f"struck{victim}", at=time.monotonic())
            os.kill(pid, signal.SIGKILL)
        return transport

    kind.form = forming  # type: ignore[method-assign]  # this process's head alone


def join_late(regroup: Regroup, at: int, seconds: float) -> None:
    """Worker: check in ``seconds`` late for the ``at``-th re-form epoch it joins (1: the first), alive and beating
    or having left its transport (its class's ``join`` wrapped, in this process alone)."""
    kind = type(regroup)
    join = kind.join
    joins = [0]

    def joining(
        self: Regroup, epoch: int, rank: int, gone: Callable[[], Mapping[int, str]], deadline: float
    ) -> tuple[int, list[int]]:
        joins[0] += 1
        if joins[0] == at:
            time.sleep(seconds)
        return join(self, epoch, rank, gone, deadline)

    kind.join = joining  # type: ignore[method-assign]  # this process's worker alone


def fail_in_agreement(regroup: Regroup) -> None:
    """Worker: the setup agreement over the first epoch it attaches to fails on this rank before its collective (that
    transport's ``gather`` raises, as a wait that timed out here would), the process alive (its classes' ``attach`` and
    ``gather`` wrapped, in this process alone)."""
    kind = type(regroup)
    attach = kind.attach
    failing: list[EpTransport] = []

    def attaching(self: Regroup, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        transport = attach(self, epoch, members, rank, deadline)
        if failing:
            return transport
        failing.append(transport)
        made = type(transport)
        gather = made.gather

        def refusing(self: EpTransport, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
            if self is transport:
                raise TransportTimeout(f"epoch {epoch}'s setup agreement failed on this rank, before its collective")
            return gather(self, words, timeout)

        made.gather = refusing  # type: ignore[method-assign,assignment]  # this process's worker alone
        return transport

    kind.attach = attaching  # type: ignore[method-assign]  # this process's worker alone


def losses(
    rank: int, world_size: int, kind: str, plan: Plan, steps: int, out: str, forming: int = -1, fixed: bool = False,
    fails: int = -1,
) -> None:  # fmt: skip
    """Run ``steps`` FORWARD commands over ``open_link(kind)`` with the ranks of ``plan`` (and ``forming``) killed,
    ``fails`` failing its first re-form's agreement; save what each rank saw.  ``fixed``: the model does not opt in."""
    torch.set_num_threads(1)
    link = open_link(kind, num_slots=2, command_timeout=TIMEOUT, head_lost_after=5.0)
    model = (Fixed if fixed else Sharded)(link, plan, out)
    pids = model.ep_link.gather_u32(os.getpid())
    before = old_group()
    slots: Slots = [None, None]
    try:
        if rank == 0:
            regroup = side_of(link).regroup
            if forming >= 0 and regroup is not None:
                kill_as_it_forms(regroup, pids[forming], out, forming)
            head(model, pids, steps, before)
        else:
            regroup = side_of(link).regroup
            if rank == fails and regroup is not None:
                fail_in_agreement(regroup)
            logger = logging.getLogger(f"tests.reform.rank{rank}")
            logger.propagate = False
            summary = run_worker(model, slots, logger=logger, reform_timeout=TIMEOUT)
            save(out, rank, summary=summary, reforms=model.reforms, left=left_of(before), pid=os.getpid())
    except RunStopped as error:
        save(out, rank, error=type(error).__name__, message=str(error), pid=os.getpid())
        raise SystemExit(1) from None
    except Exception as error:  # noqa: BLE001  (whatever ended this rank, for the test to read)
        save(out, rank, error=type(error).__name__, message=str(error), pid=os.getpid())
        raise SystemExit(1) from None
    finally:
        model.ep_link.close()


def head(model: Sharded, pids: list[int], steps: int, before: tuple[set[str], int]) -> None:
    """The head's part of :func:`losses`: every step checked, each stop met with a re-form."""
    outs: list[list[float]] = []
    stops: list[str] = []
    reforms: list[Reform] = []
    slots: Slots = [None, None]
    step, out = 1, model.out
    while step <= steps:
        what, victim = model.plan.get(step, ("", -1))
        try:
            if what == "idle" and not any(f"struck{victim}" in path.name for path in Path(out).iterdir()):
                note(out, f"struck{victim}", at=time.monotonic())
                os.kill(pids[victim], signal.SIGKILL)
                time.sleep(0.05)  # dead by the next command: the head finds it there
            if what == "sync":
                model.ep_link.send_command(0, NOTE, step)
                model.ep_link.sync()
            result = model.forward(step)
            assert result == expected(step), (step, result, expected(step))
            outs.append(result)
            step += 1
        except RunStopped as stopped:
            stops.append(str(stopped))
            try:
                reforms.append(reform_link(model, slots, timeout=TIMEOUT))
            except RunStopped as refused:
                save(out, 0, stops=stops, refused=str(refused), outs=outs, pid=os.getpid())
                raise SystemExit(1) from None
            model.plan.pop(step, None)  # the fault struck: the step runs again in the new epoch
    model.ep_link.shutdown_workers()
    save(
        out,
        0,
        outs=outs,
        stops=stops,
        reforms=[reform_fields(reform) for reform in reforms],
        world_size=model.ep_link.world_size,
        epoch=model.ep_link.epoch,
        left=left_of(before),
        pid=os.getpid(),
    )


def reform_fields(reform: Reform) -> dict[str, object]:
    """What the tests read of a re-form, as plain values (its lost ranks as ``(rank, how)``, its times, its line)."""
    fields = ("epoch", "world_size", "ranks", "lost", "failures", "witnesses", "attempts")
    found = {name: getattr(reform, name) for name in fields}
    found["lost"] = [(lost.rank, lost.how) for lost in reform.lost]
    found["times"] = (reform.stopped_at, reform.began_at, reform.formed_at)
    found["line"] = str(reform)
    return found


def old_group() -> tuple[set[str], int]:
    """This process's connections of the group now (``socket:[inode]``, but the store's), and its thread count."""
    store = dist.group.WORLD.get_group_store() if dist.is_initialized() and dist.group.WORLD is not None else None
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    port = getattr(store, "port", -1)
    return {inode for inode, ports in tcp_sockets().items() if port not in ports}, threading.active_count()


def left_of(before: tuple[set[str], int]) -> dict[str, object]:
    """What is left of the first group once the run is over: its sockets still open here, and threads past its count
    (waited for a moment: a thread told to stop ends on its own)."""
    sockets, threads = before
    deadline = time.monotonic() + 3.0
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"sockets": sorted(sockets & set(tcp_sockets())), "threads": threading.active_count() - threads}


def tcp_sockets() -> dict[str, tuple[int, int]]:
    """This process's connected TCP sockets, by ``socket:[inode]``: the ports of both ends."""
    ends: dict[str, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01":  # established
                local, remote = (int(end.rsplit(":", 1)[1], 16) for end in fields[1:3])
                ends[f"socket:[{fields[9]}]"] = (local, remote)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return {inode: ports for inode, ports in ends.items() if inode in mine}


class ReformingToy(ToyModel):
    """The toy model opting in; ``victim`` (a rank at the start) dies in the decode that makes slot 0 ``dies_at`` long,
    once it applied it."""

    __slots__ = ("dies_at", "origin", "out", "reforms", "victim")
    ep_reforms = True

    def __init__(self, link: EpLink, out: str, victim: int, dies_at: int) -> None:
        super().__init__(link)
        self.out, self.origin, self.victim, self.dies_at = out, link.rank, victim, dies_at
        self.reforms: list[tuple[int, int, int]] = []

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[ToyState | None]) -> None:
        super().ep_run_command(seq_id, cmd, slots)
        state = slots[0]
        if self.origin == self.victim and state is not None and len(state.tokens) == self.dies_at:
            note(self.out, f"struck{self.origin}", at=time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL)

    def ep_reformed(self, reform: Reform, slots: MutableSequence[ToyState | None]) -> None:
        self.reforms.append((reform.epoch, reform.rank, reform.world_size))


def ring_losses(transport: ShmTransport, out: str) -> None:
    """Over one ring, no torch: the head kills rank 3 between commands, rank 1 dies in a decode; the rest goes on."""
    model = ReformingToy(EpLink(transport, num_slots=4), out, victim=1, dies_at=8)
    model.ep_link.state_digest = ring_digest
    pids = model.ep_link.gather_u32(os.getpid())
    slots: list[ToyState | None] = [None] * 4
    if transport.rank:
        summary = run_worker(model, slots, logger=QUIET, reform_timeout=TIMEOUT)
        save(out, transport.rank, summary=summary, reforms=model.reforms, digest=slots_digest(slots), pid=os.getpid())
        model.ep_link.close()
        return
    model.alloc(slots, 0)
    model.prefill(slots, 0, [5, 6, 7, 8])
    note(out, "struck3", at=time.monotonic())
    os.kill(pids[3], signal.SIGKILL)
    stops, reforms = [], []
    while len(slots[0].tokens) < 12:  # type: ignore[union-attr]  # allocated above
        try:
            model.decode(slots, 0)
            model.ep_link.sync(slots)
        except RunStopped as stopped:
            stops.append(str(stopped))
            reforms.append(reform_fields(reform_link(model, slots, timeout=TIMEOUT)))
    model.ep_link.shutdown_workers(slots)
    save(out, 0, stops=stops, reforms=reforms, digest=slots_digest(slots), pid=os.getpid())
    model.ep_link.close()


def ring_digest(slots: Sequence[ToyState | None]) -> int:
    """The toy's slots as a u64 digest, for the sync points."""
    return int(slots_digest(slots), 16)
