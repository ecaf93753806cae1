"""The vocabulary of a re-form: a link that lost worker ranks forms again over the ranks left.

``LostRank`` (a rank gone, and how), ``Reform`` (what one re-form made of a rank's
link: its new place, the ranks lost, the reports, its times), ``Regroup`` (the
channel a transport leaves behind for its ranks to meet again and form the next
one: it outlives the transport it came from), and the default bound of a re-form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from .errors import WorkerFailure
from .transport import EpTransport

DEFAULT_REFORM_TIMEOUT: Final[float] = 30.0
"""Seconds a re-form may take on the head, and a worker waits for one, before the run stays stopped."""


@dataclass(frozen=True)
class LostRank:
    """A worker rank that the link lost, as the head knows it."""

    rank: int
    """Its rank in the epoch it was lost from."""
    how: str
    """How it was lost (``"was killed by SIGKILL"``, ``"exited with status 1"``, ``"fell silent: ..."``); empty
    where this rank cannot tell (a worker learns only who is gone)."""

    def __str__(self) -> str:
        return f"worker rank {self.rank} {self.how or 'is gone'}"


@dataclass(frozen=True)
class Reform:
    """What one re-form made of this rank's link: [`reform_link`][metrale_model_engine.reform.reform_link] returns it
    on the head, and every rank's [`ep_reformed`][metrale_model_engine.LinkedEp.ep_reformed] hook is handed it.

    Times are ``time.monotonic()`` seconds (one clock for every process of a host).
    """

    epoch: int
    """The link's new epoch (its count of re-forms; every rank agreed on it at setup)."""
    rank: int
    """This rank's rank in the new epoch: the ranks left keep their order, renumbered from 0 (the head stays 0)."""
    world_size: int
    """Ranks in the new epoch (1: the head alone, the single-GPU model)."""
    ranks: tuple[int, ...]
    """By new rank, each rank's rank in the epoch before (``ranks[rank]`` is this rank's)."""
    lost: tuple[LostRank, ...]
    """The ranks of the epoch before that are gone, by rank (how, on the head)."""
    failures: tuple[WorkerFailure, ...]
    """Head: the commands workers reported failing before the run stopped (first-hand: fail those requests)."""
    witnesses: tuple[WorkerFailure, ...]
    """Head: the reports of workers whose collective failed because another rank did (not a failure of theirs)."""
    stopped_at: float
    """When the epoch before stopped on this rank (its link recorded the stop, or its receive failed)."""
    began_at: float
    """When this rank began the re-form."""
    formed_at: float
    """When the new epoch's link passed its setup agreement on this rank."""
    attempts: int
    """Epochs tried (more than 1 when a rank was lost during the re-form: it began again without it)."""

    @property
    def reform_seconds(self) -> float:
        """Seconds the re-form took on this rank, from its beginning to the new link."""
        return self.formed_at - self.began_at

    def __str__(self) -> str:
        lost, before = "; ".join(map(str, self.lost)) or "none lost", len(self.ranks) + len(self.lost)
        return (
            f"the link re-formed at epoch {self.epoch}: {self.world_size} rank(s) of {before} "
            f"in {1000 * self.reform_seconds:.0f} ms ({lost})"
        )


@runtime_checkable
class Regroup(Protocol):
    """How the ranks of a transport meet again once some are lost, and form the next transport.

    A channel that outlives the transport it came from (a ring's segment, a group's
    store), got from a transport that offers it ([`Reformable`][metrale_model_engine.transport.Reformable]) or given
    by the launcher that chose the transport (``open_link``).  The link drives it: the
    head decides who forms the next epoch and forms it; each worker joins what the
    head formed.  ``deadline``s are ``time.monotonic()`` seconds.  Raises the plain
    errors of a transport (``PeerLost``, ``TransportTimeout``, ``TransportClosed``).
    """

    def wake(self) -> None:
        """End this process's waits on the group now (the old transport's, or that of an epoch that failed to form
        here), as a peer's death would, and so the waits of the ranks blocked on this one; idempotent.

        Nothing where closing the transport does it (a ring).
        """
        ...

    def survivors(
        self, epoch: int, candidates: Sequence[int], lost: dict[int, str], gone: Callable[[], Mapping[int, str]],
        deadline: float,
    ) -> list[int]:  # fmt: skip
        """Head: which of ``candidates`` (ranks of the old transport, the head first) form epoch ``epoch``.

        Those known to live, waiting until ``deadline`` at most for the ones it cannot
        tell yet.  Each rank found gone is added to ``lost`` with how; ``gone()`` is
        what the head's link knows now (its host's ranks that ended, ranks lost by
        their heartbeat).
        """
        ...

    def form(self, epoch: int, members: Sequence[int], deadline: float) -> EpTransport:
        """Head: tell every rank that ``members`` form epoch ``epoch``, and make the head's end of their transport.

        Collective with the members (``members == [0]``: the head alone, a
        ``SoloTransport``).  The link's setup agreement over it follows.
        """
        ...

    def abandon(self, transport: EpTransport) -> None:
        """Head: epoch's ``transport`` failed to form (a member was lost meanwhile): close it, noting who missed it."""
        ...

    def join(
        self, epoch: int, rank: int, gone: Callable[[], Mapping[int, str]], deadline: float
    ) -> tuple[int, list[int]]:
        """Worker ``rank`` (of the old transport): wait for the first epoch from ``epoch`` on that the head forms.

        ``gone()`` is what this worker knows of ranks gone (its host's ranks that
        ended), for a head that cannot see them.

        Returns:
            That epoch and its members (ranks of the old transport); no members when
            the head forms none (it ended the run).

        Raises:
            TransportTimeout: none came by ``deadline``.
            PeerLost: the head is gone.
        """
        ...

    def attach(self, epoch: int, members: Sequence[int], rank: int, deadline: float) -> EpTransport:
        """Worker ``rank``, one of ``members``: its end of epoch ``epoch``'s transport (collective with them)."""
        ...

    def leave(self, rank: int, why: str) -> None:
        """Worker ``rank`` leaves the run for ``why`` and joins no re-form: the head need not wait for it."""
        ...

    def end(self) -> None:
        """Head: no re-form comes; the workers that wait for one end at once."""
        ...

    def carried(self, transport: EpTransport) -> Regroup | None:
        """Once ``transport`` formed the new epoch: the channel for its next loss (this one is done with)."""
        ...

    def close(self) -> None:
        """Release what this channel holds.  Idempotent."""
        ...


@runtime_checkable
class Reformable(Protocol):
    """A transport that can leave a re-form channel behind (``ShmTransport``: its ring's segment)."""

    def regroup(self) -> Regroup | None:
        """The channel through which its ranks form the next transport once some are lost; ``None``: none."""
        ...
