"""``EpLink``: the engine a model holds: one rank's end of the command protocol over a transport."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, MutableSequence, Sequence
from typing import Any, Final

from typing_extensions import Buffer, Self

from ._checks import check_bool, check_instance, check_int, check_seconds, disagreement
from ._errors import (
    EpLinkError,
    EpRoleError,
    EpSendError,
    EpSetupError,
)
from ._liveness import host_fingerprint
from ._protocol import ProtocolVersion
from ._reader import StateDigest
from ._sync import SyncPoints
from ._tokens import TokenArray, as_u32_buffer, token_count
from ._words import CMD_SHUTDOWN, U32_MAX, check_u32
from .transport import EpTransport
from .wire import (
    WIRE_VERSION,
    encode_close,
    encode_command,
    encode_header,
    encode_tokens_prefix,
    encode_word,
)

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
        """Whether :meth:`close` ran."""
        return self._closed

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
                items.append(as_u32_buffer(f"follow_ups[{index}]", follow_up))
        if self._rank:
            self._not_the_head()
        if self._answers_ready():
            self._raise_reports()
        self._send(encode_command(seq_id, cmd, items))
        self._commands += 1

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
            EpRoleError: called on a worker.
            EpSendError: the send failed.
        """
        self._require_head()
        if self._shut_down:
            return
        try:
            self.sync(slots)
        finally:
            self._send((encode_header(0, CMD_SHUTDOWN),))
            self._shut_down = True

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
                f"cmd={CMD_SHUTDOWN:#x} is the reserved shutdown word; call shutdown_workers() "
                "(ep_shutdown_workers() on a model) to stop the workers"
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
            raise EpSendError("this link was closed; nothing more can be sent")
        try:
            self._transport_send(parts, self._command_timeout)
        except Exception as error:
            raise EpSendError(f"head: broadcast to the workers failed: {error}") from error
        if len(parts) == 1:
            self._crc = zlib.crc32(parts[0], self._crc)
        else:
            crc = self._crc
            for part in parts:
                crc = zlib.crc32(part, crc)
            self._crc = crc

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
