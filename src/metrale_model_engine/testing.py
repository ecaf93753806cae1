"""Test doubles: assert what a scheduler broadcasts, and replay it into a worker.

* :class:`RecordingEp`: a head (rank 0) that goes through the same checks as a real
  backend but sends over no process; every broadcast call is recorded as an
  :class:`EpEvent`, and :meth:`RecordingEp.replay` feeds the words that would have
  gone on the wire to a worker-side model.
* :class:`RecordingTransport` and :class:`ReplayTransport`: the in-memory transports
  underneath, for running any ``WireEp`` model's head and worker sides in one
  process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Literal

from typing_extensions import Buffer

from ._errors import EpSetupError
from ._model import S, TokenArray
from ._protocol import EpProtocol
from ._tokens import as_u32_buffer
from ._transport import Broadcast
from ._wire import WireEp
from ._words import CMD_SHUTDOWN
from ._worker import WorkerSummary, run_worker

EventKind = Literal["cmd", "cmd_for_seq", "tokens", "shutdown"]


@dataclass(frozen=True)
class EpEvent:
    """One recorded head call: its kind and its u32 arguments.

    ``cmd``: ``(cmd,)``; ``cmd_for_seq``: ``(seq_id, cmd)``; ``tokens``: the tokens;
    ``shutdown``: ``()``.
    """

    kind: EventKind
    args: tuple[int, ...]


class RecordingTransport:
    """Rank 0 of a pretend group of ``world_size`` ranks: keeps each broadcast's words.

    Give it to any :class:`~metrale_model_engine.WireEp` model to run its head side
    without processes; :attr:`broadcasts` is then exactly what went on the wire, one
    tuple of words per broadcast.  The setup exchange sees every rank agree.
    """

    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.broadcasts: list[tuple[int, ...]] = []

    def bind(self, words: Buffer) -> Broadcast:
        view = memoryview(words)

        def broadcast(timeout: float | None) -> None:
            self.broadcasts.append(tuple(view.tolist()))

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        return [list(words)] * self.world_size


class ReplayTransport:
    """Rank 1 of a pretend two-rank group: receives ``broadcasts`` in order.

    Each receive must ask for exactly the length that was sent, else it fails
    (``ValueError``, which a model reports as a receive error: out of step).  Past
    the last broadcast a receive fails with ``EOFError``.
    """

    rank = 1
    world_size = 2

    def __init__(self, broadcasts: Sequence[tuple[int, ...]]) -> None:
        self._pending: Iterator[tuple[int, ...]] = iter(broadcasts)

    def bind(self, words: Buffer) -> Broadcast:
        view = memoryview(words)

        def broadcast(timeout: float | None) -> None:
            sent = next(self._pending, None)
            if sent is None:
                raise EOFError("the recording has no more broadcasts")
            if len(sent) != len(view):
                raise ValueError(
                    f"out of step with the head: the worker expects {len(view)} words, "
                    f"the head sent {len(sent)}"
                )
            for index, word in enumerate(sent):
                view[index] = word

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        return [list(words), list(words)]


class RecordingEp(WireEp[S]):
    """A head whose broadcasts are recorded instead of sent.

    Use it in a scheduler's unit tests to assert the exact command sequence.  It
    checks its inputs like a real backend (u32 words, ``seq_id < num_slots``, token
    arrays) and records a call only once it has passed them.

    Args:
        is_ep: what :meth:`is_ep` returns; with ``False`` it behaves like a one-rank
            group (calls are recorded, nothing is on the wire).
        protocol_v2: what :meth:`ep_protocol_v2` returns.
        num_slots: the slot count.
    """

    def __init__(self, *, is_ep: bool = True, protocol_v2: bool = False, num_slots: int = 8) -> None:
        self._recording = RecordingTransport(world_size=2 if is_ep else 1)
        self.events: list[EpEvent] = []
        """The recorded calls, oldest first."""
        super().__init__(
            self._recording,
            num_slots=num_slots,
            protocol=EpProtocol.V2 if protocol_v2 else EpProtocol.V1,
        )

    @property
    def wire(self) -> list[tuple[int, ...]]:
        """The broadcasts that went on the (pretend) wire, one tuple of words each."""
        return list(self._recording.broadcasts)

    def ep_broadcast_cmd(self, cmd: int) -> None:
        super().ep_broadcast_cmd(cmd)
        self.events.append(EpEvent("cmd", (int(cmd),)))

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        super().ep_broadcast_cmd_for_seq(seq_id, cmd)
        self.events.append(EpEvent("cmd_for_seq", (int(seq_id), int(cmd))))

    def ep_broadcast_tokens(self, tokens: TokenArray) -> list[int]:
        result = super().ep_broadcast_tokens(tokens)
        self.events.append(EpEvent("tokens", tuple(result)))
        return result

    def ep_broadcast_tokens_into(self, tokens: Buffer) -> None:
        buffer = as_u32_buffer("tokens", tokens)  # converted once, checked before recording
        super().ep_broadcast_tokens_into(buffer)
        self.events.append(EpEvent("tokens", tuple(memoryview(buffer).tolist())))

    def ep_shutdown_workers(self) -> None:
        if not self._shut_down:
            self.events.append(EpEvent("shutdown", ()))
        super().ep_shutdown_workers()

    def replay(
        self,
        worker: WireEp[S],
        slots: MutableSequence[S | None],
        *,
        logger: logging.Logger | None = None,
    ) -> WorkerSummary:
        """Feed the recorded wire to ``worker`` as worker rank 1, under :func:`run_worker`.

        A shutdown header ends the replay (one is added if none was recorded).
        ``worker`` keeps its own transport afterwards.  The recording can be
        replayed again.

        Raises:
            EpSetupError: ``worker`` has another protocol or slot count.
            ValueError: this recorder is not multi-rank (``is_ep=False``).
            EpReceiveError: the worker read more, or other lengths, than was sent.
        """
        if not self.is_ep():
            raise ValueError("replay() needs a recording made with is_ep=True; nothing went on the wire")
        if (worker.protocol, worker.num_slots) != (self.protocol, self.num_slots):
            raise EpSetupError(
                f"the worker ({worker.protocol.value}, {worker.num_slots} slots) does not match "
                f"the recording ({self.protocol.value}, {self.num_slots} slots)"
            )
        broadcasts = self.wire
        if not self._shut_down:
            broadcasts.append(self.protocol.encode_header(0, CMD_SHUTDOWN))
        own_transport = worker._transport
        worker._attach(ReplayTransport(broadcasts))
        try:
            return run_worker(worker, slots, logger=logger)
        finally:
            worker._attach(own_transport)
