"""The role a rank plays, chosen once as its link is built (``role_for``): ``HeadRole`` or ``WorkerRole``.

A role holds the parts of its side (the head's sender, its view of the workers'
reports and its sync points; a worker's reader and way back), with stand-ins for
the other side's parts that raise ``EpRoleError`` (``HeadOnly``, ``WorkerOnly``),
and does what differs between the sides: how a collective that nothing declared is
refused, what a failure inside ``collective()`` or of a collective makes of the run,
what the end of the head's forward checks, what the link's close tells the others,
where the state digest goes, and whether the model's ``ep_collective_commands``
matter.  A role is built from ``LinkParts`` alone (and, for the head, the pids of its
workers): a link can build one again over new parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Mapping
from typing import Final, NoReturn, cast

from .._core.errors import EpRoleError, RunStopped, command_word
from .reader import CommandReader
from .run_state import LinkParts
from .sender import HeadSender
from .sync import SyncPoints
from .way_back.reports import WorkerReports
from .way_back.worker import StateDigest, WorkerWayBack


class Role(ABC):
    """What one rank's link does where the head and a worker differ, and the parts of its side.

    ``sender``, ``reports`` and ``sync_points`` are the head's parts, ``reader`` the
    worker's; on the other side each is a stand-in whose every use raises
    ``EpRoleError``, so that a call of the other role's is refused before anything
    else.
    """

    __slots__ = ("_parts", "reader", "reports", "sender", "sync_points")

    def __init__(
        self,
        parts: LinkParts,
        sender: HeadSender,
        reports: WorkerReports,
        sync_points: SyncPoints,
        reader: CommandReader,
    ) -> None:
        self._parts = parts
        self.sender = sender
        self.reports = reports
        self.sync_points = sync_points
        self.reader = reader

    @property
    @abstractmethod
    def state_digest(self) -> StateDigest | None:
        """The digest of this rank's slots that sync points compare (``EpLink.state_digest``)."""

    @state_digest.setter
    @abstractmethod
    def state_digest(self, digest: StateDigest | None) -> None: ...

    @abstractmethod
    def refuse_undeclared(self, what: str) -> RunStopped:
        """Refuse a collective (``what``) that nothing declared, in the command in flight: stop; return the error."""

    @abstractmethod
    def failed_inside(self, error: BaseException) -> RunStopped:
        """A ``collective()`` block raised ``error``: stop the run; return the error to raise."""

    @abstractmethod
    def collective_failed(self, error: BaseException, what: str, grace: object) -> RunStopped:
        """A collective (``what``) of the command in flight failed here: stop the run; return the error to raise."""

    @abstractmethod
    def entered(self) -> None:
        """A ``collective()`` block begins (the outermost one, of the command in flight)."""

    @abstractmethod
    def forward_over(self) -> None:
        """The outermost ``collective()`` block ended without an error."""

    @abstractmethod
    def declare(self, commands: Container[int]) -> None:
        """The model's ``ep_collective_commands``, handed over as it takes this link."""

    @abstractmethod
    def close(self) -> None:
        """What the link's close does before it closes the transport."""

    @abstractmethod
    def stop_on_loss(self) -> None:
        """The model re-forms its link: a worker lost wherever the head finds it stops the run (a send included)."""


class HeadRole(Role):
    """Rank 0: it sends, runs sync points and reads the workers' reports, and its forward runs in ``collective()``.

    The head owes the forward of every command whose word runs collectives: the
    workers wait in them.  It knows those words from its model's
    ``ep_collective_commands`` (handed over as a ``LinkedEp`` model takes the link),
    else it learns each word from its first ``collective()`` block; a command of one
    whose forward it never entered is refused at its next send or sync point
    (``HeadSender.forward_skipped``).

    Args:
        parts: the link's parts.
        pids: the pid of every worker on the head's host, by rank.
    """

    __slots__ = ("_digest", "_learned")

    def __init__(self, parts: LinkParts, pids: Mapping[int, int]) -> None:
        reports = WorkerReports(parts, pids)
        sender = HeadSender(parts, reports)
        super().__init__(parts, sender, reports, SyncPoints(parts, sender, reports), cast(CommandReader, WORKER_ONLY))
        self._digest: StateDigest | None = None
        self._learned: set[int] | None = set()  # the words learned from collective() blocks; None once declared
        sender.owed_words(self._learned, declared=False)

    @property
    def state_digest(self) -> StateDigest | None:
        return self._digest

    @state_digest.setter
    def state_digest(self, digest: StateDigest | None) -> None:
        self._digest = digest

    def refuse_undeclared(self, what: str) -> RunStopped:
        _, _, stream, state, _ = self._parts
        word = command_word(stream.command[1])
        return state.stop(
            RunStopped(
                f"head: the run stopped in {stream.described()}: {what} ran after the head sent cmd {word}, outside "
                f"`with link.collective():`: run the head's forward of cmd {word} inside that block (and declare "
                f"{word} in ep_collective_commands), so that a failure of it stops every rank"
            )
        )

    def failed_inside(self, error: BaseException) -> RunStopped:
        return self.reports.forward_failed(error)

    def collective_failed(self, error: BaseException, what: str, grace: object) -> RunStopped:
        return self.reports.collective_failed(error, what, grace)

    def entered(self) -> None:
        _, _, stream, _, scope = self._parts
        if scope.open and not scope.blocks:  # the forward of the command in flight begins
            scope.entered()
            if self._learned is not None:
                self._learned.add(stream.command[1])

    def forward_over(self) -> None:
        _, _, stream, state, scope = self._parts
        if not scope.open or scope.blocks:
            return
        scope.open = False
        if scope.ran_none():
            raise state.stop(
                RunStopped(
                    f"head: the run stopped in {stream.described()}: it ran no collective: its forward inside "
                    "`with link.collective():` made no all-reduce through Collectives (it was skipped, or called "
                    "torch.distributed directly), so it cannot have met the workers'; a forward that is empty on "
                    "every rank says so with link.empty_forward()"
                )
            )

    def declare(self, commands: Container[int]) -> None:
        self._learned = None
        self.sender.owed_words(commands, declared=True)

    def close(self) -> None:
        try:
            self.sender.tell_closed()
        finally:
            self.reports.close()

    def stop_on_loss(self) -> None:
        self.sender.stops_on_loss = True


class WorkerRole(Role):
    """A worker rank: it steps through the commands and answers; a failure of a collective command refuses it.

    Args:
        parts: the link's parts.
    """

    __slots__ = ("_way_back",)

    def __init__(self, parts: LinkParts) -> None:
        way_back = self._way_back = WorkerWayBack(parts)
        head_only = HeadOnly(parts.settings.rank)
        reader = CommandReader(parts, way_back)
        super().__init__(
            parts, cast(HeadSender, head_only), cast(WorkerReports, head_only), cast(SyncPoints, head_only), reader
        )

    @property
    def state_digest(self) -> StateDigest | None:
        return self._way_back.state_digest

    @state_digest.setter
    def state_digest(self, digest: StateDigest | None) -> None:
        self._way_back.state_digest = digest

    def refuse_undeclared(self, what: str) -> RunStopped:
        word = command_word(self._parts.stream.command[1])
        return self._way_back.refused(
            f"{what} ran in cmd {word}, which ep_collective_commands does not declare: add {word} to the model's "
            "ep_collective_commands (a failure there must stop every rank, not leave them in the collective)"
        )

    def failed_inside(self, error: BaseException) -> RunStopped:
        return self._way_back.refuse(error)

    def collective_failed(self, error: BaseException, what: str, grace: object) -> RunStopped:
        return self._way_back.witness(error, what)

    def entered(self) -> None:
        """Nothing: a worker's forward is its step, which it cannot skip."""

    def forward_over(self) -> None:
        """Nothing: a worker's step counts its forward's collectives (``ran_no_collective``)."""

    def declare(self, commands: Container[int]) -> None:
        """Nothing: a worker is given its collective commands at each step."""

    def close(self) -> None:
        """Nothing: the transport's close tells the head, as the worker's leaving does."""

    def stop_on_loss(self) -> None:
        """Nothing: a worker sends nothing."""


def role_for(parts: LinkParts, pids: Mapping[int, int]) -> Role:
    """The role of rank ``parts.settings.rank``: the head (rank 0) or a worker.

    Args:
        parts: the link's parts.
        pids: what the setup exchange found: the pid of every worker on this host, by rank (the head watches them).
    """
    return HeadRole(parts, pids) if parts.settings.rank == 0 else WorkerRole(parts)


class HeadOnly:
    """Stands in, on a worker, for the head's parts: whatever is asked of them raises ``EpRoleError``.

    Python's own probes (``__deepcopy__``, ``hasattr`` of a dunder) get ``AttributeError``, as from any object.
    """

    __slots__ = ("_rank",)

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        what = "sends" if name.startswith("send") else "runs sync points and reads the workers' reports"
        raise EpRoleError(f"only the head (rank 0) {what}; this is worker rank {self._rank}")


class WorkerOnly:
    """Stands in, on the head, for a worker's parts: whatever is asked of them raises ``EpRoleError``.

    Python's own probes get ``AttributeError``, as from any object.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "step":
            raise EpRoleError("the step of a command (ep_worker_step) runs on worker ranks; this is the head (rank 0)")
        raise EpRoleError("follow-ups are received on worker ranks; this is the head (rank 0)")


WORKER_ONLY: Final = WorkerOnly()
"""The stand-in for a worker's parts on the head."""
