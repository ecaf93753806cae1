"""``EpLink``: the engine a model holds: one rank's end of the command protocol over a transport."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Container, MutableSequence
from typing import Any

from typing_extensions import Buffer, Self

from .._core.errors import RunStopped
from .._core.protocol import ProtocolVersion
from .._core.state import S
from .._core.tokens import ArrayInterface, TokenArray
from .._core.transport import EpTransport
from .forward import Forward, ForwardCollectives
from .reader import RunCommand
from .reform.side import ReformSide
from .roles import role_for
from .run_state import CommandStream, ForwardScope, LinkParts, LinkState, Phase
from .settings import DEFAULT_COMMAND_TIMEOUT, LinkSettings, agree_on_setup
from .way_back.worker import StateDigest


class EpLink(ForwardCollectives):
    """One rank's end of the head/worker command protocol: what a model holds to speak it.

    A model keeps its link in ``self.ep_link`` ([`LinkedEp`][metrale_model_engine.LinkedEp]): the head starts
    a command with [`send_command`][metrale_model_engine.EpLink.send_command] (one message) or item by item
    ([`send_header`][metrale_model_engine.EpLink.send_header], [`send_word`][metrale_model_engine.EpLink.send_word],
    [`send_tokens`][metrale_model_engine.EpLink.send_tokens]: the trait's per-word calls); a worker runs
    [`step`][metrale_model_engine.EpLink.step] in its loop, and the model's hook reads the follow-ups with
    [`recv_word`][metrale_model_engine.EpLink.recv_word], [`recv_tokens`][metrale_model_engine.EpLink.recv_tokens]
    and [`recv_tokens_into`][metrale_model_engine.EpLink.recv_tokens_into].  It owns its transport:
    [`close`][metrale_model_engine.EpLink.close] (or a ``with`` block) closes both.  Construction is collective:
    every rank builds its link at the same point, and all confirm that they agree on the wire version, the
    protocol, ``seq_id_on_wire`` and the slot count (on failure the transport stays open, the caller's to close).

    A call of the other role's raises ``EpRoleError`` before anything else (a send or a sync point on a worker,
    a step or a receive on the head).  A send checks everything first (``TypeError``/``ValueError`` naming
    the argument; nothing is sent) and raises ``EpSendError`` when the transport fails.  A receive waits at
    most ``command_timeout`` and raises ``EpMismatchError`` when the head sent something else (the item is
    consumed; a next command's header stays for the next step), ``EpReceiveError`` when it failed.  Once the
    run stopped ([`RunStopped`][metrale_model_engine.RunStopped]), every send, step and sync point raises it,
    and the link has closed itself (at the stop, whichever call found it).

    Args:
        transport: the group of ranks to speak over.
        num_slots: the slot count, ``--max-batch-size``; a header's ``seq_id`` must
            be below it (checked on the head before sending).
        protocol: the header layout; default
            [`ProtocolVersion.from_env`][metrale_model_engine.ProtocolVersion.from_env].
        seq_id_on_wire: whether headers carry ``seq_id``: always under v2, by default
            under v1 too (it costs nothing); ``False`` (v1 only) is v1 as the Rust
            engine has it: workers run every command with ``seq_id`` 0.
        command_timeout: seconds a worker waits for a follow-up of a command in
            flight, and the head for a send (``None``: as long as the transport
            allows).  An idle worker's wait for the next header is not bounded by it.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has the right type and a wrong value
            (``seq_id_on_wire=False`` under v2 included).
        EpSetupError: the ranks disagree.
        EpLinkError: the setup exchange itself failed (a rank died, a timeout).
    """

    # The parts of an epoch: settings (read-only), the stream's count, the link's one state (whose stop closes the
    # link), its forward's scope; the role, chosen once: the head's parts or the worker's (the other role's are
    # stand-ins that raise EpRoleError), and what differs between them.  _sender and _reader are the role's, held for
    # the hot paths.  What outlives an epoch, for a re-form over the ranks left after a loss: _side.
    __slots__ = (
        "__weakref__",
        "_reader",
        "_role",
        "_scope",
        "_sender",
        "_settings",
        "_side",
        "_state",
        "_stream",
        "_transport",
    )

    def __init__(
        self,
        transport: EpTransport,
        *,
        num_slots: int,
        protocol: ProtocolVersion | None = None,
        seq_id_on_wire: bool = True,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        options = {"protocol": protocol, "seq_id_on_wire": seq_id_on_wire, "command_timeout": command_timeout}
        settings = LinkSettings.checked(transport.rank, transport.world_size, num_slots=num_slots, **options)
        local_workers = agree_on_setup(transport, settings)
        self._side = ReformSide(local_workers)
        self._build(transport, settings)

    def _build(self, transport: EpTransport, settings: LinkSettings) -> None:
        """The parts of an epoch over ``transport``, whose setup agreement passed."""
        self._settings = settings
        self._transport = transport
        stream, state = CommandStream(), LinkState(settings.who, _closes(self))  # a stop closes the link
        scope = ForwardScope(settings.world_size > 1)
        parts = LinkParts(transport, settings, stream, state, scope)
        self._stream, self._state, self._scope = stream, state, scope
        role = self._role = role_for(parts, self._side.local)
        self._sender, self._reader = role.sender, role.reader
        before, self._forward = getattr(self, "_forward", None), Forward(parts, role)
        if before is not None and before.declared is not None:  # an epoch after the first: as the model declared
            self._forward.declare(before.declared)
        if self._side.opted_in:
            role.stop_on_loss()

    # -- what every rank can ask -------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank; 0 is the head."""
        return self._settings.rank

    @property
    def world_size(self) -> int:
        """Number of ranks, head included; the protocol is live (``is_ep()``) when above 1."""
        return self._settings.world_size

    @property
    def epoch(self) -> int:
        """How many times this link re-formed over the ranks left after a loss (0: as built); every rank agrees."""
        return self._settings.epoch

    @property
    def num_slots(self) -> int:
        """The slot count all ranks agreed on (``--max-batch-size``)."""
        return self._settings.num_slots

    @property
    def protocol(self) -> ProtocolVersion:
        """The protocol version all ranks agreed on."""
        return self._settings.protocol

    @property
    def seq_id_on_wire(self) -> bool:
        """Whether headers carry ``seq_id``: always under v2, under v1 unless turned off."""
        return self._settings.seq_id_on_wire

    @property
    def command_timeout(self) -> float | None:
        """Seconds a command's follow-ups and a send may wait (``None``: the transport's own limit)."""
        return self._settings.command_timeout

    @property
    def transport(self) -> EpTransport:
        """The transport this link speaks over, and owns."""
        return self._transport

    @property
    def workers_shut_down(self) -> bool:
        """Whether the head has sent the shutdown header (``shutdown_workers``)."""
        return self._state.phase is Phase.SHUT_DOWN

    @property
    def closed(self) -> bool:
        """Whether [`close`][metrale_model_engine.EpLink.close] ran (or the run stopped, which closes the link)."""
        return self._state.closed

    @property
    def stopped(self) -> RunStopped | None:
        """Why the run stopped (a copy of the first ``RunStopped`` raised), ``None`` while it goes on."""
        return self._state.stopped

    @property
    def commands(self) -> int:
        """Commands sent (head) or received (worker) so far; a ``WorkerFailure`` names one by this count."""
        return self._stream.commands

    @property
    def state_digest(self) -> StateDigest | None:
        """A function ``digest(slots) -> int`` (u64) of a rank's slots, compared at sync points; default ``None``.

        Set it on every rank (the same function): [`sync`][metrale_model_engine.EpLink.sync] compares the workers' with
        the head's.
        """
        return self._role.state_digest

    @state_digest.setter
    def state_digest(self, digest: StateDigest | None) -> None:
        if digest is not None and not callable(digest):
            raise TypeError(f"state_digest must be a function of the slots or None, got {type(digest).__name__}")
        self._role.state_digest = digest

    # -- head: sends ---------------------------------------------------------

    def send_command(self, seq_id: int, cmd: int, *follow_ups: int | TokenArray) -> None:
        """Head: send command ``cmd`` for ``seq_id`` with its follow-ups, as one message.

        A follow-up is a u32 word (an ``int``) or a token array; workers read them
        in order with [`recv_word`][metrale_model_engine.EpLink.recv_word] and
        [`recv_tokens`][metrale_model_engine.EpLink.recv_tokens].  Over shared memory the command is one ring record
        (consecutive records only past the record size); over torch.distributed it is at most two broadcasts.

        Raises:
            TypeError, ValueError: a word or token is not a u32 (the message names
                ``follow_ups[i]``), ``seq_id >= num_slots``, or ``cmd`` is the
                shutdown word.
            EpWorkerFailed, RunStopped: workers reported failures (nothing is sent).
            EpRoleError, EpSendError: see the class.
        """
        self._sender.send_command(seq_id, cmd, follow_ups)

    def send_header(self, seq_id: int, cmd: int) -> None:
        """Head: send the header that starts command ``cmd`` for ``seq_id``, alone (the trait's per-word form).

        Raises as [`send_command`][metrale_model_engine.EpLink.send_command].
        """
        self._sender.send_header(seq_id, cmd)

    def send_word(self, word: int) -> None:
        """Head: send one follow-up word of the command in flight (see the class for what a send raises)."""
        self._sender.send_word(word)

    def send_tokens(self, tokens: TokenArray) -> Buffer:
        """Head: send one follow-up token array; return it as the u32 buffer that was sent (see the class)."""
        return self._sender.send_tokens(tokens)

    # -- head: the workers' state ------------------------------------------------

    def sync(self, slots: MutableSequence[Any] | None = None) -> None:
        """Head: wait until every worker has run every command sent so far, and check that they agree.

        Each worker's loop answers the sync item with what it received (the count of
        commands, a CRC-32 of every message) and, when ``slots`` is given and
        [`state_digest`][metrale_model_engine.EpLink.state_digest] is set, the digest of its slots; the head reads every
        worker's answers, reports first, within ``command_timeout``.  A no-op on one rank.

        Raises:
            EpWorkerFailed: workers reported failed commands not raised yet (each once).
            RunStopped: a worker's report stopped the run, or the run stopped earlier.
            EpDivergenceError: a worker's stream or state differs from the head's (the
                message names the ranks, and the commands within which they diverged).
            RunStopped: also when a worker died, or did not answer within ``command_timeout``: the head
                cannot know what it ran (the message names it, and whether it exited or went silent).
            EpRoleError, EpSendError: see the class.
            EpLinkError: a worker's answer was corrupt, or its reports were lost on the way.
        """
        sync = self._role.sync_points.sync  # EpRoleError on a worker, before the digest runs
        if self._settings.world_size == 1:
            return
        digest = self._role.state_digest
        sync(None if slots is None or digest is None else digest(slots))

    def shutdown_workers(self, slots: MutableSequence[Any] | None = None) -> None:
        """Head: a sync point (``sync``), then the shutdown header; every worker's loop then ends.

        The shutdown header goes out even when the sync point raises (without
        waiting, once a worker is dead or silent), then the sync point's error is
        raised: a head cannot shut down past a failure it was not told of.
        Idempotent; after it, other sends raise [`EpSendError`][metrale_model_engine.EpSendError].

        Raises:
            EpWorkerFailed, EpDivergenceError, RunStopped: as [`sync`][metrale_model_engine.EpLink.sync].
            EpRoleError, EpSendError: see the class.
        """
        shutdown = self._sender.shutdown  # EpRoleError on a worker
        if self._state.phase is Phase.SHUT_DOWN:
            return
        self.raise_if_stopped()
        self._scope.open = False
        try:
            self.sync(slots)
        except BaseException as failure:
            shutdown(failure)  # the sync point's error says what went wrong, not this send's
            raise
        shutdown(None)

    def check_workers(self, timeout: float = 0.0) -> None:
        """Head: raise why workers stopped, if they reported a failure or their process (on this host) exited.

        It looks until it finds something or ``timeout`` seconds have passed (a
        worker that just failed takes a moment to exit), and returns when it found
        nothing (or the worker that stopped runs on another host and sent no report:
        a silent heartbeat alone is no proof, so it is named only where something
        already failed, as in [`collective_failed`][metrale_model_engine.EpLink.collective_failed], which uses this).  A
        no-op on one rank.

        Raises:
            EpWorkerFailed: workers reported failed commands (each once), none stopping the run.
            RunStopped: a report stopped the run, or workers of this host exited (named).
            EpRoleError: called on a worker.
            TypeError, ValueError: ``timeout`` is not a number of seconds ``>= 0``.
        """
        self._role.reports.check(timeout)

    # -- worker --------------------------------------------------------------

    def step(
        self, run: RunCommand[S], slots: MutableSequence[S | None], collective: Container[int] = frozenset()
    ) -> bool:
        """Worker: receive the next header and run its command with ``run(seq_id, cmd, slots)``.

        What the trait's ``ep_worker_step`` does; ``collective`` holds the command
        words whose forward runs collectives.  Waits for the header without the
        command timeout (an idle server is not a failure).  Returns ``False`` on the
        shutdown word.

        Raises:
            EpCommandFailed: the header arrived and the command failed (``seq_id >=
                len(slots)``, an unknown command, a follow-up other than the head sent,
                read past a whole command's end or left unread, an error in the
                command); the worker stays in step.  (Follow-ups of a command sent
                item by item left unread fail the next step, once.)
            EpCommandRefused: the same for a command in ``collective`` (or refused by
                the hook): reported to the head as stopping the run; the worker exits.
            RunStopped: a collective of the command failed, or the run stopped earlier.
            EpReceiveError: a receive failed (head gone, a timeout, a corrupt
                message, the head closed its link); the worker must exit.
            EpRoleError: called on the head.
        """
        return self._reader.step(run, slots, collective)

    def recv_word(self) -> int:
        """Worker: the next follow-up word (the head's ``send_word``, or a word of ``send_command``).

        Raises as a receive does (see the class); ``EpMismatchError`` also when the command came whole.
        """
        return self._reader.recv_word()

    def recv_tokens(self, count: int | None = None) -> list[int]:
        """Worker: the next follow-up token array, as a list; pass ``count`` to require a length.

        See the class for what a receive raises: ``EpMismatchError`` too when another
        number than ``count`` came (the message names both); ``TypeError`` or
        ``ValueError`` when ``count`` is not ``None`` or an int ``>= 0`` (nothing is received).
        """
        return self._reader.recv_tokens(count)

    def recv_tokens_into(self, buffer: Buffer | ArrayInterface) -> None:
        """Worker: the next follow-up token array, written into ``buffer`` in place.

        ``buffer``: a writable, C-contiguous, 1-D u32 buffer (``array('I')``, numpy
        ``uint32``) of the head's length, for tokens that go to a tensor, not to Python.

        See the class for what a receive raises: ``EpMismatchError`` too for a token
        array of another length; ``TypeError`` or ``ValueError`` when ``buffer`` is not
        such a buffer (nothing is received).
        """
        self._reader.recv_tokens_into(buffer)

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Close the link and its transport.  Idempotent.

        A head that has not shut its workers down tells them first (best effort,
        within a second; once the run stopped, without waiting), so that every
        worker's next receive raises [`EpReceiveError`][metrale_model_engine.EpReceiveError] at once.  A link
        whose model re-forms ([`LinkedEp.ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms]) lets go of its
        re-form channel too (the run's stop closes the link but keeps that): the head tells the workers that wait
        for a re-form that none comes.
        """
        try:
            self._shut()
        finally:
            self._side.release(self._settings.rank == 0)

    def _shut(self) -> None:
        """Close this epoch: its role's parts and its transport (a stop does, keeping what a re-form needs)."""
        state = self._state
        if state.closed:
            return
        state.closed = True
        try:
            self._role.close()
        finally:
            self._transport.close()

    def raise_if_stopped(self) -> None:
        """Raise ``RunStopped`` if the run stopped; for a model's head methods, first thing.

        Sends and steps check it themselves; a head method calls it before its own checks.
        """
        self._state.raise_if_stopped()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        settings = self._settings
        state = "closed" if self._state.closed else self._state.phase.value
        return (
            f"<EpLink rank {settings.rank} of {settings.world_size}, protocol {settings.protocol.value}, "
            f"{settings.num_slots} slots, {type(self._transport).__name__}, {state}>"
        )


def _closes(link: EpLink) -> Callable[[], None]:
    """What closes ``link``'s epoch once its run stopped, holding it weakly: its state refers to it, not back, so a
    link dropped without ``close`` is freed (and its transport let go) at once, as before any stop."""
    held = weakref.ref(link)

    def close() -> None:
        alive = held()
        if alive is not None:
            alive._side.stopped()
            alive._shut()

    return close


def side_of(link: EpLink) -> ReformSide:
    """What ``link`` keeps across its epochs, for its re-forms."""
    return link._side


def opt_in(link: EpLink) -> None:
    """``link``'s model re-forms (``LinkedEp.ep_reforms``): keep a channel; the head stops the run on a lost worker."""
    link._side.opt_in(link._transport)
    link._role.stop_on_loss()


def shut_epoch(link: EpLink) -> None:
    """Close ``link``'s epoch (its transport), keeping what a re-form needs; noted as when it stopped here."""
    link._side.stopped()
    link._shut()


def renew(link: EpLink, transport: EpTransport, epoch: int, timeout: float) -> None:
    """``link``'s next epoch over ``transport`` (its setup agreement at ``epoch``, within ``timeout``), this epoch's
    parts replaced; its state digest kept.  The epoch before must be closed.

    Raises:
        EpSetupError, EpLinkError: as the setup agreement (the link stays as it was).
    """
    settings = dataclasses.replace(link._settings, rank=transport.rank, world_size=transport.world_size, epoch=epoch)
    link._side.local = agree_on_setup(transport, settings, timeout)
    digest = link._role.state_digest
    link._build(transport, settings)
    link._role.state_digest = digest
    link._side.stopped_at = 0.0


def command_in_flight(link: EpLink) -> tuple[int, int]:
    """The ``(seq_id, cmd)`` of the command ``link`` began last: what a message about it names."""
    return link._stream.command
