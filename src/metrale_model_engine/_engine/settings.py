"""``LinkSettings``: what one rank's link was built with, checked once, read by every part; the setup exchange."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .._core.checks import check_bool, check_instance, check_int, check_seconds, disagreement
from .._core.codec import WIRE_VERSION
from .._core.errors import EpLinkError, EpSetupError
from .._core.protocol import ProtocolVersion
from .._core.transport import EpTransport
from .._core.words import U32_MAX
from .._host.liveness import host_fingerprint

DEFAULT_COMMAND_TIMEOUT: Final[float] = 60.0
"""Seconds a worker waits for a follow-up of a command in flight, and the head for a send."""


@dataclass(frozen=True)
class LinkSettings:
    """One rank's place in the group and the options every rank agreed on (see ``EpLink``'s arguments)."""

    rank: int
    world_size: int
    num_slots: int
    protocol: ProtocolVersion
    seq_id_on_wire: bool
    command_timeout: float | None
    epoch: int = 0
    """How many times the link re-formed over the ranks left (0: as it was built); every rank agrees on it."""

    @classmethod
    def checked(
        cls,
        rank: int,
        world_size: int,
        *,
        num_slots: object,
        protocol: object,
        seq_id_on_wire: object,
        command_timeout: object,
    ) -> LinkSettings:
        """The settings, each argument checked (``protocol=None``: ``ProtocolVersion.from_env``).

        Raises:
            TypeError, ValueError: an argument, named in the message.
        """
        slots = check_int("num_slots", num_slots, 1, U32_MAX)
        version = check_instance(
            "protocol",
            ProtocolVersion.from_env() if protocol is None else protocol,
            ProtocolVersion,
            "a ProtocolVersion (V1 or V2)",
        )
        on_wire = check_bool("seq_id_on_wire", seq_id_on_wire)
        if version is ProtocolVersion.V2 and not on_wire:
            raise ValueError("seq_id_on_wire=False needs protocol v1: every v2 header carries seq_id")
        timeout = check_seconds("command_timeout", command_timeout, allow_none=True)
        return cls(rank, world_size, slots, version, on_wire, timeout)

    @property
    def who(self) -> str:
        """How messages name this rank: ``"head"`` or ``"worker rank N"``."""
        return f"worker rank {self.rank}" if self.rank else "head"


_FIELDS: tuple[tuple[str, Callable[[int], str]], ...] = (
    ("wire version", str),
    ("protocol", "v{}".format),
    ("seq_id_on_wire option", lambda flag: str(bool(flag))),
    ("slot count", str),
    ("epoch", str),
)
"""The words every rank must agree on, in the order they are sent, and how a message shows each; then each
rank's pid and host fingerprint."""
_PID: Final = len(_FIELDS)


def agree_on_setup(transport: EpTransport, settings: LinkSettings, timeout: float | None = None) -> dict[int, int]:
    """Run the setup exchange over ``transport`` (collective, within ``timeout``: default the transport's setup
    limit); raise unless every rank agrees.

    Each rank sends its wire version, protocol, ``seq_id_on_wire``, slot count, epoch,
    pid and host fingerprint.  A rank of another epoch than the head's missed a
    re-form of the link: it is refused by name.

    Returns:
        The pid of every worker on this rank's host, by rank.

    Raises:
        EpSetupError: a rank disagrees (the message lists every rank's value).
        EpLinkError: the exchange itself failed (a rank died, a timeout).
    """
    rank = settings.rank
    mine = [WIRE_VERSION, settings.protocol.code, int(settings.seq_id_on_wire), settings.num_slots, settings.epoch]
    mine += [os.getpid(), *host_fingerprint()]
    try:
        everyone = transport.gather(mine, timeout)
    except Exception as error:
        raise EpLinkError(f"rank {rank}: the setup exchange failed: {error}") from error
    for peer, words in enumerate(everyone):
        if len(words) != len(mine):
            raise EpSetupError(
                f"rank {rank}: rank {peer} sent a setup of {len(words)} words, not {len(mine)}: "
                "every rank must run the same version of this library"
            )
    for field, (name, shown) in enumerate(_FIELDS):
        column = [words[field] for words in everyone]
        problem = disagreement(rank, name, column, shown)
        if problem is not None:
            raise EpSetupError(problem + _older(column) if name == "epoch" else problem)
    return {
        peer: words[_PID]
        for peer, words in enumerate(everyone)
        if peer and words[_PID + 1 :] == mine[_PID + 1 :] and words[_PID] not in (0, mine[_PID])
    }


def _older(epochs: list[int]) -> str:
    """What a disagreement on the epoch adds: the ranks whose setup is of an older epoch than the head's."""
    older = [peer for peer, epoch in enumerate(epochs) if epoch < epochs[0]]
    newer = [peer for peer, epoch in enumerate(epochs) if epoch > epochs[0]]
    said = ""
    if older:
        said += f"; rank(s) {older} are of an epoch older than the head's: they missed a re-form of the link"
    if newer:
        said += f"; rank(s) {newer} are of an epoch later than the head's: the link re-formed without the head"
    return said
