"""What a sync point compares, and how a difference is worded: pure functions, no IO.

At sync point ``n`` every worker acknowledges what it received (the count of
commands, a CRC-32 of every message's bytes) and, when asked, its state's digest.
The head holds the same figures for what it sent.  A stream that differs means a
lost or altered message (or a bug in a transport); a state that differs with an
equal stream means a model that did not apply a command the same way on every rank.
Either way the message names the ranks, and the commands between the last sync
point where every rank agreed and this one: where they could have diverged, as far
as a digest can tell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._core.checks import ranks_disagree
from .._core.codec import Ack

__all__ = ["HeadFigures", "differences", "disagreement_of_values"]


@dataclass(frozen=True)
class HeadFigures:
    """What the head sent, at a sync point."""

    number: int
    commands: int
    stream_crc: int
    state_digest: int | None
    agreed_commands: int
    """The commands sent by the last sync point where every rank agreed (0: the start)."""


def differences(head: HeadFigures, acks: Mapping[int, Ack]) -> tuple[str, list[int]] | None:
    """``None`` when every worker's acknowledgement matches the head, else the message and the ranks that differ."""
    found: list[str] = []
    ranks: list[int] = []
    states = {rank: ack.state_digest for rank, ack in acks.items()}
    for rank, ack in sorted(acks.items()):
        what = []
        if ack.commands != head.commands:
            what.append(f"received {ack.commands} commands where the head sent {head.commands}")
        elif ack.stream_crc != head.stream_crc:
            what.append(f"its command stream's CRC-32 is {ack.stream_crc:#010x}, the head's {head.stream_crc:#010x}")
        expected = head.state_digest if head.state_digest is not None else states[min(states)]
        if head.state_digest is not None or len(set(states.values())) > 1:
            if ack.state_digest is None:
                what.append("it computed no state digest (set link.state_digest on every rank)")
            elif ack.state_digest != expected:
                whose = "the head's" if head.state_digest is not None else f"worker rank {min(states)}'s"
                what.append(f"its state digest is {ack.state_digest:#018x}, {whose} {expected:#018x}")
        if what:
            ranks.append(rank)
            found.append(f"worker rank {rank}: {'; '.join(what)}")
    if not found:
        return None
    since = (
        f"they agreed at the last sync point, after command {head.agreed_commands}: they diverged within "
        f"commands {head.agreed_commands + 1} ..= {head.commands}"
        if head.agreed_commands
        else f"no sync point has seen every rank agree yet: they diverged within commands 1 ..= {head.commands}"
    )
    return f"at sync point {head.number}, the ranks differ: {'; '.join(found)}; {since}", ranks


def disagreement_of_values(names: Sequence[str], everyone: Sequence[Sequence[int]]) -> tuple[str, list[int]] | None:
    """``None`` when every rank gathered the same named values, else the message (each mismatch) and the ranks
    whose values differ from rank 0's."""
    columns = {name: [words[index] for words in everyone] for index, name in enumerate(names)}
    differ = ranks_disagree(columns)
    if differ is None:
        return None
    return differ, sorted(
        {rank for column in columns.values() for rank, value in enumerate(column) if value != column[0]}
    )
