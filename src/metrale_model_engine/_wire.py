"""``WireEp``: the whole head/worker protocol over an :class:`EpTransport`."""

from __future__ import annotations

import math
from array import array
from collections.abc import MutableSequence, Sized
from typing import Final, NoReturn

from typing_extensions import Buffer

from ._errors import (
    EpCommandFailed,
    EpLinkError,
    EpReceiveError,
    EpRoleError,
    EpSendError,
    EpSetupError,
)
from ._model import ModelEp, S, TokenArray
from ._protocol import EpProtocol
from ._tokens import U32_TYPECODE, as_u32_buffer, token_count, writable_u32_buffer
from ._transport import Broadcast, EpTransport
from ._words import CMD_SHUTDOWN, U32_MAX, check_u32

WIRE_VERSION: Final[int] = 1
"""Version of this library's wire format; every rank must run the same one."""

DEFAULT_COMMAND_TIMEOUT: Final[float] = 60.0
"""Seconds a worker waits for a follow-up word or payload of a command in flight."""


class WireEp(ModelEp[S]):
    """A :class:`ModelEp` that speaks the protocol over a transport.

    The model subclass inherits every trait method and overrides one hook,
    :meth:`ep_run_command`, which runs a command on a worker; the head side of a
    command is plain calls to the broadcast methods.  A backend subclass (such as
    ``metrale_model_engine.torch.TorchEp``) builds the transport.

    Construction is collective: every rank of the transport's group must construct
    its model at the same point, and all confirm that they agree on the protocol
    version, the slot count and :data:`WIRE_VERSION`; a mismatch raises
    :class:`EpSetupError` on every rank.

    Args:
        transport: the group of ranks to speak over.
        num_slots: the slot count, ``--max-batch-size``; a header's ``seq_id`` must
            be below it (checked on the head before sending).
        protocol: the header layout; default :meth:`EpProtocol.from_env`.
        command_timeout: seconds a worker waits for the follow-up words and
            payloads of a command in flight, and the head for a broadcast to
            complete (``None``: the group's own timeout).  The wait for the next
            header is not bounded by it: an idle worker waits as long as the group
            timeout allows.

    Raises:
        TypeError, ValueError: an argument has the wrong type or value.
        EpSetupError: the ranks disagree.
        EpLinkError: the setup exchange itself failed.
    """

    def __init__(
        self,
        transport: EpTransport,
        *,
        num_slots: int,
        protocol: EpProtocol | None = None,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        super().__init__()
        if type(num_slots) is not int or not 1 <= num_slots <= U32_MAX:
            _bad_argument("num_slots", num_slots, f"an int in 1 ..= {U32_MAX}")
        if protocol is None:
            protocol = EpProtocol.from_env()
        elif not isinstance(protocol, EpProtocol):
            _bad_argument("protocol", protocol, "an EpProtocol (V1 or V2)")
        if command_timeout is not None and not (
            isinstance(command_timeout, (int, float))
            and not isinstance(command_timeout, bool)
            and 0 < command_timeout < math.inf
        ):
            _bad_argument("command_timeout", command_timeout, "a positive number of seconds or None")
        self._num_slots = num_slots
        self._protocol = protocol
        self._command_timeout = None if command_timeout is None else float(command_timeout)
        self._shut_down = False
        self._attach(transport)
        self._agree_on_setup()

    # -- setup ---------------------------------------------------------------

    def _attach(self, transport: EpTransport) -> None:
        """Bind this model's fixed buffers to ``transport``."""
        self._transport = transport
        self._rank = transport.rank
        self._world_size = transport.world_size
        self._header = array(U32_TYPECODE, bytes(4 * self._protocol.header_words))
        self._word = array(U32_TYPECODE, b"\0\0\0\0")
        self._broadcast_header = transport.bind(self._header)
        self._broadcast_word = transport.bind(self._word)

    def _agree_on_setup(self) -> None:
        mine = [WIRE_VERSION, self._protocol.header_words, self._num_slots]
        try:
            everyone = self._transport.gather(mine)
        except Exception as error:
            raise EpReceiveError(f"rank {self._rank}: setup exchange failed: {error}") from error
        # The protocol travels as its header length, which is its version number.
        fields: tuple[tuple[str, str], ...] = (("wire version", "{}"), ("protocol", "v{}"), ("slot count", "{}"))
        for field, (name, shown) in enumerate(fields):
            values = [words[field] for words in everyone]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"rank {r}: {shown.format(v)}" for r, v in enumerate(values))
                raise EpSetupError(
                    f"rank {self._rank}: the ranks disagree on the {name} ({per_rank}); "
                    "every rank must use the same value"
                )

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
    def num_slots(self) -> int:
        """The slot count all ranks agreed on (``--max-batch-size``)."""
        return self._num_slots

    @property
    def protocol(self) -> EpProtocol:
        """The protocol version all ranks agreed on."""
        return self._protocol

    def is_ep(self) -> bool:
        """``True`` exactly when the group has more than one rank."""
        return self._world_size > 1

    def ep_protocol_v2(self) -> bool:
        """``True`` when headers carry ``seq_id`` (protocol v2)."""
        return self._protocol is EpProtocol.V2

    # -- head ----------------------------------------------------------------

    def ep_broadcast_cmd(self, cmd: int) -> None:
        """Head: send one u32 word to every worker (a follow-up word of a command).

        Workers read it with :meth:`ep_recv_cmd`.  On a one-rank group nothing is
        sent.

        Raises:
            TypeError, ValueError: ``cmd`` is not a u32 word (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the broadcast failed (a worker gone, a timeout).
        """
        if type(cmd) is not int or cmd >> 32:
            cmd = check_u32("cmd", cmd)
        self._require_head("ep_broadcast_cmd")
        self._word[0] = cmd
        self._send(self._broadcast_word)

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        """Head: send the header of a command for ``seq_id``, in one broadcast.

        The wire carries ``[cmd]`` under v1 and ``[seq_id, cmd]`` under v2.

        Raises:
            TypeError, ValueError: a word is not a u32, or ``seq_id >= num_slots``
                (nothing is sent).
            EpRoleError: called on a worker.
            EpSendError: the broadcast failed.
        """
        if type(seq_id) is not int or seq_id >> 32:
            seq_id = check_u32("seq_id", seq_id)
        if type(cmd) is not int or cmd >> 32:
            cmd = check_u32("cmd", cmd)
        if seq_id >= self._num_slots:
            raise ValueError(
                f"seq_id={seq_id} is out of range for {self._num_slots} slots "
                f"(0 ..= {self._num_slots - 1})"
            )
        self._require_head("ep_broadcast_cmd_for_seq")
        self._send_header(seq_id, cmd)

    def ep_broadcast_tokens(self, tokens: TokenArray) -> list[int]:
        """Send a u32 token array from the head to every worker, in one broadcast.

        Head: ``tokens`` is checked and converted once, before anything is sent, and
        is returned (the same object when it is a list).  Worker: ``tokens`` is a
        placeholder of the head's length (its values are ignored); returns the
        head's values.  The worker's wait is bounded by ``command_timeout``.

        Raises:
            TypeError, ValueError: a head token is not a u32 (nothing is sent).
            EpSendError / EpReceiveError: the broadcast failed.
        """
        if self._rank != 0:
            received = array(U32_TYPECODE, bytes(4 * token_count(tokens)))
            self._receive_tokens(received)
            return received.tolist()
        buffer = as_u32_buffer("tokens", tokens)
        self._send_tokens(buffer)
        if isinstance(tokens, list):
            return tokens
        return memoryview(buffer).tolist()

    def ep_broadcast_tokens_into(self, tokens: Buffer) -> None:
        """Like :meth:`ep_broadcast_tokens`, but buffer to buffer: no list on either side.

        Head: ``tokens`` (any token array that exposes a buffer, or a sequence) is
        checked and sent in one broadcast.  Worker: ``tokens`` must be a writable,
        C-contiguous, 1-D u32 buffer (``array('I')``, numpy ``uint32``) of the
        head's length; it is overwritten in place with the head's values.  For
        workers that feed the tokens to a tensor rather than to Python code.

        Raises:
            TypeError, ValueError: a head token is not a u32, or a worker buffer is
                not a writable 1-D u32 buffer (nothing is sent or received).
            EpSendError / EpReceiveError: the broadcast failed.
        """
        if self._rank != 0:
            self._receive_tokens(writable_u32_buffer("tokens", tokens))
        else:
            self._send_tokens(as_u32_buffer("tokens", tokens))

    def _send_tokens(self, buffer: Buffer) -> None:
        if self._world_size > 1 and token_count(buffer):  # an empty array is never sent
            self._send(self._transport.bind(buffer))

    def _receive_tokens(self, buffer: Buffer) -> None:
        if token_count(buffer):
            self._receive(self._transport.bind(buffer), self._command_timeout)

    def ep_shutdown_workers(self) -> None:
        """Head: send the shutdown header; every worker's loop then ends.

        Idempotent: later calls send nothing.  After it, other sends raise
        :class:`EpSendError`.
        """
        self._require_head("ep_shutdown_workers")
        if not self._shut_down:
            self._send_header(0, CMD_SHUTDOWN)
            self._shut_down = True

    def _send_header(self, seq_id: int, cmd: int) -> None:
        self._header[:] = array(U32_TYPECODE, self._protocol.encode_header(seq_id, cmd))
        self._send(self._broadcast_header)

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
        failure).  Returns ``False`` on the shutdown word (``seq_id`` ignored).
        Under v1 the command's ``seq_id`` is 0.

        Raises:
            EpReceiveError: the header or a follow-up could not be received; the
                worker must exit.
            EpCommandFailed: anything after the header arrived failed
                (``seq_id >= len(slots)``, an unknown command, an error in the
                command); the worker stays in step for the next command.
            EpRoleError: called on the head.
        """
        if self._rank == 0:
            raise EpRoleError("ep_worker_step() runs on worker ranks; this is the head (rank 0)")
        self._receive(self._broadcast_header, None)
        seq_id, cmd = self._protocol.decode_header(self._header)
        if cmd == CMD_SHUTDOWN:
            return False
        try:
            check_slot(seq_id, slots)
            self.ep_run_command(seq_id, cmd, slots)
        except (EpLinkError, EpCommandFailed):
            raise
        except Exception as error:
            raise EpCommandFailed(error) from error
        return True

    def ep_recv_cmd(self) -> int:
        """Worker: receive the next word the head sent with :meth:`ep_broadcast_cmd`.

        Bounded by ``command_timeout``.

        Raises:
            EpReceiveError: the word could not be received.
            EpRoleError: called on the head.
        """
        if self._rank == 0:
            raise EpRoleError("ep_recv_cmd() receives on worker ranks; this is the head (rank 0)")
        self._receive(self._broadcast_word, self._command_timeout)
        return self._word[0]

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[S | None]) -> None:
        """Worker hook: run command ``cmd`` in ``slots[seq_id]`` (override it).

        Called by :meth:`ep_worker_step` once the header arrived and ``seq_id`` is
        known to be in range.  Read every follow-up word and payload of the command
        (:meth:`ep_recv_cmd`, :meth:`ep_broadcast_tokens`) before anything that may
        fail, so that a failure leaves the worker in step with the head.  Any
        exception it raises becomes :class:`EpCommandFailed`, except a receive
        failure, which stays untagged.

        Default: every command is unknown (``ValueError``).
        """
        raise ValueError(f"unknown command word {cmd} (seq_id={seq_id}) for {type(self).__name__}")

    def _receive(self, broadcast: Broadcast, timeout: float | None) -> None:
        try:
            broadcast(timeout)
        except Exception as error:
            raise EpReceiveError(
                f"worker rank {self._rank}: receive from the head failed: {error}"
            ) from error


def check_slot(seq_id: int, slots: Sized) -> None:
    """Raise ``IndexError`` unless ``seq_id`` indexes ``slots`` (``0 <= seq_id < len(slots)``).

    The worker-side bound of every command; a v1 model that carries the slot in a
    follow-up word checks it with this too.
    """
    if not 0 <= seq_id < len(slots):
        raise IndexError(f"seq_id={seq_id} is out of range for {len(slots)} slots")


def _bad_argument(name: str, value: object, expected: str) -> NoReturn:
    kind = TypeError if not isinstance(value, (int, float)) or isinstance(value, bool) else ValueError
    raise kind(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
