"""The run as every part of a link sees it: the command stream (``CommandStream``), the link's one state
(``LinkState``: open, shut down, stopped, closed; the one place a stop is recorded, which closes the link),
whether the forward of the command in flight may run collectives here, and ran one (``ForwardScope``); and the
bundle of them every part is built from (``LinkParts``)."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

from typing_extensions import Buffer

from .._core.digest import fold_message
from .._core.errors import RunStopped, command_word, describe_command
from .._core.transport import EpTransport
from .settings import LinkSettings


class CommandStream:
    """The commands counted so far, the one in flight, and a digest of every message.

    The head counts what it sent, a worker what it received; sync points compare
    the two (``EpDivergenceError`` when they differ).  The shutdown header is not
    counted.  Plain attributes: the send and receive paths update them directly.
    """

    __slots__ = ("command", "commands", "crc")

    def __init__(self) -> None:
        self.commands = 0
        """Commands sent (head) or received (worker); a report names one by this count, from 1."""
        self.command = (0, 0)
        """``(seq_id, cmd)`` of the command in flight, for messages."""
        self.crc = 0
        """The stream digest: a CRC-32 of every message, in order, as ``fold_message`` folds one."""

    def begin(self, seq_id: int, cmd: int) -> None:
        """A command starts: count it and remember it."""
        self.commands += 1
        self.command = (seq_id, cmd)

    def add(self, parts: Sequence[Buffer]) -> None:
        """Fold one message, the concatenation of ``parts``, into the digest (``fold_message``)."""
        self.crc = fold_message(self.crc, parts)

    def described(self) -> str:
        """How messages name the command in flight: ``"command 3 (seq_id=0, cmd=7)"``."""
        return describe_command(self.commands, *self.command)


class Phase(enum.Enum):
    """Where the run stands, as one rank's link sees it."""

    OPEN = "open"
    """Commands go on."""
    SHUT_DOWN = "shut down"
    """The head sent the shutdown header (after a sync point that failed too: ``LinkState.stopped`` says if
    that stopped the run)."""
    STOPPED = "stopped"
    """The run stopped (``RunStopped``): no rank runs another command."""


class LinkState:
    """The one state of a link that every part reads: the run's phase, why it stopped, whether the link closed.

    The one rule of a stopped run lives here: every part records a stop with
    ``stop``, which closes the link (``close``, once) and returns the error for the
    part to raise or return; nothing else closes a link on a stop.  ``closed`` is
    apart from the phase: a link is closed by its owner in any phase, and by itself
    once the run stopped.

    Args:
        who: how messages name this rank (``"head"``, ``"worker rank 2"``).
        close: what closes the link (``EpLink.close``, idempotent); default nothing.
    """

    __slots__ = ("_close", "closed", "phase", "stopped", "who")

    def __init__(self, who: str, close: Callable[[], None] = lambda: None) -> None:
        self.who = who
        self._close = close
        self.phase = Phase.OPEN
        self.stopped: RunStopped | None = None
        """A copy of the first ``RunStopped`` raised, kept bare (no traceback keeps the frames alive)."""
        self.closed = False
        """Whether the link's transport was closed (by its owner, or once the run stopped)."""

    def stop(self, stopped: RunStopped) -> RunStopped:
        """Record why the run stopped (the first reason stays) and close the link; return ``stopped`` to raise.

        Whatever the part that stops the run still has to say (a worker's last report)
        it says before calling this: the link's transport is closed when it returns.
        """
        if self.stopped is None:
            kept = copy.copy(stopped)
            kept.__traceback__ = kept.__cause__ = kept.__context__ = None
            self.stopped = kept
            if self.phase is Phase.OPEN:  # a shut-down link stays so: its workers were told to leave
                self.phase = Phase.STOPPED
            self._close()
        return stopped

    def still_stopped(self) -> RunStopped:
        """The error a call raises once the run has stopped: it says why, and when."""
        stopped = self.stopped
        assert stopped is not None
        return RunStopped(
            f"{self.who}: the run stopped earlier ({stopped}); this link runs no more commands",
            stopped.failures,
            stopped.ranks,
        )

    def raise_if_stopped(self) -> None:
        """Raise ``still_stopped``'s error if the run stopped."""
        if self.stopped is not None:
            raise self.still_stopped()


class ForwardScope:
    """Where this rank stands in the forward of the command in flight, for ``EpLink.check_collective``.

    A forward's collectives must be declared, or a failure of the command leaves the
    other ranks waiting in them: on a worker by ``ep_collective_commands`` (or a
    ``collective()`` block in its hook), on the head by running its forward inside
    ``collective()``.  Outside any command (setup, and a worker between steps) a
    collective is the program's own business.  Counted per command, so that a
    declared forward that ran none (skipped, or ``torch.distributed`` called
    directly) is refused too.  Plain attributes, set by the link's parts.

    Args:
        enforced: whether to keep it at all (not with one rank: nothing is sent,
            no collective runs).
    """

    __slots__ = ("blocks", "declared", "due", "empty", "enforced", "open", "ran")

    def __init__(self, enforced: bool) -> None:
        self.enforced = enforced
        self.open = False
        """A command is in flight whose forward runs here: a worker's hook, or the head from its send to the
        end of its forward (its ``collective()`` block, or the next command)."""
        self.declared = False
        """The command is one of the worker's ``ep_collective_commands``: any part of its hook may run collectives."""
        self.due = False
        """This rank owes the command's forward: the other ranks wait in its collectives, so it must enter it (a
        ``collective()`` block, or ``EpLink.empty_forward``) before its next command or sync point."""
        self.blocks = 0
        """``collective()`` blocks entered and not left."""
        self.ran = 0
        """Collectives counted since the command began."""
        self.empty = False
        """Its forward was declared empty on every rank (``EpLink.empty_forward``)."""

    def begin(self, declared: bool, due: bool) -> None:
        """A command starts: its forward may run collectives anywhere if ``declared``, is owed if ``due``, ran none."""
        self.open = self.enforced
        self.declared = declared
        self.due = due and self.enforced
        self.ran = 0
        self.empty = False

    def entered(self) -> None:
        """The forward of the command in flight runs now (a ``collective()`` block, or it is said to be empty)."""
        self.due = False

    def allows(self) -> bool:
        """Whether a collective may run now: outside any command, or inside a declared one or a block."""
        return not self.open or self.declared or self.blocks > 0

    def ran_none(self) -> bool:
        """Whether the command's forward ran no collective and was not declared empty."""
        return self.ran == 0 and not self.empty


class LinkParts(NamedTuple):
    """What every part of one link shares; the link builds it once, each part keeps what it reads."""

    transport: EpTransport
    settings: LinkSettings
    stream: CommandStream
    state: LinkState
    scope: ForwardScope


def ran_no_collective(cmd: int) -> str:
    """Why a worker refuses a command of its ``ep_collective_commands`` whose hook ran no collective (one answer)."""
    return (
        f"it ran no collective: cmd {command_word(cmd)} is in ep_collective_commands, but its hook ran no all-reduce "
        "through Collectives (skipped, or torch.distributed called directly); an empty forward says so: "
        "link.empty_forward()"
    )
