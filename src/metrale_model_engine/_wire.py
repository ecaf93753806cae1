"""``WireEp``: the whole head/worker protocol over an :class:`EpTransport`."""

from __future__ import annotations

import contextlib
import math
from array import array
from collections.abc import Callable, Iterator, MutableSequence, Sized
from typing import ClassVar, Final, NoReturn

from typing_extensions import Buffer

from ._errors import (
    EpCommandFailed,
    EpLinkError,
    EpMismatchError,
    EpReceiveError,
    EpRoleError,
    EpSendError,
    EpSetupError,
)
from ._frame import FRAME_WORDS, INLINE_TOKENS, FrameKind
from ._model import ModelEp, S
from ._protocol import EpProtocol
from ._tokens import U32_TYPECODE, ArrayInterface, TokenArray, as_u32_buffer, token_count, writable_u32_buffer
from ._transport import Broadcast, EpTransport
from ._words import CMD_SHUTDOWN, U32_MAX, check_u32

WIRE_VERSION: Final[int] = 2
"""Version of this library's wire format (the frame layout); every rank must run the same one."""

DEFAULT_COMMAND_TIMEOUT: Final[float] = 60.0
"""Seconds a worker waits for a follow-up word or payload of a command in flight."""

_KINDS: Final[dict[int, FrameKind]] = {int(kind): kind for kind in FrameKind}
_BLANK: Final[array[int]] = array(U32_TYPECODE, bytes(4 * INLINE_TOKENS))


class WireEp(ModelEp[S]):
    """A :class:`ModelEp` that speaks the protocol over a transport.

    The model subclass inherits every trait method and overrides one hook,
    :meth:`ep_run_command`, which runs a command on a worker; the head side of a
    command is plain calls to the broadcast methods, the worker side calls to the
    receive methods (:meth:`ep_recv_word`, :meth:`ep_recv_tokens`,
    :meth:`ep_recv_tokens_into`).  A backend subclass (such as
    ``metrale_model_engine.torch.TorchEp``) builds the transport.

    Every message travels in a fixed-size frame that says what it is (see
    ``_frame``), so a worker that asks for a follow-up the head did not send gets an
    :class:`EpMismatchError` and stays in step, and a command that fails half way
    (``seq_id`` out of range, an error in the model) has its unread follow-ups
    skipped by the next :meth:`ep_worker_step`.

    Construction is collective: every rank of the transport's group must construct
    its model at the same point, and all confirm that they agree on
    :data:`WIRE_VERSION`, the protocol, ``v1_slot`` and the slot count; a mismatch
    raises :class:`EpSetupError` on every rank.

    Args:
        transport: the group of ranks to speak over.
        num_slots: the slot count, ``--max-batch-size``; a header's ``seq_id`` must
            be below it (checked on the head before sending).
        protocol: the header layout; default :meth:`EpProtocol.from_env`.
        v1_slot: under protocol v1, carry ``seq_id`` in the header frame anyway, so
            that the worker's command sees the real slot under both versions (the
            default; it costs nothing, the frame has room).  ``False`` gives v1 as
            the Rust engine has it: workers run every command with ``seq_id`` 0.
            Ignored under v2, which always carries it.
        command_timeout: seconds a worker waits for the follow-up words and
            payloads of a command in flight, and the head for a broadcast to
            complete (``None``: the group's own timeout).  The backend applies it
            to the collective itself, so a wait that fires leaves nothing pending.
            The wait for the next header is not bounded by it: an idle worker waits
            as long as the group timeout allows.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument has the right type and a wrong value (also
            ``v1_slot=False`` under v1 for a model with :attr:`needs_seq_id`).
        EpSetupError: the ranks disagree.
        EpLinkError: the setup exchange itself failed.
    """

    __slots__ = (
        "_broadcast_frame",
        "_command",
        "_command_timeout",
        "_frame",
        "_header_waiting",
        "_last_failed",
        "_num_slots",
        "_protocol",
        "_rank",
        "_shut_down",
        "_transport",
        "_v1_slot",
        "_world_size",
    )
    needs_seq_id: ClassVar[bool] = False
    """Set ``True`` in a model that serves several slots: construction then refuses
    ``v1_slot=False`` under v1 (``ValueError``), which would run every command in slot 0."""

    _transport: EpTransport
    _rank: int
    _world_size: int
    _broadcast_frame: Broadcast

    def __init__(
        self,
        transport: EpTransport,
        *,
        num_slots: int,
        protocol: EpProtocol | None = None,
        v1_slot: bool = True,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        super().__init__()
        if type(num_slots) is not int or not 1 <= num_slots <= U32_MAX:
            _bad_argument("num_slots", num_slots, f"an int in 1 ..= {U32_MAX}", int)
        if protocol is None:
            protocol = EpProtocol.from_env()
        elif not isinstance(protocol, EpProtocol):
            _bad_argument("protocol", protocol, "an EpProtocol (EpProtocol.V1 or EpProtocol.V2)", EpProtocol)
        if not isinstance(v1_slot, bool):
            _bad_argument("v1_slot", v1_slot, "a bool", bool)
        if self.needs_seq_id and protocol is EpProtocol.V1 and not v1_slot:
            raise ValueError(
                f"{type(self).__name__} needs seq_id on the wire, but v1_slot=False under protocol v1 "
                "leaves it off: keep v1_slot=True (the default) or use protocol v2"
            )
        if command_timeout is not None and not (
            isinstance(command_timeout, (int, float))
            and not isinstance(command_timeout, bool)
            and 0 < command_timeout < math.inf
        ):
            _bad_argument("command_timeout", command_timeout, "a positive, finite number of seconds or None", float)
        self._num_slots = num_slots
        self._protocol = protocol
        self._v1_slot = v1_slot
        self._command_timeout = None if command_timeout is None else float(command_timeout)
        self._shut_down = False
        self._frame = array(U32_TYPECODE, bytes(4 * FRAME_WORDS))
        self._header_waiting = False  # the frame holds a header that no step has run yet
        self._last_failed = False  # the last command failed: skip what it left unread
        self._command = (0, 0)  # (seq_id, cmd) of the command in flight, for messages
        self.attach(transport)

    # -- setup ---------------------------------------------------------------

    def attach(self, transport: EpTransport) -> None:
        """Move this model to ``transport``, after the same setup agreement as construction.

        Collective over ``transport``'s group.  On any error the model keeps its
        current transport.

        Raises:
            EpSetupError: the ranks of ``transport`` disagree with this model.
            EpLinkError: the setup exchange failed.
        """
        self._agree_on_setup(transport)
        self._bind(transport)

    @contextlib.contextmanager
    def attached(self, transport: EpTransport) -> Iterator[None]:
        """Within the ``with`` block, speak over ``transport``; then return to the current one.

        Entering runs the setup agreement over ``transport`` (as :meth:`attach`);
        leaving restores the transport the model had, which agreed already, without
        any exchange.  For feeding a worker recorded traffic
        (:meth:`metrale_model_engine.testing.RecordingEp.replay`).
        """
        previous = self._transport, self._rank, self._world_size, self._broadcast_frame
        self.attach(transport)
        try:
            yield
        finally:
            self._transport, self._rank, self._world_size, self._broadcast_frame = previous
            self._header_waiting = False
            self._last_failed = False

    def _agree_on_setup(self, transport: EpTransport) -> None:
        """Run the setup exchange over ``transport``; raise unless every rank agrees."""
        rank = transport.rank
        mine = [WIRE_VERSION, self._protocol.code, int(self._v1_slot), self._num_slots]
        try:
            everyone = transport.gather(mine)
        except Exception as error:
            raise EpReceiveError(f"rank {rank}: setup exchange failed: {error}") from error
        fields: tuple[tuple[str, Callable[[int], str]], ...] = (
            ("wire version", str),
            ("protocol", lambda code: f"v{code}"),
            ("v1_slot option", lambda flag: str(bool(flag))),
            ("slot count", str),
        )
        for field, (name, shown) in enumerate(fields):
            values = [words[field] for words in everyone]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(values))
                raise EpSetupError(
                    f"rank {rank}: the ranks disagree on the {name} ({per_rank}); every rank must use the same value"
                )

    def _bind(self, transport: EpTransport) -> None:
        broadcast_frame = transport.bind(self._frame)
        self._transport = transport
        self._rank = transport.rank
        self._world_size = transport.world_size
        self._broadcast_frame = broadcast_frame
        self._header_waiting = False
        self._last_failed = False

    # -- what every rank can ask -------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank; 0 is the head."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks, head included."""
        return self._world_size

    @property
    def transport(self) -> EpTransport:
        """The transport this model speaks over (see :meth:`attach`)."""
        return self._transport

    @property
    def num_slots(self) -> int:
        """The slot count all ranks agreed on (``--max-batch-size``)."""
        return self._num_slots

    @property
    def protocol(self) -> EpProtocol:
        """The protocol version all ranks agreed on."""
        return self._protocol

    @property
    def workers_shut_down(self) -> bool:
        """Whether the head has sent the shutdown header (:meth:`ep_shutdown_workers`)."""
        return self._shut_down

    @property
    def carries_seq_id(self) -> bool:
        """Whether headers carry ``seq_id``: always under v2, under v1 with ``v1_slot``."""
        return self._v1_slot or self._protocol is EpProtocol.V2

    def is_ep(self) -> bool:
        """``True`` exactly when the group has more than one rank."""
        return self._world_size > 1

    def ep_protocol_v2(self) -> bool:
        """``True`` when the protocol is v2 (``seq_id`` in every header)."""
        return self._protocol is EpProtocol.V2

    # -- head ----------------------------------------------------------------

    def ep_broadcast_cmd(self, cmd: int) -> None:
        """Head: send one u32 follow-up word of the command in flight to every worker.

        Workers read it with :meth:`ep_recv_word`.  On a one-rank group nothing is
        sent.

        Raises:
            TypeError, ValueError: ``cmd`` is not a u32 word (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the broadcast failed (a worker gone, a timeout).
        """
        if type(cmd) is not int or cmd >> 32:
            cmd = check_u32("cmd", cmd)
        self._require_head("ep_broadcast_cmd")
        frame = self._frame
        frame[0] = FrameKind.WORD
        frame[1] = cmd
        frame[2] = 0
        self._send(self._broadcast_frame)

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        """Head: send the header that starts command ``cmd`` for ``seq_id``, in one broadcast.

        ``seq_id`` reaches the workers under v2, and under v1 unless ``v1_slot`` is
        off (then they see 0).  The shutdown word is reserved for
        :meth:`ep_shutdown_workers`.

        Raises:
            TypeError, ValueError: a word is not a u32, ``seq_id >= num_slots``, or
                ``cmd`` is the shutdown word (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the broadcast failed.
        """
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
                f"cmd={CMD_SHUTDOWN:#x} is the reserved shutdown word; call ep_shutdown_workers() to stop the workers"
            )
        self._require_head("ep_broadcast_cmd_for_seq")
        self._send_header(seq_id if self.carries_seq_id else 0, cmd)

    def ep_broadcast_tokens(self, tokens: TokenArray) -> list[int]:
        """Send a u32 token array from the head to every worker.

        Head: ``tokens`` is checked and converted once, before anything is sent, and
        is returned (the same object when it is a list).  Worker: same as
        :meth:`ep_recv_tokens` with ``len(tokens)`` (the values are ignored).  Up to
        :data:`~metrale_model_engine._frame.INLINE_TOKENS` tokens travel in one
        broadcast, longer arrays in two (their count, then the tokens).

        Raises:
            TypeError, ValueError: a head token is not a u32 (nothing is sent).
            EpMismatchError: on a worker, see :meth:`ep_recv_tokens`.
            EpSendError / EpReceiveError: the broadcast failed.
        """
        if self._rank != 0:
            return self.ep_recv_tokens(token_count(tokens))
        buffer = as_u32_buffer("tokens", tokens)
        self._send_tokens(buffer)
        if isinstance(tokens, list):
            return tokens
        return memoryview(buffer).tolist()

    def ep_broadcast_tokens_into(self, tokens: TokenArray) -> None:
        """Like :meth:`ep_broadcast_tokens`, without building a list on either side.

        Head: ``tokens`` (any token array) is checked and sent.  Worker: same as
        :meth:`ep_recv_tokens_into`.

        Raises:
            TypeError, ValueError: a head token is not a u32 (nothing is sent).
            EpMismatchError: on a worker, see :meth:`ep_recv_tokens_into`.
            EpSendError / EpReceiveError: the broadcast failed.
        """
        if self._rank != 0:
            self._receive_tokens_into("ep_broadcast_tokens_into", writable_u32_buffer("tokens", tokens))
        else:
            self._send_tokens(as_u32_buffer("tokens", tokens))

    def ep_shutdown_workers(self) -> None:
        """Head: send the shutdown header; every worker's loop then ends.

        Idempotent: later calls send nothing.  After it, other sends raise
        :class:`EpSendError`.

        Raises:
            EpRoleError: called on a worker.
            EpSendError: the broadcast failed.
        """
        self._require_head("ep_shutdown_workers")
        if not self._shut_down:
            self._send_header(0, CMD_SHUTDOWN)
            self._shut_down = True

    def _send_header(self, seq_id: int, cmd: int) -> None:
        frame = self._frame
        frame[0] = FrameKind.HEADER
        frame[1] = cmd
        frame[2] = seq_id
        self._send(self._broadcast_frame)

    def _send_tokens(self, buffer: Buffer) -> None:
        if self._world_size == 1:
            return
        count = token_count(buffer)
        frame = self._frame
        frame[0] = FrameKind.TOKENS
        frame[1] = count
        if count > INLINE_TOKENS:
            frame[2] = 0
            self._send(self._broadcast_frame)
            self._send(self._transport.bind(buffer))
            return
        memoryview(frame)[2 : 2 + count] = memoryview(buffer)
        try:
            self._send(self._broadcast_frame)
        finally:
            frame[2:] = _BLANK  # words past 2 stay 0 for the other frames

    def _send(self, broadcast: Broadcast) -> None:
        if self._world_size == 1:
            return
        if self._shut_down:
            raise EpSendError("the workers were shut down (ep_shutdown_workers); nothing more can be sent")
        try:
            broadcast(self._command_timeout)
        except Exception as error:
            raise EpSendError(f"head: broadcast to the workers failed: {error}") from error

    def _require_head(self, method: str) -> None:
        if self._rank != 0:
            raise EpRoleError(f"{method}() sends from the head; this is worker rank {self._rank}")

    # -- worker --------------------------------------------------------------

    def ep_worker_step(self, slots: MutableSequence[S | None]) -> bool:
        """Worker: receive one header and run its command through :meth:`ep_run_command`.

        Waits for the header without the command timeout (an idle server is not a
        failure).  Returns ``False`` on the shutdown word.  Follow-ups that a failed
        command left unread are skipped on the way to the header.

        Raises:
            EpReceiveError: a receive failed (head gone, timeout, a corrupt frame);
                the worker must exit.
            EpCommandFailed: the header arrived and the command failed
                (``seq_id >= len(slots)``, an unknown command, a follow-up other
                than the head sent, an error in the command); the worker stays in
                step for the next command.  Also raised, once, when a command that
                succeeded left follow-ups unread (a model bug): they are skipped,
                and the header behind them runs at the next step.
            EpRoleError: called on the head.
        """
        if self._rank == 0:
            raise EpRoleError("ep_worker_step() runs on worker ranks; this is the head (rank 0)")
        skipped = self._receive_header()
        frame = self._frame
        cmd, seq_id = frame[1], frame[2]
        if skipped and not self._last_failed:
            self._header_waiting = True
            before_seq, before_cmd = self._command
            raise EpCommandFailed(
                EpMismatchError(
                    f"worker rank {self._rank}: command {before_cmd} (seq_id={before_seq}) "
                    f"left {skipped} unread; they were skipped"
                )
            )
        if cmd == CMD_SHUTDOWN:
            return False
        self._command = (seq_id, cmd)
        self._last_failed = True  # until the command returns
        try:
            check_slot(seq_id, slots)
            self.ep_run_command(seq_id, cmd, slots)
        except (EpLinkError, EpCommandFailed):
            raise
        except Exception as error:
            raise EpCommandFailed(error) from error
        self._last_failed = False
        return True

    def ep_recv_word(self) -> int:
        """Worker: receive the next follow-up word the head sent with :meth:`ep_broadcast_cmd`.

        Bounded by ``command_timeout``.

        Raises:
            EpMismatchError: the head sent something else (a token array, or the
                next command's header, which then runs at the next step).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        kind = self._receive_follow_up("ep_recv_word")
        if kind is not FrameKind.WORD:
            self._mismatch("a follow-up word", kind)
        return self._frame[1]

    def ep_recv_cmd(self) -> int:
        """Worker: the former name of :meth:`ep_recv_word`, kept working."""
        return self.ep_recv_word()

    def ep_recv_tokens(self, count: int | None = None) -> list[int]:
        """Worker: receive the token array the head sent with :meth:`ep_broadcast_tokens`.

        Its length travels with it; pass ``count`` to require one.  Bounded by
        ``command_timeout``.

        Raises:
            TypeError, ValueError: ``count`` is not ``None`` or an int ``>= 0``
                (nothing is received).
            EpMismatchError: the head sent something else, or ``count`` tokens were
                expected and another number came (the message names both; the
                tokens are consumed).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        if count is not None and (type(count) is not int or count < 0):
            _bad_argument("count", count, "None or an int >= 0", int)
        sent = self._receive_token_count("ep_recv_tokens", count)
        if sent <= INLINE_TOKENS:
            return self._frame[2 : 2 + sent].tolist()
        received = array(U32_TYPECODE, bytes(4 * sent))
        self._receive_bulk(received)
        return received.tolist()

    def ep_recv_tokens_into(self, buffer: Buffer | ArrayInterface) -> None:
        """Worker: receive the head's token array into ``buffer``, in place.

        ``buffer`` must be a writable, C-contiguous, 1-D u32 buffer
        (``array('I')``, numpy ``uint32``) of the head's length.  For workers that
        feed the tokens to a tensor rather than to Python code.

        Raises:
            TypeError: ``buffer`` is not a u32 buffer (a non-native byte order
                included); ValueError: not writable, 1-D and contiguous (nothing is
                received in either case).
            EpMismatchError: the head sent something else, or a token array of
                another length (the message names both; it is consumed).
            EpReceiveError: the receive failed.
            EpRoleError: called on the head.
        """
        self._receive_tokens_into("ep_recv_tokens_into", writable_u32_buffer("buffer", buffer))

    def _receive_tokens_into(self, method: str, view: memoryview) -> None:
        sent = self._receive_token_count(method, len(view))
        if sent <= INLINE_TOKENS:
            view[:] = memoryview(self._frame)[2 : 2 + sent]
        else:
            self._receive_bulk(view)

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[S | None]) -> None:
        """Worker hook: run command ``cmd`` in ``slots[seq_id]`` (override it).

        Called by :meth:`ep_worker_step` once the header arrived and ``seq_id`` is
        known to be in range.  Read the command's follow-ups
        (:meth:`ep_recv_word`, :meth:`ep_recv_tokens`) before anything that may
        fail: the library skips what a failed command left unread, but state the
        command changed before failing stays changed.  Any exception it raises
        becomes :class:`EpCommandFailed`, except a receive failure, which stays
        untagged.

        Default: every command is unknown (``ValueError``).
        """
        raise ValueError(f"unknown command word {cmd} (seq_id={seq_id}) for {type(self).__name__}")

    def _receive_header(self) -> str:
        """Receive up to the next header, skipping follow-ups; describe what was skipped."""
        skipped: list[str] = []
        while True:
            if self._header_waiting:
                self._header_waiting = False
                kind = FrameKind.HEADER
            else:
                kind = self._receive_frame(None)
            if kind is FrameKind.HEADER:
                return ", ".join(skipped)
            skipped.append(self._consume(kind))

    def _receive_follow_up(self, method: str) -> FrameKind:
        if self._rank == 0:
            raise EpRoleError(f"{method}() receives on worker ranks; this is the head (rank 0)")
        if self._header_waiting:
            return FrameKind.HEADER
        return self._receive_frame(self._command_timeout)

    def _receive_token_count(self, method: str, expected: int | None) -> int:
        """Receive a token frame; return its count, or consume it and raise if not ``expected``."""
        kind = self._receive_follow_up(method)
        wanted = "a token array" if expected is None else f"a token array of {expected} tokens"
        if kind is not FrameKind.TOKENS:
            self._mismatch(wanted, kind)
        sent = self._frame[1]
        if expected is not None and sent != expected:
            self._mismatch(wanted, kind)
        return sent

    def _receive_frame(self, timeout: float | None) -> FrameKind:
        self._receive(self._broadcast_frame, timeout)
        kind = _KINDS.get(self._frame[0])
        if kind is None:
            raise EpReceiveError(
                f"worker rank {self._rank}: received a corrupt frame (first word {self._frame[0]:#x}); "
                "the link is out of step"
            )
        return kind

    def _consume(self, kind: FrameKind) -> str:
        """Finish receiving the frame of ``kind`` just read (its payload too); describe it."""
        frame = self._frame
        if kind is FrameKind.HEADER:
            self._header_waiting = True  # the next step runs it
            return f"the next command's header (cmd={frame[1]}, seq_id={frame[2]})"
        if kind is FrameKind.WORD:
            return f"a follow-up word ({frame[1]})"
        count = frame[1]
        if count > INLINE_TOKENS:
            self._receive_bulk(array(U32_TYPECODE, bytes(4 * count)))  # drained
        return f"a token array of {count} tokens"

    def _receive_bulk(self, buffer: Buffer) -> None:
        """Receive the bulk broadcast that follows a token frame, into ``buffer`` of its count."""
        self._receive(self._transport.bind(buffer), self._command_timeout)

    def _mismatch(self, expected: str, kind: FrameKind) -> NoReturn:
        sent = self._consume(kind)
        raise EpMismatchError(f"worker rank {self._rank} expected {expected}, but the head sent {sent}")

    def _receive(self, broadcast: Broadcast, timeout: float | None) -> None:
        try:
            broadcast(timeout)
        except Exception as error:
            raise EpReceiveError(f"worker rank {self._rank}: receive from the head failed: {error}") from error


def check_slot(seq_id: int, slots: Sized) -> None:
    """Raise ``IndexError`` unless ``seq_id`` indexes ``slots`` (``0 <= seq_id < len(slots)``).

    The worker-side bound of every command, checked by :meth:`WireEp.ep_worker_step`
    before the model's hook runs.
    """
    if not 0 <= seq_id < len(slots):
        raise IndexError(f"seq_id={seq_id} is out of range for {len(slots)} slots")


def _bad_argument(name: str, value: object, expected: str, kind: type) -> NoReturn:
    """Raise ``TypeError`` when ``value`` is not of ``kind`` (``bool`` is no number), else ``ValueError``."""
    numeric = kind in (int, float)
    right_type = isinstance(value, (int, float) if kind is float else kind) and not (
        numeric and isinstance(value, bool)
    )
    error = ValueError if right_type else TypeError
    raise error(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
