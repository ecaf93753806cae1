"""``EpLink``: the engine a model holds: one rank's end of the command protocol over a transport."""

from __future__ import annotations

import copy
import logging
import os
import zlib
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from contextlib import contextmanager
from typing import Any, Final

from typing_extensions import Buffer, Self

from ._core.checks import check_bool, check_instance, check_int, check_seconds, disagreement
from ._core.codec import (
    WIRE_VERSION,
    encode_close,
    encode_command,
    encode_header,
    encode_tokens_prefix,
    encode_word,
)
from ._core.errors import (
    EpLinkError,
    EpRoleError,
    EpSendError,
    EpSetupError,
    RunStopped,
    describe_command,
    error_text,
)
from ._core.protocol import ProtocolVersion
from ._core.tokens import TokenArray, as_u32_buffer, token_count
from ._core.transport import EpTransport
from ._core.words import CMD_SHUTDOWN, U32_MAX, check_u32
from ._host.liveness import host_fingerprint
from ._reader import StateDigest
from ._sync import EXIT_GRACE, SyncPoints

DEFAULT_COMMAND_TIMEOUT: Final[float] = 60.0
"""Seconds a worker waits for a follow-up of a command in flight, and the head for a send."""

_CLOSE_TIMEOUT: Final[float] = 1.0
"""Seconds the head's close waits to tell the workers it closed (best effort)."""
_LOGGER = logging.getLogger("metrale_model_engine.link")


class EpLink(SyncPoints):
    """One rank's end of the head/worker command protocol: what a model holds to speak it.

    A model keeps its link in one attribute (``ep_link`` in a
    :class:`~metrale_model_engine.LinkedEp`) and speaks through it: the head starts
    a command with :meth:`send_command` (its header and every follow-up in one
    message) or item by item (:meth:`send_header`, :meth:`send_word`,
    :meth:`send_tokens`: the trait's per-word calls); a worker runs
    :meth:`step` in its loop, which calls the model's hook, and the hook reads the
    follow-ups with :meth:`recv_word`, :meth:`recv_tokens` and
    :meth:`recv_tokens_into`.  It owns its transport: :meth:`close` (or leaving a
    ``with`` block) closes both, and a head that closes before
    :meth:`shutdown_workers` makes every worker's next receive raise at once.

    Construction is collective: every rank of the transport's group builds its link
    at the same point, and all confirm that they agree on the wire version, the
    protocol, ``seq_id_on_wire`` and the slot count.  On failure the transport stays
    open (the caller's to close).

    Args:
        transport: the group of ranks to speak over.
        num_slots: the slot count, ``--max-batch-size``; a header's ``seq_id`` must
            be below it (checked on the head before sending).
        protocol: the header layout; default :meth:`ProtocolVersion.from_env`.
        seq_id_on_wire: whether headers carry ``seq_id``; always under v2, and by
            default under v1 too (it costs nothing), so that a worker's command
            sees the real slot under both versions.  ``False`` (v1 only) gives v1 as
            the Rust engine has it: workers run every command with ``seq_id`` 0.
        command_timeout: seconds a worker waits for a follow-up of a command in
            flight, and the head for a send to complete (``None``: as long as the
            transport allows).  The wait for the next header is not bounded by it:
            an idle worker waits as long as its transport allows.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has the right type and a wrong value
            (``seq_id_on_wire=False`` under v2 included).
        EpSetupError: the ranks disagree.
        EpLinkError: the setup exchange itself failed (a rank died, a timeout).
    """

    __slots__ = (
        "_answers_ready",
        "_closed",
        "_num_slots",
        "_protocol",
        "_seq_id_on_wire",
        "_shut_down",
        "_transport_send",
        "_world_size",
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
        self._num_slots = check_int("num_slots", num_slots, 1, U32_MAX)
        if protocol is None:
            protocol = ProtocolVersion.from_env()
        self._protocol = check_instance("protocol", protocol, ProtocolVersion, "a ProtocolVersion (V1 or V2)")
        self._seq_id_on_wire = check_bool("seq_id_on_wire", seq_id_on_wire)
        if protocol is ProtocolVersion.V2 and not seq_id_on_wire:
            raise ValueError("seq_id_on_wire=False needs protocol v1: every v2 header carries seq_id")
        self._command_timeout = check_seconds("command_timeout", command_timeout, allow_none=True)
        self._shut_down = False
        self._closed = False
        local_workers = self._agree_on_setup(transport)
        self._transport = transport
        self._transport_send = transport.send  # the hot paths call these bound methods
        self._answers_ready = transport.answers_ready
        self._rank = transport.rank
        self._world_size = transport.world_size
        self._start_reading()
        self._start_syncing()
        if self._rank == 0:
            self._watch_workers(local_workers)

    def _agree_on_setup(self, transport: EpTransport) -> dict[int, int]:
        """Run the setup exchange over ``transport``; raise unless every rank agrees.

        Returns the pid of every worker on this host, by rank.
        """
        rank = transport.rank
        mine = [WIRE_VERSION, self._protocol.code, int(self._seq_id_on_wire), self._num_slots, os.getpid()]
        mine += host_fingerprint()
        try:
            everyone = transport.gather(mine)
        except Exception as error:
            raise EpLinkError(f"rank {rank}: the setup exchange failed: {error}") from error
        for peer, words in enumerate(everyone):
            if len(words) != len(mine):
                raise EpSetupError(
                    f"rank {rank}: rank {peer} sent a setup of {len(words)} words, not {len(mine)}: "
                    "every rank must run the same version of this library"
                )
        fields: tuple[tuple[str, Callable[[int], str]], ...] = (
            ("wire version", str),
            ("protocol", "v{}".format),
            ("seq_id_on_wire option", lambda flag: str(bool(flag))),
            ("slot count", str),
        )
        for field, (name, shown) in enumerate(fields):
            problem = disagreement(rank, name, [words[field] for words in everyone], shown)
            if problem is not None:
                raise EpSetupError(problem)
        return {
            peer: words[4]
            for peer, words in enumerate(everyone)
            if peer and words[5:] == mine[5:] and words[4] not in (0, mine[4])
        }

    # -- what every rank can ask -------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank; 0 is the head."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks, head included; the protocol is live (``is_ep()``) when above 1."""
        return self._world_size

    @property
    def num_slots(self) -> int:
        """The slot count all ranks agreed on (``--max-batch-size``)."""
        return self._num_slots

    @property
    def protocol(self) -> ProtocolVersion:
        """The protocol version all ranks agreed on."""
        return self._protocol

    @property
    def seq_id_on_wire(self) -> bool:
        """Whether headers carry ``seq_id``: always under v2, under v1 unless turned off."""
        return self._seq_id_on_wire

    @property
    def command_timeout(self) -> float | None:
        """Seconds a command's follow-ups and a send may wait (``None``: the transport's own limit)."""
        return self._command_timeout

    @property
    def transport(self) -> EpTransport:
        """The transport this link speaks over, and owns."""
        return self._transport

    @property
    def workers_shut_down(self) -> bool:
        """Whether the head has sent the shutdown header (:meth:`shutdown_workers`)."""
        return self._shut_down

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the run stopped, which closes the link)."""
        return self._closed

    @property
    def stopped(self) -> RunStopped | None:
        """Why the run stopped (see :class:`RunStopped`; a copy of the first one raised), ``None`` while it goes on.

        Once set, every send, step and sync point raises :class:`RunStopped`.
        """
        return self._stopped

    @property
    def commands(self) -> int:
        """Commands sent (head) or received (worker) so far; a :class:`WorkerFailure` names one by this count."""
        return self._commands

    @property
    def state_digest(self) -> StateDigest | None:
        """A function ``digest(slots) -> int`` (u64) of a rank's slots, compared at sync points; default ``None``.

        Set it on every rank (the same function): :meth:`sync` then compares every
        worker's digest of its slots with the head's.
        """
        return self._state_digest

    @state_digest.setter
    def state_digest(self, digest: StateDigest | None) -> None:
        if digest is not None and not callable(digest):
            raise TypeError(f"state_digest must be a function of the slots or None, got {type(digest).__name__}")
        self._state_digest = digest

    # -- head ----------------------------------------------------------------

    def send_command(self, seq_id: int, cmd: int, *follow_ups: int | TokenArray) -> None:
        """Head: send command ``cmd`` for ``seq_id`` with its follow-ups, as one message.

        A follow-up is a u32 word (an ``int``) or a token array; workers read them
        in order with :meth:`recv_word` and :meth:`recv_tokens`.  Over shared memory
        the command is one ring record (consecutive records only past the record
        size); over torch.distributed it is at most two broadcasts.  Everything is
        checked before anything is sent.

        Raises:
            TypeError, ValueError: a word or token is not a u32 (the message names
                ``follow_ups[i]``), ``seq_id >= num_slots``, or ``cmd`` is the
                shutdown word.
            EpRoleError: called on a worker.
            EpSendError: the send failed (a worker gone, a timeout).
        """
        seq_id, cmd = self._checked_header(seq_id, cmd)
        items: list[int | Buffer] = []
        for index, follow_up in enumerate(follow_ups):
            if isinstance(follow_up, int):
                fast = type(follow_up) is int and not follow_up >> 32
                items.append(follow_up if fast else check_u32(f"follow_ups[{index}]", follow_up))
            else:
                items.append(_follow_up_array(index, follow_up))
        if self._rank:
            self._not_the_head()
        if self._answers_ready():
            self._raise_reports()
        self._send(encode_command(seq_id, cmd, items))
        self._commands += 1
        self._command = (seq_id, cmd)

    def send_header(self, seq_id: int, cmd: int) -> None:
        """Head: send the header that starts command ``cmd`` for ``seq_id``, alone (the trait's per-word form).

        Raises:
            TypeError, ValueError: a word is not a u32, ``seq_id >= num_slots``, or
                ``cmd`` is the shutdown word (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the send failed.
        """
        if type(seq_id) is not int or type(cmd) is not int or seq_id >= self._num_slots or cmd >= CMD_SHUTDOWN:
            seq_id, cmd = self._checked_header(seq_id, cmd)  # raises, or normalises an IntEnum
        elif seq_id < 0 or cmd < 0:
            self._checked_header(seq_id, cmd)
        elif not self._seq_id_on_wire:
            seq_id = 0
        if self._rank:
            self._not_the_head()
        if self._answers_ready():
            self._raise_reports()
        self._send((encode_header(seq_id, cmd),))
        self._commands += 1
        self._command = (seq_id, cmd)

    def send_word(self, word: int) -> None:
        """Head: send one follow-up word of the command in flight.

        Raises:
            TypeError, ValueError: ``word`` is not a u32 (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the send failed.
        """
        if type(word) is not int or word >> 32:
            word = check_u32("word", word)
        if self._rank:
            self._not_the_head()
        self._send((encode_word(word),))

    def send_tokens(self, tokens: TokenArray) -> Buffer:
        """Head: send one follow-up token array; return it as the u32 buffer that was sent.

        Raises:
            TypeError, ValueError: a token is not a u32 (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the send failed.
        """
        buffer = as_u32_buffer("tokens", tokens)
        self._require_head()
        self._send((encode_tokens_prefix(token_count(buffer)), buffer))
        return buffer

    def shutdown_workers(self, slots: MutableSequence[Any] | None = None) -> None:
        """Head: a sync point (:meth:`sync`), then the shutdown header; every worker's loop then ends.

        The shutdown header goes out even when the sync point raises (the workers
        still leave their loops), and then the sync point's error is raised: a head
        cannot shut down past a failure it was not told of.  Idempotent: later calls
        send nothing.  After it, other sends raise :class:`EpSendError`.

        Raises:
            EpWorkerFailed, EpDivergenceError: as :meth:`sync`.
            RunStopped: the run stopped (nothing is sent: the link is closed).
            EpRoleError: called on a worker.
            EpSendError: the send failed.
        """
        self._require_head()
        if self._shut_down:
            return
        if self._stopped is not None:
            raise self._still_stopped()
        try:
            self.sync(slots)
        finally:
            self._send((encode_header(0, CMD_SHUTDOWN),))
            self._shut_down = True

    def _send_failed(self, error: Exception) -> EpSendError | RunStopped:
        """Why a send failed, as far as the head can tell: a worker that stopped the run, or the ranks gone.

        Reports found on the way (ordinary ones too) are in the error's message.
        """
        failures, exited = self._stopped_workers(0.0)
        why = self._why_stopped(failures, exited)
        if any(failure.stopped for failure in failures):
            return self._stop(RunStopped(f"head: the run stopped: {why}; the send failed", failures, exited))
        return EpSendError(f"head: broadcast to the workers failed: {error}" + (f"; {why}" if why else ""))

    def _checked_header(self, seq_id: int, cmd: int) -> tuple[int, int]:
        if type(seq_id) is not int or seq_id >> 32:
            seq_id = check_u32("seq_id", seq_id)
        if type(cmd) is not int or cmd >> 32:
            cmd = check_u32("cmd", cmd)
        if seq_id >= self._num_slots:
            raise ValueError(
                f"seq_id={seq_id} is out of range for {self._num_slots} slots (0 ..= {self._num_slots - 1})"
            )
        if cmd == CMD_SHUTDOWN:
            raise ValueError(
                f"cmd={CMD_SHUTDOWN:#x} is the reserved shutdown word; call ep_link.shutdown_workers() "
                "to stop the workers"
            )
        return (seq_id if self._seq_id_on_wire else 0), cmd

    def _require_head(self) -> None:
        if self._rank:
            self._not_the_head()

    def _not_the_head(self) -> None:
        raise EpRoleError(f"only the head (rank 0) sends; this is worker rank {self._rank}")

    def _send(self, parts: Sequence[Buffer]) -> None:
        if self._shut_down:
            raise EpSendError("the workers were shut down (shutdown_workers); nothing more can be sent")
        if self._closed:
            if self._stopped is not None:
                raise self._still_stopped()
            raise EpSendError("this link was closed; nothing more can be sent")
        try:
            self._transport_send(parts, self._command_timeout)
        except Exception as error:
            raise self._send_failed(error) from error
        if len(parts) == 1:
            self._crc = zlib.crc32(parts[0], self._crc)
        else:
            crc = self._crc
            for part in parts:
                crc = zlib.crc32(part, crc)
            self._crc = crc

    # -- the run stops --------------------------------------------------------

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Run a block that makes collectives with the other ranks: if it raises, the run stops on every rank.

        For the head's forward of a command it sent (and for a worker's hook, around
        the part that runs collectives, when its command word is not declared in
        ``LinkedEp.ep_collective_commands``: a declared command's whole step is
        covered already).  The other ranks are in, or on their way to, the block's
        collectives, so its failure cannot be an ordinary one: on the head it raises
        :class:`RunStopped` naming the command in flight and the error, and closes
        the link (over shared memory, workers waiting for a command then leave at
        once; over a group, when the head's process exits); on a worker it refuses
        the command (:class:`EpCommandRefused`, reported to the head).
        A :class:`RunStopped` raised inside passes through as it is.  ``with
        link.collective():`` on a link whose run stopped raises at once.

        Raises:
            RunStopped: the block raised, or the run stopped earlier.
        """
        if self._stopped is not None:
            raise self._still_stopped()
        try:
            yield
        except RunStopped:
            raise
        except Exception as error:
            if self._rank:
                self._collective = True
                raise self._failed(error) from error
            where = describe_command(self._commands, *self._command)
            raise self._stop(
                RunStopped(f"head: the run stopped: its own forward of {where} failed: {error_text(error)}")
            ) from error
        except BaseException as interrupt:  # KeyboardInterrupt, SystemExit: they pass, the run is over
            where = describe_command(self._commands, *self._command)
            who = f"worker rank {self._rank}" if self._rank else "head"
            self._stop(RunStopped(f"{who}: the run stopped in {where}: {type(interrupt).__name__}"))
            raise

    def collective_failed(
        self, error: BaseException, *, what: str = "a collective", grace: float = EXIT_GRACE
    ) -> RunStopped:
        """A collective of the command in flight failed on this rank (``error``): stop the run; return what to raise.

        For the code that runs a model's collectives (``metrale_model_engine.torch.Collectives``
        does it for its all-reduces): the backend says only that some peer is gone or
        late.  The head looks, for up to ``grace`` seconds, for the workers that
        reported a failure or exited (their rank, command and error go into the
        message, :attr:`RunStopped.failures` and :attr:`RunStopped.ranks`); a worker
        names the command, and reports the failure to the head.  Workers of the
        head's host that are stopped (a signal, a debugger) are named too.  The link
        is closed (on the head, over shared memory, that tells waiting workers to
        leave) and later calls raise :class:`RunStopped`.  If the run had stopped already, the
        :class:`RunStopped` says so.

        Args:
            error: the backend's error.
            what: how messages name the collective (``"an all-reduce"``).
            grace: seconds the head looks for the rank behind the failure (a worker
                that just failed takes a moment to exit).
        """
        if self._stopped is not None:
            return self._still_stopped()
        where = describe_command(self._commands, *self._command)
        if self._rank:
            stopped = RunStopped(
                f"worker rank {self._rank}: the run stopped in {where}: {what} failed, so a rank died, "
                f"left the run or stalls: {error_text(error)}"
            )
            self._leave(stopped, f"{what} failed here: {error_text(error)}", witness=True)
            return stopped
        limit = check_seconds("grace", grace, allow_zero=True)
        assert limit is not None
        halted = self._halted_workers()  # a worker that cannot run will not report or exit: no grace to wait
        failures, exited = self._stopped_workers(0.0 if halted else limit)
        if failures or exited:
            why = self._why_stopped(failures, exited)
        elif halted:
            exited = halted
            why = f"{what} failed ({error_text(error)}): worker rank(s) {halted} are stopped (a signal, a debugger)"
        else:
            why = (
                f"{what} failed ({error_text(error)}), and no worker reported a failure or exited within {limit:g} s "
                "(a worker that stalls or skipped its forward, or one on another host)"
            )
        return self._stop(RunStopped(f"head: the run stopped in {where}: {why}", failures, exited))

    def raise_if_stopped(self) -> None:
        """Raise :class:`RunStopped` if the run stopped (:attr:`stopped`); for a model's head methods, first thing.

        Sends and steps check it themselves; a head method calls it before its own
        checks, so that a stopped run is what the caller hears of, on one rank as on many.
        """
        if self._stopped is not None:
            raise self._still_stopped()

    def _stop(self, stopped: RunStopped) -> RunStopped:
        """Record why the run stopped (the first reason stays) and close the link; return ``stopped``.

        What is recorded is a copy that no traceback will reach: the raised error's
        traceback keeps every frame's locals (tensors, process groups) alive.
        """
        if self._stopped is None:
            kept = copy.copy(stopped)
            kept.__traceback__ = kept.__cause__ = kept.__context__ = None
            self._stopped = kept
        self.close()
        return stopped

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Close the link and its transport.  Idempotent.

        A head that has not shut its workers down tells them first (best effort,
        within a second), so that every worker's next receive raises
        :class:`EpReceiveError` at once, whatever the transport.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._rank == 0 and not self._shut_down and self._world_size > 1:
                timeout = min(_CLOSE_TIMEOUT, self._command_timeout or _CLOSE_TIMEOUT)
                if self._stopped is not None:  # workers may be inside a collective: look once, do not wait
                    timeout = 0.0
                self._transport.send((encode_close(),), timeout)
        except Exception as error:  # noqa: BLE001  (the workers may be gone: the transport's close is what is left)
            _LOGGER.debug("the head could not tell its workers that it closed: %s", error)
        finally:
            self._stop_watching()
            self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<EpLink rank {self._rank} of {self._world_size}, protocol {self._protocol.value}, "
            f"{self._num_slots} slots, {type(self._transport).__name__}, {state}>"
        )


def _follow_up_array(index: int, value: object) -> Buffer:
    """Follow-up ``index`` of a command that is not an int: a token array, converted and checked."""
    name = f"follow_ups[{index}]"
    try:
        return as_u32_buffer(name, value)  # type: ignore[arg-type]  # any object: TypeError below
    except TypeError:
        if isinstance(value, Sequence):
            raise
        try:
            memoryview(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            raise
    raise TypeError(
        f"{name} must be a u32 word (an int in 0 ..= {U32_MAX}) or a token array, got {type(value).__name__} {value!r}"
    )
