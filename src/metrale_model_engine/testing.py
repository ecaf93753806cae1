"""Test doubles: assert what a scheduler sends, and replay it into a worker, without processes.

* [`RecordingEp`][metrale_model_engine.testing.RecordingEp]: a head model (rank 0 of a pretend group) whose link sends
  over a [`RecordingTransport`][metrale_model_engine.testing.RecordingTransport]; its
  [`events`][metrale_model_engine.testing.RecordingEp.events] are the items read back from the recorded wire, and
  [`RecordingEp.replay`][metrale_model_engine.testing.RecordingEp.replay] feeds that wire to a worker-side model under
  [`run_worker`][metrale_model_engine.run_worker].
* [`RecordingTransport`][metrale_model_engine.testing.RecordingTransport] and
[`ReplayTransport`][metrale_model_engine.testing.ReplayTransport]: the in-memory
  transports underneath, for running any model's head and worker sides in one
  process.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Literal

from typing_extensions import Buffer

from ._core.codec import Ack, Item, ItemKind, decode_item, encode_ack, encode_header
from ._core.digest import fold_message
from ._core.errors import EpDivergenceError, describe_command
from ._core.namespace import PublicDir, public_dir
from ._core.protocol import ProtocolVersion
from ._core.state import S
from ._core.transport import HeadEnd, TransportClosed, WorkerEnd
from ._core.words import CMD_SHUTDOWN, U32_TYPECODE
from ._engine.forward import collectives_counted_by
from ._engine.link import EpLink, command_in_flight
from ._trait.linked_ep import LinkedEp
from ._trait.model_ep import ModelEp
from ._trait.worker_loop import WorkerSummary, run_worker

__all__ = ["EpEvent", "EventKind", "RecordingEp", "RecordingTransport", "ReplayTransport"]
__dir__: PublicDir = public_dir(globals(), __all__)

EventKind = Literal["cmd", "cmd_for_seq", "tokens", "sync", "shutdown", "close"]


@dataclass(frozen=True)
class EpEvent:
    """One item the head sent: its kind and its u32 arguments.

    ``cmd_for_seq``: ``(seq_id, cmd)`` (a header); ``cmd``: ``(word,)`` (a follow-up
    word); ``tokens``: the tokens; ``sync``: ``(number,)`` (a sync point, which
    ``shutdown_workers`` runs first); ``shutdown`` and ``close``: ``()``.
    """

    kind: EventKind
    args: tuple[int, ...]


Message = tuple[int, ...]
"""One message as its u32 words."""
_FOLLOW_UPS = (ItemKind.WORD, ItemKind.TOKENS)


def _items(words: memoryview) -> Iterator[Item]:
    """The items of one message (its u32 words), in order."""
    at = 0
    while at < len(words):
        item = decode_item(words, at)
        at = item.end
        yield item


class RecordingTransport(HeadEnd):
    """The head (rank 0) of a pretend group of ``world_size`` ranks: keeps every message it is given.

    Give it to an [`EpLink`][metrale_model_engine.EpLink] to run a head without
    processes; [`messages`][metrale_model_engine.testing.RecordingTransport.messages] is then exactly what went on the
    wire.  The setup exchange sees every rank agree, and the pretend workers answer every sync point
    as workers in step would (the same commands and stream, the head's own state
    digest; no failures).  It is a [`PretendGroup`][metrale_model_engine.transport.PretendGroup]:
    a model's collectives over it have one participant.  (A replay compares a real
    worker's state with the head's after every command:
    [`RecordingEp.record_digests`][metrale_model_engine.testing.RecordingEp.record_digests].)
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.messages: list[Message] = []
        """Every message sent, oldest first, as its words."""
        self.setup: list[int] | None = None
        """The words the link sent in its setup exchange (``None`` until then)."""
        self.closed: bool = False
        """Whether [`close`][metrale_model_engine.testing.RecordingTransport.close] ran."""
        self.digests: dict[int, int] = {}
        """The head's state digest after each command, by the command's count from 1 (see ``digest_of_state``)."""
        self.digest_of_state: Callable[[], int] | None = None
        """The head's state digest, taken, when set, as each message that does not continue a command is
        recorded: the state after the last command, kept in
            [`digests`][metrale_model_engine.testing.RecordingTransport.digests]."""
        self._crc = 0
        self._commands = 0
        self._state: int | None = None  # the head's state digest at the last sync point

    def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        """Record the message (and the head's state digest before it, when it starts a command or a sync point)."""
        message = b"".join(parts)
        self._crc = fold_message(self._crc, (message,))
        words = memoryview(message).cast(U32_TYPECODE)
        if words and self.digest_of_state is not None and decode_item(words, 0).kind not in _FOLLOW_UPS:
            self.take_digest()
        self.messages.append(tuple(words.tolist()))
        self._commands += sum(item.starts_command and item.first != CMD_SHUTDOWN for item in _items(words))

    def take_digest(self) -> None:
        """Keep the head's state digest (``digest_of_state``) as the state after the last command, if any."""
        if self._commands and self.digest_of_state is not None:
            self.digests[self._commands] = self.digest_of_state()

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """Record the setup words (the first gather); every rank agrees."""
        if self.setup is None:
            self.setup = list(words)
        return [list(words)] * self.world_size

    def receive_answers(self, rank: int, timeout: float | None) -> list[bytes]:
        """Worker ``rank``'s acknowledgement of the last sync point, as a worker in step would send it."""
        last = memoryview(array(U32_TYPECODE, self.messages[-1]))
        item = decode_item(last, 0)
        if item.kind is not ItemKind.SYNC:
            raise TransportClosed("the pretend workers answer only sync points")
        return [encode_ack(Ack(item.first, self._crc, self._commands, 0, self._state))]

    def pretend_state(self, digest: int | None) -> None:
        """The head's own state digest at the sync point being sent, which its pretend workers answer."""
        self._state = digest

    def close(self) -> None:
        """Mark it closed (it holds nothing)."""
        self.closed = True


class ReplayTransport(WorkerEnd):
    """A worker (rank 1) of a pretend two-rank group: receives ``messages`` in order, then ``EOFError``.

    Args:
        messages: what the head sent, one sequence of words per message.
        setup: the head's words of the setup exchange, which the worker's are
            checked against (a [`RecordingTransport`][metrale_model_engine.testing.RecordingTransport]'s ``setup``);
            ``None``: the head agrees with whatever the worker sends.  A worker-side model
            built on ``ReplayTransport(())`` needs no process group: it is a
            [`PretendGroup`][metrale_model_engine.transport.PretendGroup], over which a
            model's collectives (``Collectives``) have one participant.
    """

    rank = 1
    world_size = 2

    def __init__(self, messages: Sequence[Sequence[int]], *, setup: Sequence[int] | None = None) -> None:
        self._pending: Iterator[Sequence[int]] = iter(messages)
        self._setup = None if setup is None else list(setup)
        self.answers: list[bytes] = []
        """What the worker answered (failure reports, sync acknowledgements), oldest first."""

    def receive(self, timeout: float | None) -> memoryview:
        """The next recorded message; ``EOFError`` past the last."""
        message = next(self._pending, None)
        if message is None:
            raise EOFError("the recording has no more messages")
        return memoryview(array(U32_TYPECODE, message).tobytes())

    def gather(self, words: Sequence[int], timeout: float | None = None) -> list[list[int]]:
        """The recorded head's setup words (or this rank's own), then this rank's."""
        head = list(words) if self._setup is None or len(words) != len(self._setup) else self._setup
        return [head, list(words)]

    def answer(self, answer: Buffer, timeout: float | None) -> None:
        """Keep the answer in [`answers`][metrale_model_engine.testing.ReplayTransport.answers]."""
        self.answers.append(bytes(memoryview(answer).cast("B")))

    def pretend_state(self, digest: int | None) -> None:
        """Nothing: a worker end is never told the head's state (a ``PretendGroup``'s head is)."""


class RecordingEp(LinkedEp[S]):
    """A head whose messages are recorded instead of sent: a scheduler's unit-test double.

    It is a [`LinkedEp`][metrale_model_engine.LinkedEp] whose link runs over a
    [`RecordingTransport`][metrale_model_engine.testing.RecordingTransport], so every call is checked as on a real head
    (u32 words, ``seq_id < num_slots``, token arrays) and only what passed reaches the
    recording.

    Args:
        is_ep: what [`is_ep`][metrale_model_engine.LinkedEp.is_ep] returns; with ``False`` it is a one-rank group:
            its [`wire`][metrale_model_engine.testing.RecordingEp.wire] stays empty, its
            [`events`][metrale_model_engine.testing.RecordingEp.events] are still recorded.
        protocol_v2: what [`ep_protocol_v2`][metrale_model_engine.LinkedEp.ep_protocol_v2] returns.
        num_slots: the slot count.
    """

    __slots__ = ("_recording", "ep_link")
    ep_link: EpLink

    def __init__(self, *, is_ep: bool = True, protocol_v2: bool = False, num_slots: int = 8) -> None:
        self._recording = RecordingTransport(world_size=2 if is_ep else 1)
        protocol = ProtocolVersion.V2 if protocol_v2 else ProtocolVersion.V1
        self.ep_link = EpLink(self._recording, num_slots=num_slots, protocol=protocol)

    def record_digests(self, slots: Sequence[S | None]) -> None:
        """Record the digest of the head's ``slots`` after every command, for ``replay`` to compare.

        With ``ep_link.state_digest`` (the function every rank sets).  The state after
        a command is taken as the head starts the next one (or a sync point, or the
        shutdown), and as the recording is replayed: as a head keeps its slots when
        it changes them once the command's broadcasts are sent.

        Raises:
            ValueError: ``ep_link.state_digest`` is not set.
        """
        digest = self.ep_link.state_digest
        if digest is None:
            raise ValueError("record_digests() needs ep_link.state_digest: set it on the head, as on every rank")
        self._recording.digest_of_state = lambda: digest(slots)

    @property
    def wire(self) -> list[Message]:
        """The messages that went on the (pretend) wire, as their words; none for a one-rank group."""
        return list(self._recording.messages) if self.is_ep() else []

    @property
    def events(self) -> list[EpEvent]:
        """The items the head sent, oldest first, read back from the recording."""
        events: list[EpEvent] = []
        for message in self._recording.messages:
            words = memoryview(array(U32_TYPECODE, message))
            for item in _items(words):
                if item.starts_command:
                    header = EpEvent("cmd_for_seq", (item.second, item.first))
                    events.append(EpEvent("shutdown", ()) if item.first == CMD_SHUTDOWN else header)
                elif item.kind is ItemKind.WORD:
                    events.append(EpEvent("cmd", (item.first,)))
                elif item.kind is ItemKind.TOKENS:
                    events.append(EpEvent("tokens", tuple(words[item.second : item.end].tolist())))
                elif item.kind is ItemKind.SYNC:
                    events.append(EpEvent("sync", (item.first,)))
                else:
                    events.append(EpEvent("close", ()))
        return events

    def replay(
        self,
        worker: LinkedEp[S],
        slots: MutableSequence[S | None],
        *,
        logger: logging.Logger | None = None,
    ) -> WorkerSummary:
        """Feed the recorded wire to ``worker`` as worker rank 1, under [`run_worker`][metrale_model_engine.run_worker].

        For the replay the worker speaks over a new link with its own link's
        settings (and ``state_digest``), which first runs the setup agreement
        against the recording's: the worker must use the same protocol,
        ``seq_id_on_wire`` and slot count.  Its own link is back in place afterwards;
        meanwhile it stands in for the replay's where the model kept it (a
        ``Collectives`` built on it checks and counts the replay's collectives, with
        this process as their one participant).  A shutdown header ends the replay
        (one is added if none was recorded).  The recording can be replayed again.

        After [`record_digests`][metrale_model_engine.testing.RecordingEp.record_digests], the worker's state digest is
        compared with the head's after every command: the first command after which they differ
        raises [`EpDivergenceError`][metrale_model_engine.EpDivergenceError], naming it (a prompt
        fed twice is caught at the command that fed it, not passed because a later
        command closed it).

        Raises:
            EpSetupError: ``worker`` disagrees with the recording.
            ValueError: this recorder is not multi-rank (``is_ep=False``).
            EpReceiveError: the worker read more than was sent.
            EpDivergenceError: the worker's state after a command differs from the head's.
        """
        if not self.is_ep():
            raise ValueError("replay() needs a recording made with is_ep=True; nothing went on the wire")
        messages: list[Sequence[int]] = list(self._recording.messages)
        if not self.ep_link.workers_shut_down:
            messages.append(memoryview(encode_header(0, CMD_SHUTDOWN)).cast(U32_TYPECODE).tolist())
        self._recording.take_digest()  # the state after the last command: nothing recorded follows it
        own = worker.ep_link
        replay = ReplayTransport(messages, setup=self._recording.setup)
        link = EpLink(
            replay,
            num_slots=own.num_slots,
            protocol=own.protocol,
            seq_id_on_wire=own.seq_id_on_wire,
            command_timeout=own.command_timeout,
        )
        link.state_digest = own.state_digest
        compared = _Compared(worker, link, dict(self._recording.digests))
        # The attribute lives in the subclass (a slot, or the instance dict of an nn.Module),
        # which the type LinkedEp cannot name: setattr keeps that the subclass's business.
        setattr(worker, "ep_link", link)  # noqa: B010
        try:
            with collectives_counted_by(own, link):
                return run_worker(compared, slots, logger=logger)
        finally:
            setattr(worker, "ep_link", own)  # noqa: B010


class _Compared(ModelEp[S]):
    """A replayed worker whose state digest is compared with the head's after every command it runs."""

    __slots__ = ("_digests", "_link", "_worker")

    def __init__(self, worker: LinkedEp[S], link: EpLink, digests: dict[int, int]) -> None:
        self._worker = worker
        self._link = link
        self._digests = digests

    def is_ep(self) -> bool:
        return True

    def ep_worker_step(self, slots: MutableSequence[S | None]) -> bool:
        ran = self._link.commands
        try:
            return self._worker.ep_worker_step(slots)
        finally:
            if self._link.commands != ran:
                self._compare(slots)

    def _compare(self, slots: MutableSequence[S | None]) -> None:
        """Raise when the worker's state after this command differs from the head's (a step that failed too)."""
        link = self._link
        head = self._digests.get(link.commands)
        if head is None or link.state_digest is None:
            return
        mine = link.state_digest(slots)
        if mine != head:
            where = describe_command(link.commands, *command_in_flight(link))
            raise EpDivergenceError(
                f"replay: after {where}, worker rank 1's state digest is {mine:#018x}, the head's {head:#018x}: "
                "the worker diverged in that command",
                [1],
            )
