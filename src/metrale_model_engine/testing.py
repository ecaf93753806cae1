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

from ._model import S
from ._protocol import EpProtocol
from ._state import SequenceState
from ._tokens import TokenArray, as_u32_buffer
from ._transport import Broadcast
from ._wire import WireEp
from ._worker import WorkerSummary, run_worker

__all__ = ["EpEvent", "EventKind", "RecordingEp", "RecordingTransport", "ReplayTransport"]

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
        self.setup: list[int] | None = None
        """The words the model sent in its setup exchange (``None`` until then)."""

    def bind(self, words: Buffer) -> Broadcast:
        view = memoryview(words)

        def broadcast(timeout: float | None) -> None:
            self.broadcasts.append(tuple(view.tolist()))

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        self.setup = list(words)
        return [list(words)] * self.world_size


class ReplayTransport:
    """Rank 1 of a pretend two-rank group: receives ``broadcasts`` in order.

    Each receive must ask for exactly the length that was sent, else it fails
    (``ValueError``, which a model reports as a receive error: out of step).  Past
    the last broadcast a receive fails with ``EOFError``.

    Args:
        broadcasts: what the head sent, one tuple of words per broadcast.
        setup: the head's words of the setup exchange, which the worker's are
            checked against (a :class:`RecordingTransport`'s ``setup``); ``None``:
            the head agrees with whatever the worker sends.  A worker-side model
            built on ``ReplayTransport(())`` needs no process group.
    """

    rank = 1
    world_size = 2

    def __init__(self, broadcasts: Sequence[tuple[int, ...]], *, setup: Sequence[int] | None = None) -> None:
        self._pending: Iterator[tuple[int, ...]] = iter(broadcasts)
        self._setup = None if setup is None else list(setup)

    def bind(self, words: Buffer) -> Broadcast:
        view = memoryview(words)

        def broadcast(timeout: float | None) -> None:
            sent = next(self._pending, None)
            if sent is None:
                raise EOFError("the recording has no more broadcasts")
            if len(sent) != len(view):
                raise ValueError(
                    f"out of step with the head: the worker expects {len(view)} words, the head sent {len(sent)}"
                )
            for index, word in enumerate(sent):
                view[index] = word

        return broadcast

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        head = list(words) if self._setup is None else self._setup
        return [head, list(words)]


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

    __slots__ = ("_recording", "events")

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

    def ep_broadcast_tokens_into(self, tokens: TokenArray) -> None:
        buffer = as_u32_buffer("tokens", tokens)  # converted once, checked before recording
        super().ep_broadcast_tokens_into(buffer)
        self.events.append(EpEvent("tokens", tuple(memoryview(buffer).tolist())))

    def ep_shutdown_workers(self) -> None:
        first = not self.workers_shut_down
        super().ep_shutdown_workers()
        if first:
            self.events.append(EpEvent("shutdown", ()))

    def replay(
        self,
        worker: WireEp[S],
        slots: MutableSequence[S | None],
        *,
        logger: logging.Logger | None = None,
    ) -> WorkerSummary:
        """Feed the recorded wire to ``worker`` as worker rank 1, under :func:`run_worker`.

        The worker first runs its setup agreement against the recording's (as
        :meth:`WireEp.attached`), so it must have been built with the same protocol,
        ``v1_slot`` and slot count; it keeps its own transport afterwards.  A
        shutdown header ends the replay (one is added if none was recorded).  The
        recording can be replayed again.

        Raises:
            EpSetupError: ``worker`` disagrees with the recording.
            ValueError: this recorder is not multi-rank (``is_ep=False``).
            EpReceiveError: the worker read more, or other lengths, than was sent.
        """
        if not self.is_ep():
            raise ValueError("replay() needs a recording made with is_ep=True; nothing went on the wire")
        broadcasts = self.wire
        if not self.workers_shut_down:
            broadcasts.append(_shutdown_frame())
        with worker.attached(ReplayTransport(broadcasts, setup=self._recording.setup)):
            return run_worker(worker, slots, logger=logger)


def _shutdown_frame() -> tuple[int, ...]:
    """The frame of a shutdown header, as any head sends it."""
    recording = RecordingTransport(world_size=2)
    WireEp[SequenceState](recording, num_slots=1, protocol=EpProtocol.V2).ep_shutdown_workers()
    return recording.broadcasts[-1]
