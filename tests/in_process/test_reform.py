"""The re-form of a link over the ranks left, in one process: the epoch every rank agrees on, and the sequence of
the head and of a worker over a pretend channel (every way it cannot re-form, said in one line)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, MutableSequence, Sequence
from typing import Any, cast

import pytest

from metrale_model_engine import (
    EpCommandRefused,
    EpLink,
    EpRoleError,
    EpSetupError,
    EpTransport,
    LinkedEp,
    ProtocolVersion,
    RunStopped,
    SequenceState,
    run_worker,
)
from metrale_model_engine._engine.link import side_of
from metrale_model_engine._engine.reform.worker import rejoin
from metrale_model_engine._engine.settings import LinkSettings, agree_on_setup
from metrale_model_engine._shm.regroup import RingRegroup
from metrale_model_engine._shm.segment import Layout, create_segment
from metrale_model_engine.reform import LostRank, Reform, reform_link
from metrale_model_engine.shm import shm_supported
from metrale_model_engine.transport import PeerLost, Regroup, TransportClosed, TransportTimeout
from metrale_model_engine.wire import WIRE_VERSION

from helpers.fakes import FakeTransport, no_slots
from helpers.messages import whole

QUIET = logging.getLogger("tests.reform.quiet")
QUIET.setLevel(logging.CRITICAL)


def settings(epoch: int) -> LinkSettings:
    checked = LinkSettings.checked(
        0, 3, num_slots=4, protocol=ProtocolVersion.V1, seq_id_on_wire=True, command_timeout=None
    )
    return LinkSettings(**{**vars(checked), "epoch": epoch})


def test_a_link_is_built_at_epoch_0() -> None:
    assert EpLink(FakeTransport(0, 2), num_slots=2).epoch == 0


def test_a_setup_of_an_older_epoch_is_refused_naming_the_ranks_that_missed_a_re_form() -> None:
    peers = [[WIRE_VERSION, 1, 1, 4, 1, 0, 0, 0], [WIRE_VERSION, 1, 1, 4, 2, 0, 0, 0]]
    with pytest.raises(EpSetupError) as refused:
        agree_on_setup(FakeTransport(0, 3, peers=peers), settings(2))
    assert str(refused.value) == (
        "rank 0: the ranks disagree on the epoch (rank 0: 2, rank 1: 1, rank 2: 2); every rank must use the same "
        "value; rank(s) [1] are of an epoch older than the head's: they missed a re-form of the link"
    )


def test_a_setup_of_a_later_epoch_than_the_heads_is_refused_too() -> None:
    peers = [[WIRE_VERSION, 1, 1, 4, 3, 0, 0, 0], [WIRE_VERSION, 1, 1, 4, 2, 0, 0, 0]]
    later = r"rank\(s\) \[1\] are of an epoch later than the head's: the link re-formed"
    with pytest.raises(EpSetupError, match=later):
        agree_on_setup(FakeTransport(0, 3, peers=peers), settings(2))


# -- the sequence, over a pretend channel -------------------------------------------------------


class FakeRegroup:
    """A re-form channel of pretend ranks: ``alive`` live (the others were killed); the epochs of ``failing`` do not
    form (the highest member is lost as each fails); a worker's ``join`` gives ``joined`` (or raises it)."""

    def __init__(self, alive: set[int], failing: tuple[int, ...] = (), joined: tuple[int, list[int]] = (1, [])):
        self.alive, self.failing, self.joined = alive, failing, joined
        self.calls: list[str] = []

    def wake(self) -> None:
        self.calls.append("wake")

    def survivors(
        self, epoch: int, candidates: Sequence[int], lost: dict[int, str], gone: Callable[[], Mapping[int, str]],
        deadline: float,
    ) -> list[int]:  # fmt: skip
        for rank in candidates:
            if rank and rank not in self.alive:
                lost.setdefault(rank, "was killed by SIGKILL")
        return [rank for rank in candidates if rank not in lost]

    def form(self, epoch: int, members: Sequence[int], deadline: float) -> EpTransport:
        self.calls.append(f"form {epoch} {list(members)}")
        if epoch in self.failing:
            self.alive.discard(max(members))  # lost meanwhile: the next epoch goes without it
            raise PeerLost(f"rank {max(members)} died before every rank could answer the gather")
        return FakeTransport(0, len(members))

    def abandon(self, transport: EpTransport) -> None:
        self.calls.append("abandon")
        transport.close()

    def join(
        self, epoch: int, rank: int, gone: Callable[[], Mapping[int, str]], deadline: float
    ) -> tuple[int, list[int]]:
        self.calls.append(f"join {epoch}")
        if isinstance(self.joined, Exception):
            raise self.joined
        return self.joined

    def attach(self, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        return FakeTransport(members.index(rank), len(members))

    def leave(self, rank: int, why: str) -> None:
        self.calls.append(f"leave {rank}: {why}")

    def end(self) -> None:
        self.calls.append("end")

    def carried(self, transport: EpTransport) -> Regroup | None:
        self.calls.append("carried")
        return self

    def close(self) -> None:
        self.calls.append("close")


class Opting(LinkedEp[SequenceState]):
    """A model that re-forms, and notes each re-form its hook is told of."""

    ep_reforms = True

    def __init__(self, link: EpLink, *, broken: bool = False) -> None:
        self.ep_link = link
        self.told: list[tuple[int, int, int]] = []
        self.broken = broken

    def ep_reformed(self, reform: Reform, slots: MutableSequence[SequenceState | None]) -> None:
        if self.broken:
            raise KeyError("a shard it cannot find")
        self.told.append((reform.epoch, reform.rank, reform.world_size))


class NotOpting(Opting):
    ep_reforms = False


def running_head(regroup: FakeRegroup) -> Opting:
    """A head of 3 pretend ranks over ``regroup``, whose run goes on."""
    head = Opting(EpLink(FakeTransport(0, 3), num_slots=2))
    side_of(head.ep_link).offer(regroup)
    return head


def stopped_head(world_size: int, regroup: FakeRegroup | None, model: type[Opting] = Opting) -> Opting:
    """A head of ``world_size`` pretend ranks over ``regroup``, whose run stopped in a collective."""
    head = model(EpLink(FakeTransport(0, world_size), num_slots=2))
    if regroup is not None:
        side_of(head.ep_link).offer(regroup)
    head.ep_link.collective_failed(RuntimeError("Connection closed by peer"), grace=0.0)
    return head


def test_the_head_forms_the_next_epoch_over_the_ranks_left_and_its_model_is_told() -> None:
    regroup = FakeRegroup(alive={1, 2})
    head = stopped_head(4, regroup)
    slots: list[SequenceState | None] = [None, None]
    reform = reform_link(head, slots, timeout=5.0)
    assert (reform.epoch, reform.rank, reform.world_size, reform.ranks, reform.attempts) == (1, 0, 3, (0, 1, 2), 1)
    assert reform.lost == (LostRank(3, "was killed by SIGKILL"),)
    assert str(reform).startswith("the link re-formed at epoch 1: 3 rank(s) of 4 in ")
    assert str(reform).endswith(" ms (worker rank 3 was killed by SIGKILL)")
    assert reform.stopped_at <= reform.began_at <= reform.formed_at
    link = head.ep_link
    assert (link.epoch, link.world_size, link.stopped, link.closed) == (1, 3, None, False)
    assert head.told == [(1, 0, 3)]
    assert regroup.calls == ["wake", "form 1 [0, 1, 2]", "carried"]
    link.send_command(0, 7)  # the new epoch runs commands
    link.close()
    assert regroup.calls[-2:] == ["end", "close"]  # the owner's close: no re-form comes


def test_a_rank_lost_while_the_epoch_forms_makes_the_head_begin_again_without_it() -> None:
    regroup = FakeRegroup(alive={1, 2}, failing=(1,))
    reform = reform_link(stopped_head(4, regroup), no_slots(), timeout=5.0)
    assert (reform.epoch, reform.world_size, reform.attempts) == (2, 2, 2)
    assert regroup.calls[1:3] == ["form 1 [0, 1, 2]", "form 2 [0, 1]"]


def test_with_every_worker_lost_the_head_goes_on_alone() -> None:
    reform = reform_link(stopped_head(2, FakeRegroup(alive=set())), no_slots(), timeout=5.0)
    assert (reform.epoch, reform.world_size, reform.ranks) == (1, 1, (0,))


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (lambda: stopped_head(3, FakeRegroup({1, 2}), NotOpting), "its model does not re-form (LinkedEp.ep_reforms"),
        (lambda: stopped_head(3, None), "its transport leaves no way for the ranks to meet again"),
        (lambda: running_head(FakeRegroup({1})), "its run did not stop"),
        (lambda: stopped_head(3, FakeRegroup({1, 2})), "no worker rank was lost (the run stopped: head: the run"),
    ],
)
def test_the_head_says_in_one_line_why_it_cannot_re_form(head: Callable[[], Opting], why: str) -> None:
    with pytest.raises(RunStopped, match=rf"^head: the link cannot re-form: {re.escape(why)}"):
        reform_link(head(), no_slots(), timeout=5.0)


def test_a_head_whose_epochs_never_form_gives_up_at_its_bound() -> None:
    regroup = FakeRegroup(alive={1, 2}, failing=tuple(range(1, 100_000)))  # each epoch fails at once: the bound ends it
    with pytest.raises(RunStopped, match=r"^head: the link could not re-form within 0\.05 s: epoch \d+ of rank"):
        reform_link(stopped_head(4, regroup), no_slots(), timeout=0.05)


def test_the_heads_hook_failing_closes_the_link_and_stops_the_run() -> None:
    head = stopped_head(3, FakeRegroup({1}), lambda link: Opting(link, broken=True))  # type: ignore[arg-type]
    with pytest.raises(RunStopped, match=r"the head's ep_reformed failed: KeyError: 'a shard it cannot find'"):
        reform_link(head, no_slots(), timeout=5.0)
    assert head.ep_link.closed


@pytest.mark.parametrize(("timeout", "error"), [(0, ValueError), ("5", TypeError), (float("nan"), ValueError)])
def test_the_re_forms_bound_is_checked(timeout: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout must be a finite number of seconds > 0"):
        reform_link(stopped_head(3, FakeRegroup({1})), no_slots(), timeout=timeout)  # type: ignore[arg-type]


def test_only_the_head_re_forms() -> None:
    worker = Opting(EpLink(FakeTransport(1, 3), num_slots=2))
    with pytest.raises(EpRoleError, match=r"only the head \(rank 0\) re-forms the link; worker rank 1 rejoins it"):
        reform_link(worker, no_slots(), timeout=5.0)


def worker_of(regroup: FakeRegroup) -> Opting:
    worker = Opting(EpLink(FakeTransport(2, 4), num_slots=2))
    side_of(worker.ep_link).offer(regroup)
    return worker


def test_a_worker_rejoins_the_epoch_the_head_formed_at_its_place_among_the_members() -> None:
    worker = worker_of(FakeRegroup({1, 2}, joined=(1, [0, 2, 3])))
    reform = rejoin(worker.ep_link, 5.0)
    assert reform is not None and (reform.epoch, reform.rank, reform.world_size) == (1, 1, 3)
    assert reform.lost == (LostRank(1, ""),) and str(reform.lost[0]) == "worker rank 1 is gone"
    assert (worker.ep_link.epoch, worker.ep_link.rank) == (1, 1)


@pytest.mark.parametrize(
    ("joined", "said"),
    [
        ((1, []), "worker rank 2: the head ended the run: the link does not re-form"),
        ((1, [0, 1]), "worker rank 2: epoch 1 of the link formed without this rank (of ranks [0, 1])"),
        (TransportTimeout("no re-form of the link came"), "worker rank 2: the link does not re-form: TransportTimeout"),
    ],
)
def test_a_worker_that_no_epoch_takes_ends_as_it_would_have_saying_why(
    joined: object, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker = worker_of(FakeRegroup({1, 2}, joined=joined))  # type: ignore[arg-type]
    assert rejoin(worker.ep_link, 5.0) is None
    assert said in caplog.text
    assert worker.ep_link.closed  # its epoch's transport closed; its owner closes the rest


def test_a_worker_of_a_model_that_does_not_opt_in_does_not_wait_for_a_re_form() -> None:
    worker = NotOpting(EpLink(FakeTransport(1, 3), num_slots=2))
    regroup = FakeRegroup({1, 2})
    side_of(worker.ep_link).offer(regroup)
    assert rejoin(worker.ep_link, 5.0) is None and regroup.calls == []


def test_a_worker_that_refuses_a_command_says_it_leaves_and_ends() -> None:
    worker = worker_of(FakeRegroup({1, 2}))
    transport = worker.ep_link.transport
    assert isinstance(transport, FakeTransport)
    transport.incoming = [whole(7)]
    worker.ep_collective_commands = frozenset({7})  # type: ignore[misc]  # this instance's: its hook refuses cmd 7
    with pytest.raises(EpCommandRefused):
        run_worker(worker, no_slots(), logger=QUIET)
    regroup = side_of(worker.ep_link).regroup
    assert isinstance(regroup, FakeRegroup) and regroup.calls[-1].startswith("leave 2: EpCommandRefused: worker rank 2")


def test_collectives_over_a_group_of_their_own_refuse_to_follow_a_re_formed_link() -> None:
    pytest.importorskip("torch")
    from metrale_model_engine.torch import Collectives

    head = stopped_head(3, FakeRegroup({1}))
    collectives = Collectives(head.ep_link, cast(Any, object()))
    reform_link(head, no_slots(), timeout=5.0)
    with pytest.raises(
        ValueError, match=r"runs over a group of its own, which the link's re-form \(epoch 1\) does not"
    ):
        collectives.all_reduce(cast(Any, None))


# -- the ring's re-form line ---------------------------------------------------------------------


@pytest.fixture
def ring_line() -> Iterator[tuple[RingRegroup, RingRegroup]]:
    """A head's and a worker's re-form channel over one segment of 2 ranks (this process is both); its file removed
    at the end."""
    if not shm_supported():
        pytest.skip("the shared-memory transport needs Linux x86-64/arm64")
    segment = create_segment(Layout(2, 1 << 16, 1 << 12), os.getpid())

    def no_ring(*args: object) -> EpTransport:
        raise AssertionError("no ring is made here")

    head, worker = RingRegroup(segment, 0, no_ring, no_ring), RingRegroup(segment.share(), 1, no_ring, no_ring)
    try:
        yield head, worker
    finally:
        head.close()
        worker.close()
        os.unlink(segment.path)


def test_a_worker_of_an_older_epoch_is_told_the_heads_later_one_and_its_ring_is_refused_by_epoch(
    ring_line: tuple[RingRegroup, RingRegroup],
) -> None:
    head, worker = ring_line
    head.form(1, [0], time.monotonic() + 5.0)  # the head alone: no ring, the word still written
    assert worker.join(1, 1, dict, time.monotonic() + 5.0) == (1, [0])
    head.form(2, [0], time.monotonic() + 5.0)  # the head moved on before the worker attached to epoch 1
    assert worker.join(1, 1, dict, time.monotonic() + 5.0) == (2, [0])
    with pytest.raises(TransportClosed, match=r"^the head formed epoch 2 meanwhile, not 1$"):
        worker.attach(1, [0, 1], 1, time.monotonic() + 5.0)


def test_a_worker_waiting_on_the_ring_learns_that_no_epoch_comes_or_gives_up_at_its_bound(
    ring_line: tuple[RingRegroup, RingRegroup],
) -> None:
    head, worker = ring_line
    with pytest.raises(TransportTimeout, match=r"no re-form of the link came from the head by its bound \(epoch 1\)"):
        worker.join(1, 1, dict, time.monotonic() + 0.05)
    head.end()
    assert worker.join(1, 1, dict, time.monotonic() + 5.0) == (1, [])
