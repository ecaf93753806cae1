"""A forward's collectives on a link: the ``collective()`` block, and the link's methods that check, count and
stop on them (``ForwardCollectives``, a base of ``EpLink``; the scope they read is ``run_state.ForwardScope``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from .._core.errors import RunStopped, describe_command
from .reports import EXIT_GRACE, WorkerReports
from .run_state import CommandStream, ForwardScope, LinkState, undeclared
from .settings import LinkSettings
from .way_back import WorkerWayBack


@contextmanager
def stop_on_error(
    state: LinkState, stream: CommandStream, scope: ForwardScope, failed: Callable[[BaseException], RunStopped]
) -> Iterator[None]:
    """``EpLink.collective``'s block: a failure inside it stops the run with what ``failed`` makes of it.

    ``failed`` is a worker's refusal of its command, or the head's reading of its
    workers' reports.  On the head, the block's end is its forward's
    end; a forward that ran no collective there is refused: it cannot have met
    the workers' collectives.
    """
    scope.blocks += 1
    try:
        yield
    except RunStopped:
        raise
    except Exception as error:
        raise failed(error) from error
    except BaseException as interrupt:  # KeyboardInterrupt, SystemExit: they pass, the run is over
        where = describe_command(stream.commands, *stream.command)
        state.stop(RunStopped(f"{state.who}: the run stopped in {where}: {type(interrupt).__name__}"))
        raise
    finally:
        scope.blocks -= 1
    if state.who == "head" and scope.open and not scope.blocks:
        scope.open = False
        if scope.ran_none():
            where = describe_command(stream.commands, *stream.command)
            raise state.stop(
                RunStopped(
                    f"head: the run stopped in {where}: it ran no collective: its forward inside "
                    "`with link.collective():` made no all-reduce through Collectives (it was skipped, or called "
                    "torch.distributed directly), so it cannot have met the workers'; a forward that is empty on "
                    "every rank says so with link.empty_forward()"
                )
            )


class ForwardCollectives:
    """``EpLink``'s methods for the collectives of a model's forward: its block, their checks, their failure.

    A base of [`EpLink`][metrale_model_engine.EpLink] alone, which holds the parts
    named below; see it for the link itself.
    """

    __slots__ = ()
    _state: LinkState
    _scope: ForwardScope
    _reports: WorkerReports
    _way_back: WorkerWayBack
    _settings: LinkSettings
    _stream: CommandStream
    _stand_in: ForwardCollectives | None
    """The link that counts this one's collectives while a replay runs (``testing.RecordingEp.replay``)."""

    @abstractmethod
    def close(self) -> None:
        """Close the link (``EpLink.close``)."""

    def _close_stopped(self) -> None:
        """Once a part recorded that the run stopped, the link closes itself (once: ``close`` is idempotent)."""
        if self._state.stopped is not None:
            self.close()

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

        Raises:
            RunStopped: the block raised, its forward ran no collective, or the run stopped earlier.
        """
        self.raise_if_stopped()
        return self._block(self._way_back.refuse if self._settings.rank else self._reports.forward_failed)

    @contextmanager
    def _block(self, failed: Callable[[BaseException], RunStopped]) -> Iterator[None]:
        try:
            with stop_on_error(self._state, self._stream, self._scope, failed):
                yield
        finally:
            self._close_stopped()

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
        if self._stand_in is not None:
            self._stand_in.check_collective(what)
            return
        self.raise_if_stopped()
        scope = self._scope
        if scope.allows():
            scope.ran += 1
            return
        text = undeclared(self._settings.who, what, self._stream.command[1])
        if self._settings.rank:
            refused: RunStopped = self._way_back.refused(text)
        else:
            where = describe_command(self._stream.commands, *self._stream.command)
            refused = self._state.stop(RunStopped(f"head: the run stopped in {where}: {text}"))
        self._close_stopped()
        raise refused

    def empty_forward(self) -> None:
        """Say that the forward of the command in flight runs no collective, on this rank and every other.

        For a forward of a command of ``ep_collective_commands`` (or a head's
        ``collective()`` block) that is legitimately empty (a batch of nothing, say):
        without it, such a forward is refused as one that ran no collective.  A no-op
        on one rank.

        Raises:
            RuntimeError: no command's forward is in flight here.
        """
        if self._stand_in is not None:
            self._stand_in.empty_forward()
            return
        if not self._scope.open and self._scope.enforced:
            raise RuntimeError("empty_forward() speaks of the forward of a command in flight, and none is here")
        self._scope.empty = True

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
        if self._stand_in is not None:
            return self._stand_in.collective_failed(error, what=what, grace=grace)
        state = self._state
        if state.stopped is not None:
            self.close()
            return state.still_stopped()
        if self._settings.rank:
            stopped = self._way_back.witness(error, what)
        else:
            stopped = self._reports.collective_failed(error, what, grace)
        self._close_stopped()
        return stopped

    def raise_if_stopped(self) -> None:
        """Raise ``RunStopped`` if the run stopped; for a model's head methods, first thing.

        Sends and steps check it themselves; a head method calls it before its own checks.
        """
        if self._state.stopped is not None:
            self.close()
            raise self._state.still_stopped()


def command_in_flight(link: ForwardCollectives) -> tuple[int, int]:
    """The ``(seq_id, cmd)`` of the command ``link`` began last: what a message about it names."""
    return link._stream.command
