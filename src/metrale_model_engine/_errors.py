"""The exceptions of the protocol, each classified where it is raised.

The classification is what keeps head and workers in step: a worker that sees
:class:`EpCommandFailed` received the whole header and stays in its loop for the
next command (the head raises the same error for the same request); a worker that
sees an :class:`EpLinkError` lost the link and must exit, since the next word it
would read is no longer known to be a header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EpCommandFailed",
    "EpCommandRefused",
    "EpDivergenceError",
    "EpError",
    "EpLinkError",
    "EpMismatchError",
    "EpReceiveError",
    "EpRoleError",
    "EpSendError",
    "EpSetupError",
    "EpWorkerFailed",
    "WorkerFailure",
]


class EpError(Exception):
    """Base of every exception this library defines: ``except EpError`` catches them all.

    Each subclass keeps a standard base as well (``EpLinkError`` is a
    ``ConnectionError``, ``EpSetupError`` a ``RuntimeError``, and so on).
    """


class EpCommandFailed(EpError):
    """A command was received and then failed; the worker stays up.

    The underlying error is both :attr:`cause` and ``__cause__``; ``str()`` shows its
    type and message.  Instances pickle with their cause, so they cross process
    boundaries.  Only this class (and subclasses) carries the tag: no other
    exception is ever treated as "received and failed".
    """

    cause: BaseException
    __cause__: BaseException  # always set, never None

    def __init__(self, cause: BaseException) -> None:
        if not isinstance(cause, BaseException):
            raise TypeError(f"EpCommandFailed(cause) needs an exception, got {type(cause).__name__} {cause!r}")
        super().__init__(cause)
        self.cause = cause
        self.__cause__ = cause

    def __str__(self) -> str:
        message = str(self.cause)
        name = type(self.cause).__name__
        return f"{name}: {message}" if message else name

    def __reduce__(self) -> tuple[type[EpCommandFailed], tuple[BaseException]]:
        return (type(self), (self.cause,))


class EpLinkError(EpError, ConnectionError):
    """The link between head and workers failed: a worker receiving it must exit.

    Raised as such when the setup exchange itself fails (a rank died, a timeout);
    as :class:`EpSendError` or :class:`EpReceiveError` when a send or a receive
    does.  Never tagged as :class:`EpCommandFailed`.  The transport's own error, if
    any, is ``__cause__``: each failure is mapped once, where the link meets it.
    """


class EpCommandRefused(EpLinkError):
    """A worker refuses a command whose forward needs every rank: the run stops, on every rank.

    For models whose commands run collectives (all-reduces) on every rank: a worker
    that finds a command it cannot run (a slot it does not hold, a chunk out of
    order) must not run half a forward, and cannot skip its collectives either, or
    the other ranks would wait in them.  It raises this (the cause is ``__cause__``)
    before any collective: the link reports the refusal to the head, then the worker
    leaves its loop (it is an :class:`EpLinkError`) and its process exits (or
    destroys its process group), and every other rank's collective fails at once.
    As under Metrale's poisoned communicator, the run ends with an error on every
    rank; it never goes on with ranks out of step.
    """


class EpReceiveError(EpLinkError):
    """A receive failed (peer gone, timeout, transport error); the worker exits."""


class EpSendError(EpLinkError):
    """A head-side broadcast failed (a worker gone, timeout, transport error)."""


class EpSetupError(EpError, RuntimeError):
    """The ranks disagree at setup (protocol, slot count, wire version, transport), or one cannot have what all asked.

    Raised on every rank, before any command is sent, so a mismatch is never a
    silent misread of a later word.
    """


class EpRoleError(EpError, RuntimeError):
    """A head-only call was made on a worker rank, or a worker-only call on the head."""


class EpMismatchError(EpError, ValueError):
    """A worker asked for a follow-up the head did not send (another kind or length).

    Raised by the worker's receive methods after the library has consumed the
    offending message (and any payload of it), so the worker stays in step: inside
    a command it becomes :class:`EpCommandFailed`.  The message names what was
    expected and what arrived, lengths included.
    """


@dataclass(frozen=True)
class WorkerFailure:
    """One command that failed on one worker, as that worker reported it to the head."""

    rank: int
    """The worker's rank."""
    command: int
    """Which command: the head's count of the commands it sent, from 1."""
    seq_id: int
    cmd: int
    error: str
    """The worker's error, ``"Type: message"`` (cut to fit one answer)."""

    def __str__(self) -> str:
        where = f"command {self.command} (seq_id={self.seq_id}, cmd={self.cmd})"
        return f"worker rank {self.rank} failed {where}: {self.error}"


class EpWorkerFailed(EpError):
    """Commands the head sent failed on workers: each worker reported its failure to the head.

    Raised on the head at its next command once the reports have arrived (nothing of
    that command is sent), or at the latest at its next sync point.  Every report
    is raised once, oldest first per worker, in :attr:`failures`: fail the requests
    of those slots and reset them.
    """

    failures: tuple[WorkerFailure, ...]

    def __init__(self, failures: Sequence[WorkerFailure], note: str = "") -> None:
        self.failures = tuple(failures)
        self.note = note
        shown = "; ".join(str(failure) for failure in self.failures[:3])
        more = f"; and {len(self.failures) - 3} more" if len(self.failures) > 3 else ""
        super().__init__(f"{shown}{more}{note}")

    def __reduce__(self) -> tuple[type[EpWorkerFailed], tuple[tuple[WorkerFailure, ...], str]]:
        return (type(self), (self.failures, self.note))


class EpDivergenceError(EpError, RuntimeError):
    """The ranks differ where they must agree: their command streams or states at a sync point, or named values.

    :attr:`ranks` are the ranks that differ from the head (rank 0); the message says
    in what, and since when.
    """

    ranks: tuple[int, ...]

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type[EpDivergenceError], tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.ranks))
