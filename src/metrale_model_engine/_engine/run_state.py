"""``RunState``: whether the run goes on, and why it stopped (see ``RunStopped``)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .._core.errors import RunStopped, describe_command, error_text
from .stream import CommandStream


class RunState:
    """Why the run stopped, once it has; every part of a link asks it before it sends or steps.

    Args:
        who: how messages name this rank (``"head"``, ``"worker rank 2"``).
        on_stop: called once the run stopped (the link closes itself).
    """

    __slots__ = ("_on_stop", "_who", "stopped")

    def __init__(self, who: str, on_stop: Callable[[], None]) -> None:
        self._who = who
        self._on_stop = on_stop
        self.stopped: RunStopped | None = None
        """A copy of the first :class:`RunStopped` raised, kept bare (no traceback keeps the frames alive)."""

    def stop(self, stopped: RunStopped) -> RunStopped:
        """Record why the run stopped (the first reason stays), run ``on_stop``; return ``stopped`` to raise."""
        if self.stopped is None:
            kept = copy.copy(stopped)
            kept.__traceback__ = kept.__cause__ = kept.__context__ = None
            self.stopped = kept
        self._on_stop()
        return stopped

    def still_stopped(self) -> RunStopped:
        """The error a call raises once the run has stopped: it says why, and when."""
        stopped = self.stopped
        assert stopped is not None
        return RunStopped(
            f"{self._who}: the run stopped earlier ({stopped}); this link runs no more commands",
            stopped.failures,
            stopped.ranks,
        )

    def raise_if_stopped(self) -> None:
        """Raise :meth:`still_stopped`'s error if the run stopped."""
        if self.stopped is not None:
            raise self.still_stopped()


@contextmanager
def stop_on_error(
    run: RunState, who: str, stream: CommandStream, refuse: Callable[[BaseException], RunStopped] | None
) -> Iterator[None]:
    """``EpLink.collective``'s block: a failure inside it stops the run (``refuse``: a worker's refusal)."""
    try:
        yield
    except RunStopped:
        raise
    except Exception as error:
        if refuse is not None:
            raise refuse(error) from error
        where = describe_command(stream.commands, *stream.command)
        raise run.stop(
            RunStopped(f"{who}: the run stopped: its own forward of {where} failed: {error_text(error)}")
        ) from error
    except BaseException as interrupt:  # KeyboardInterrupt, SystemExit: they pass, the run is over
        where = describe_command(stream.commands, *stream.command)
        run.stop(RunStopped(f"{who}: the run stopped in {where}: {type(interrupt).__name__}"))
        raise
