"""``CommandStream``: one rank's count of the command stream, as the head sent it or a worker received it."""

from __future__ import annotations

from collections.abc import Sequence

from typing_extensions import Buffer

from .._core.codec import fold_message


class CommandStream:
    """The commands counted so far, the one in flight, and a digest of every message.

    The head counts what it sent, a worker what it received; sync points compare
    the two (``EpDivergenceError`` when they differ).  The shutdown header is not
    counted.  Plain attributes: the send and receive paths update them directly.
    """

    __slots__ = ("command", "commands", "crc")

    def __init__(self) -> None:
        self.commands = 0
        """Commands sent (head) or received (worker); a report names one by this count, from 1."""
        self.command = (0, 0)
        """``(seq_id, cmd)`` of the command in flight, for messages."""
        self.crc = 0
        """The stream digest: a CRC-32 of every message, in order, as ``fold_message`` folds one."""

    def begin(self, seq_id: int, cmd: int) -> None:
        """A command starts: count it and remember it."""
        self.commands += 1
        self.command = (seq_id, cmd)

    def add(self, parts: Sequence[Buffer]) -> None:
        """Fold one message, the concatenation of ``parts``, into the digest (``fold_message``)."""
        self.crc = fold_message(self.crc, parts)
