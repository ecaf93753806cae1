"""A forward's collectives on a link: the part that checks, counts and stops on them (``Forward``), its
``collective()`` block (``CollectiveBlock``), and the link's public methods over it (``ForwardCollectives``, a
base of ``EpLink``: the block, the checks, the values every rank must agree on).  The scope they read is
``run_state.ForwardScope``; what differs by role, ``roles``."""

from __future__ import annotations

from collections.abc import Container, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType

from .._core.errors import RunStopped
from .roles import Role
from .run_state import LinkParts
from .sync import assert_ranks_agree, gather_u32
from .way_back.reports import EXIT_GRACE


class CollectiveBlock:
    """``EpLink.collective()``'s block: a failure inside it stops the run with what the rank's role makes of it.

    An ``Exception`` becomes the role's ``failed_inside`` (a worker's refusal of its
    command, the head's reading of its workers' reports); a ``RunStopped`` passes as
    it is; an interrupt (``KeyboardInterrupt``, ``SystemExit``) passes and the run is
    over.  The outermost block's end without an error is the end of the head's
    forward (``Role.forward_over``).  One object serves every block of a link: its
    state is the scope's.
    """

    __slots__ = ("_role", "_scope", "_state", "_stream")

    def __init__(self, parts: LinkParts, role: Role) -> None:
        _, _, self._stream, self._state, self._scope = parts
        self._role = role

    def __enter__(self) -> None:
        self._role.entered()
        self._scope.blocks += 1

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        scope = self._scope
        scope.blocks -= 1
        if error is None:
            if not scope.blocks:
                self._role.forward_over()
        elif isinstance(error, RunStopped):
            return
        elif isinstance(error, Exception):
            raise self._role.failed_inside(error) from error
        else:  # KeyboardInterrupt, SystemExit: they pass, the run is over
            state, where = self._state, self._stream.described()
            state.stop(RunStopped(f"{state.who}: the run stopped in {where}: {type(error).__name__}"))


class Forward:
    """The collectives of a forward on one link: its block, their check and count, their failure.

    ``ForwardCollectives`` (``EpLink``'s methods) states the contract.  While a replay
    runs (``testing.RecordingEp.replay``), the model's own link uses the replay's
    ``Forward``: the replay's link checks and counts its collectives.

    Args:
        parts: the link's parts.
        role: the rank's role, for what differs between the head and a worker.
    """

    __slots__ = ("_block", "_parts", "_role", "declared")

    def __init__(self, parts: LinkParts, role: Role) -> None:
        self._parts = parts
        self._role = role
        self._block = CollectiveBlock(parts, role)
        self.declared: Container[int] | None = None
        """The model's ``ep_collective_commands``, once handed over (``declare``)."""

    def block(self) -> CollectiveBlock:
        """``EpLink.collective``: the block, once the run is known not to have stopped."""
        self._parts.state.raise_if_stopped()
        return self._block

    def check(self, what: str) -> None:
        """``EpLink.check_collective``: count a collective where one is allowed, else refuse it."""
        self._parts.state.raise_if_stopped()
        scope = self._parts.scope
        if not scope.allows():
            raise self._role.refuse_undeclared(what)
        scope.ran += 1

    def empty(self) -> None:
        """``EpLink.empty_forward``: the forward in flight runs no collective, on every rank."""
        scope = self._parts.scope
        if not scope.open and scope.enforced:
            raise RuntimeError("empty_forward() speaks of the forward of a command in flight, and none is here")
        scope.empty = True
        scope.entered()

    def failed(self, error: BaseException, what: str, grace: object) -> RunStopped:
        """``EpLink.collective_failed``: stop the run (once); return what to raise."""
        state = self._parts.state
        if state.stopped is not None:
            return state.still_stopped()
        return self._role.collective_failed(error, what, grace)

    def gather(self, value: int) -> list[int]:
        """``EpLink.gather_u32``: a collective of the command in flight, if any (counted)."""
        transport, settings, _, _, scope = self._parts
        scope.ran += 1
        return gather_u32(transport, settings, value)

    def agree(self, values: dict[str, int]) -> None:
        """``EpLink.assert_ranks_agree``: a collective of the command in flight, if any (counted)."""
        transport, settings, _, _, scope = self._parts
        scope.ran += 1
        assert_ranks_agree(transport, settings, values)

    def declare(self, commands: Container[int]) -> None:
        """``declare_collective_commands``: the role's business (kept, for the link's next epoch)."""
        self.declared = commands
        self._role.declare(commands)


class ForwardCollectives:
    """``EpLink``'s methods for the collectives of a model's forward: its block, their checks, their failure.

    A base of [`EpLink`][metrale_model_engine.EpLink] alone, over the link's
    ``Forward`` (which the link builds, with its role); see it for the link itself.
    """

    __slots__ = ("_forward",)
    _forward: Forward

    def collective(self) -> AbstractContextManager[None]:
        """Run a block that makes collectives with the other ranks: if it raises, the run stops on every rank.

        For the head's forward of a command it sent (and a worker's hook, around the
        part that runs collectives, when its command word is not one of
        ``LinkedEp.ep_collective_commands``, whose whole step is covered already): the
        other ranks are in, or on their way to, its collectives.  On the head a
        failure raises [`RunStopped`][metrale_model_engine.RunStopped] naming the worker that reported a failure
        or exited, if one did (its leaving may be what failed the head's collective),
        else the command and the head's own error, and closes the link; on a worker
        it refuses the command ([`EpCommandRefused`][metrale_model_engine.EpCommandRefused], reported to the head).  A
        [`RunStopped`][metrale_model_engine.RunStopped] raised inside passes as it is.

        On the head the block's end is the end of the command's forward, which must
        have run a collective ([`check_collective`][metrale_model_engine.EpLink.check_collective]) or said it has none
        ([`empty_forward`][metrale_model_engine.EpLink.empty_forward]): else the run stops, "it ran no collective".
        And the head must enter it: a command whose word runs collectives (its model's
        ``ep_collective_commands``, handed to the link as a ``LinkedEp`` model takes
        it; for a link no such model holds, the words of its earlier ``collective()``
        blocks) whose forward the head skipped (an early return, a cache hit) is
        refused at the head's next send or sync point, naming the command: the run
        stops there, before a later forward could meet the workers' collectives off by
        one.  A word the head has not learned yet (no model declared it, and none of
        its forwards ran here) is not checked.

        Raises:
            RunStopped: the block raised, its forward ran no collective, or the run stopped earlier.
        """
        return self._forward.block()

    def check_collective(self, what: str = "a collective") -> None:
        """Before each collective of a forward: refuse it where nothing declared it, else count it.

        Whatever runs a model's collectives calls it first (``Collectives`` does, for
        each all-reduce).  Counted, not sent: it adds no message and no collective.
        Allowed outside any command (setup), in a worker's command of
        ``LinkedEp.ep_collective_commands`` and inside ``with link.collective():``;
        refused, the first time, with one line that names the command word and what
        to declare, on a worker in a command not declared, and on the head between
        sending a command and the end of its forward outside ``collective()``.  The
        count: a declared command whose hook returns without one, and a head's
        ``collective()`` block without one, are refused too (see
        [`empty_forward`][metrale_model_engine.EpLink.empty_forward]).  A no-op on one rank.

        Args:
            what: how messages name the collective (``"an all-reduce"``).

        Raises:
            EpCommandRefused: on a worker (reported to the head; the run stops).
            RunStopped: on the head (the link is closed), or the run stopped earlier.
        """
        self._forward.check(what)

    def empty_forward(self) -> None:
        """Say that the forward of the command in flight runs no collective, on this rank and every other.

        For a forward of a command of ``ep_collective_commands`` (or a head's
        ``collective()`` block) that is legitimately empty (a batch of nothing, say):
        without it, such a forward is refused as one that ran no collective.  On the
        head it also counts as entering the forward.  A no-op on one rank.

        Raises:
            RuntimeError: no command's forward is in flight here.
        """
        self._forward.empty()

    def collective_failed(
        self, error: BaseException, *, what: str = "a collective", grace: float = EXIT_GRACE
    ) -> RunStopped:
        """A collective of the command in flight failed on this rank (``error``): stop the run; return what to raise.

        For the code that runs a model's collectives (``metrale_model_engine.torch.Collectives``
        does it for its all-reduces), whose backend says only that some peer is gone
        or late.  The head looks, up to ``grace`` seconds, for the workers that
        reported a failure, exited or are stopped (a signal, a debugger): the error
        names them (``RunStopped.failures``, ``RunStopped.ranks``).  A worker
        names the command, and reports its failure to the head as a witness (it may
        only have seen another rank's).  The link is closed.

        Args:
            error: the backend's error.
            what: how messages name the collective (``"an all-reduce"``).
            grace: seconds the head looks for the rank behind the failure.
        """
        return self._forward.failed(error, what, grace)

    def gather_u32(self, value: int) -> list[int]:
        """Every rank's ``value`` (a u32), by rank, on every rank.  Collective: at the same point on every rank.

        Usable inside a command (the head after sending it, each worker in its hook);
        bounded by ``command_timeout``.  ``TypeError``/``ValueError`` for a value that
        is not a u32; ``EpLinkError`` when a rank did not take part in time, or died.
        """
        return self._forward.gather(value)

    def min_u32(self, value: int) -> int:
        """The smallest ``value`` (a u32) of every rank, on every rank (a ``gather_u32``)."""
        return min(self._forward.gather(value))

    def assert_ranks_agree(self, **values: int) -> None:
        """Raise ``EpDivergenceError`` on every rank unless every rank passed the same named u32 values.

        Collective, like [`gather_u32`][metrale_model_engine.EpLink.gather_u32]; at most ``AGREED_VALUES`` values,
        a gather's words less one (``ValueError`` past that, naming the limit).  The message lists every value that
        differs (the names too count), with each rank's.  Raises as
        [`gather_u32`][metrale_model_engine.EpLink.gather_u32] otherwise.
        """
        self._forward.agree(values)


def declare_collective_commands(link: ForwardCollectives, commands: Container[int]) -> None:
    """Hand ``link`` its model's ``ep_collective_commands`` (``LinkedEp`` does, as the model takes the link).

    The head then owes the forward of each such command (see ``EpLink.collective``);
    a worker is given them at each step instead, and ignores this.
    """
    link._forward.declare(commands)


@contextmanager
def collectives_counted_by(link: ForwardCollectives, replay: ForwardCollectives) -> Iterator[None]:
    """While the block runs, ``replay`` checks and counts ``link``'s forward collectives (and stops on them).

    What a replay does (``testing.RecordingEp.replay``): the model keeps its own link
    where its collectives hold it (a ``Collectives``), and the link that replays runs
    its forward.
    """
    own = link._forward
    link._forward = replay._forward
    try:
        yield
    finally:
        link._forward = own
