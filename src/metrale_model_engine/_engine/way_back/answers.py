"""Answers decoded: a worker's reports of failed commands and its acknowledgements of sync points, as the
head reads them (``reports`` between sync points, ``_engine.sync`` at one).  Pure: no IO."""

from __future__ import annotations

from collections.abc import Iterable

from ..._core.codec import Ack, Report, WireError, decode_answer
from ..._core.errors import WorkerFailure


def read_answers(rank: int, answers: Iterable[bytes]) -> tuple[list[WorkerFailure], list[Ack]]:
    """The failures and acknowledgements in worker ``rank``'s answers.

    Raises:
        WireError: an answer is neither (the message names the rank).
    """
    failures: list[WorkerFailure] = []
    acks: list[Ack] = []
    for answer in answers:
        try:
            decoded = decode_answer(answer)
        except WireError as error:
            raise WireError(f"worker rank {rank}: {error}") from None
        if isinstance(decoded, Report):
            failures.append(WorkerFailure.from_report(rank, decoded))
        else:
            acks.append(decoded)
    return failures, acks
