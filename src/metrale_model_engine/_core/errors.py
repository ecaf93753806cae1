"""The exceptions of the protocol, each classified where it is raised.

The classification is what keeps head and workers in step: a worker that sees
[`EpCommandFailed`][metrale_model_engine.EpCommandFailed] received the whole header and stays in its loop for the
next command (the head raises the same error for the same request); a worker that
sees an [`EpLinkError`][metrale_model_engine.EpLinkError] lost the link and must exit, since the next word it
would read is no longer known to be a header.

The tree (a second base in brackets)::

    EpError
    ├── EpCommandFailed ............. a worker's command failed; the worker stays up
    ├── EpWorkerFailed .............. the head: workers reported failed commands
    ├── EpLinkError [ConnectionError] the link failed; a worker that sees it exits
    │   ├── EpReceiveError .......... a worker's receive failed
    │   ├── EpSendError ............. the head's send failed
    │   └── RunStopped .............. the run is over on every rank
    │       └── EpCommandRefused .... a worker's collective command failed
    ├── EpSetupError [RuntimeError] . the ranks disagree at setup
    ├── EpRoleError [RuntimeError] .. a head's call on a worker, or the reverse
    ├── EpMismatchError [ValueError]  a follow-up other than the head sent
    └── EpDivergenceError [RuntimeError]  the ranks' streams or states differ
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .codec import Report

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
    "RunStopped",
    "WorkerFailure",
]


def describe_command(number: int, seq_id: int, cmd: int) -> str:
    """How messages name a command: ``"command 3 (seq_id=0, cmd=1)"``, ``number`` the head's count from 1.

    A command word from ``0x10000`` up is shown in hex (``cmd=0xfffffff0``), as such words are written.
    """
    return f"command {number} (seq_id={seq_id}, cmd={command_word(cmd)})"


def command_word(cmd: int) -> str:
    """How messages show a command word: in decimal below ``0x10000``, in hex from there (``0xfffffff0``)."""
    return str(cmd) if cmd < 0x10000 else hex(cmd)


def error_text(error: BaseException) -> str:
    """How the protocol shows an error: ``"Type: message"``, or the type alone.

    Total: an exception whose ``str()`` itself raises is shown as such, never raised
    again on the way to the head.
    """
    try:
        message = str(error)
    except Exception as failure:  # noqa: BLE001  (a user's __str__: whatever it raises, say so)
        message = f"<its str() raised {type(failure).__name__}>"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class EpError(Exception):
    """Base of every exception this library defines: ``except EpError`` catches them all.

    Each subclass keeps a standard base as well (``EpLinkError`` is a
    ``ConnectionError``, ``EpSetupError`` a ``RuntimeError``, and so on).
    """


class EpCommandFailed(EpError):
    """A command was received and then failed; the worker stays up.

    The underlying error is both ``cause`` and ``__cause__``; ``str()`` shows its
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
        return error_text(self.cause)

    def __reduce__(self) -> tuple[type[EpCommandFailed], tuple[BaseException]]:
        return (type(self), (self.cause,))


class EpLinkError(EpError, ConnectionError):
    """The link between head and workers failed: a worker receiving it must exit.

    Raised as such when the setup exchange itself fails (a rank died, a timeout);
    as [`EpSendError`][metrale_model_engine.EpSendError] or [`EpReceiveError`][metrale_model_engine.EpReceiveError] when
    a send or a receive does.  Never tagged as [`EpCommandFailed`][metrale_model_engine.EpCommandFailed].  The
    transport's own error, if any, is ``__cause__``: each failure is mapped once, where the link meets it.
    """


class EpReceiveError(EpLinkError):
    """A receive failed (peer gone, timeout, transport error); the worker exits."""


class EpSendError(EpLinkError):
    """A head-side broadcast failed (a worker gone, timeout, transport error)."""


class RunStopped(EpLinkError):
    """The run is over on every rank: a command that runs collectives failed somewhere, or a rank left during one.

    A model's forward makes collectives (all-reduces) that every rank must join, so
    a command that runs them cannot fail on one rank the way an ordinary command
    does: the other ranks would wait in the collective.  The library stops the run
    instead, on every rank, as Metrale's poisoned communicator does; the link then
    refuses every later send and step with this error.  Raised

    * on a worker whose collective command failed (as [`EpCommandRefused`][metrale_model_engine.EpCommandRefused]);
    * on the head and the other workers, when their collective fails or times out
      (``metrale_model_engine.torch.Collectives``), or when the head reads the
      failing worker's report (at its next command or sync point);
    * on the head whose own forward failed inside ``with link.collective():``.

    ``failures`` holds the workers' reports that reached this rank (the failing
    worker's error text, its command); ``ranks`` the ranks known to have stopped
    (reported or exited).  Either may be empty: a rank on another host that died
    sends no report.  The message says the rest.  It is an [`EpLinkError`][metrale_model_engine.EpLinkError]: a
    worker leaves its loop, and its process should exit (over gloo, a rank's exit is
    what ends its peers' collectives at once).
    """

    failures: tuple[WorkerFailure, ...]
    ranks: tuple[int, ...]

    def __init__(self, message: str, failures: Sequence[WorkerFailure] = (), ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)
        self.ranks = tuple(sorted(set(ranks) | {failure.rank for failure in self.failures}))

    def __reduce__(self) -> tuple[type[RunStopped], tuple[str, tuple[WorkerFailure, ...], tuple[int, ...]]]:
        return (type(self), (str(self), self.failures, self.ranks))


class EpCommandRefused(RunStopped):
    """This worker cannot run a command whose forward needs every rank: the run stops, here first.

    Raised by a worker's step when a command the model declared collective
    (``LinkedEp.ep_collective_commands``) fails before, inside or after its forward
    (a plain exception, a failed check, a follow-up read too few or too many), and
    by a model's hook that refuses a command itself (the cause is ``__cause__``).
    The link reports it to the head (a report that stops the run) before raising,
    then the worker leaves its loop and its process exits, which makes every other
    rank's collective fail at once; each raises [`RunStopped`][metrale_model_engine.RunStopped].
    """


class EpSetupError(EpError, RuntimeError):
    """The ranks disagree at setup (protocol, slot count, wire version, transport), or one cannot have what all asked.

    Raised on every rank, before any command is sent, so a mismatch is never a
    silent misread of a later word.
    """


def ring_setup_failed(reasons: dict[int, str]) -> EpSetupError:
    """The error every rank raises when the shared-memory ring could not be set up: ``reasons`` by failed rank.

    Built here, not by the backend, which raises only plain errors; the launchers
    (``shm.run_ring``, ``torch.open_transport``) gather each rank's reason and raise it.
    """
    why = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(reasons.items()))
    return EpSetupError(f"the shared-memory ring could not be set up ({why})")


class EpRoleError(EpError, RuntimeError):
    """A head-only call was made on a worker rank, or a worker-only call on the head."""


class EpMismatchError(EpError, ValueError):
    """A worker asked for a follow-up the head did not send (another kind or length).

    Raised by the worker's receive methods after the library has consumed the
    offending message (and any payload of it), so the worker stays in step: inside
    a command it becomes [`EpCommandFailed`][metrale_model_engine.EpCommandFailed].  The message names what was
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
    stopped: bool = False
    """Whether the failure stopped the run (a command that runs collectives): see ``RunStopped``."""
    witness: bool = False
    """Whether it was the worker's collective that failed: it may only have seen another rank's failure."""

    @classmethod
    def from_report(cls, rank: int, report: Report) -> WorkerFailure:
        """The failure that worker ``rank`` reported (a [`Report`][metrale_model_engine.wire.Report], decoded)."""
        return cls(rank, report.command, report.seq_id, report.cmd, report.error, report.stopped, report.witness)

    def __str__(self) -> str:
        return f"worker rank {self.rank} failed {describe_command(self.command, self.seq_id, self.cmd)}: {self.error}"


class EpWorkerFailed(EpError):
    """Commands the head sent failed on workers: each worker reported its failure to the head.

    Raised on the head at its next command once the reports have arrived (nothing of
    that command is sent), or at the latest at its next sync point.  Every report
    is raised once, oldest first per worker, in ``failures``: fail the requests
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

    ``ranks`` are the ranks that differ from the head (rank 0); the message says
    in what, and since when.
    """

    ranks: tuple[int, ...]

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type[EpDivergenceError], tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.ranks))
