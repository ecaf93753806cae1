"""Protocol versions: the shape of a command header on the wire."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from typing import Final

PROTOCOL_ENV_VAR: Final[str] = "METRALE_EP_PROTOCOL"
"""Environment variable that selects the protocol: ``v1`` (default) or ``v2``."""


class EpProtocol(enum.Enum):
    """The header layout every rank of a run must agree on.

    * ``V1``: a header is one word, ``[cmd]``.  ``seq_id`` is not on the wire, so a
      worker runs every command in slot 0; a v1 model that serves several sequences
      carries the slot in a follow-up word of its own.
    * ``V2``: a header is ``[seq_id, cmd]``, sent as one broadcast; the worker runs
      the command in ``slots[seq_id]``.

    Head and workers must use the same version: a worker reading v1 headers from a
    v2 head would take every ``seq_id`` for a command.  Backends confirm agreement
    at setup.
    """

    V1 = "v1"
    V2 = "v2"

    @property
    def code(self) -> int:
        """The number that stands for this version in the setup exchange (1 or 2).

        Fixed per version, independent of any layout detail, so that a future layout
        can never be taken for another.
        """
        return _CODES[self]

    @property
    def header_words(self) -> int:
        """Number of u32 words in one header: 1 under v1, 2 under v2."""
        return 2 if self is EpProtocol.V2 else 1

    def encode_header(self, seq_id: int, cmd: int) -> tuple[int, ...]:
        """The words of the header that starts ``cmd`` for ``seq_id``: ``(cmd,)`` or ``(seq_id, cmd)``.

        The words are not checked here; callers check them first.
        """
        return (seq_id, cmd) if self is EpProtocol.V2 else (cmd,)

    def decode_header(self, words: Sequence[int]) -> tuple[int, int]:
        """``(seq_id, cmd)`` of a received header; ``seq_id`` is 0 under v1."""
        return (words[0], words[1]) if self is EpProtocol.V2 else (0, words[0])

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EpProtocol:
        """Read ``METRALE_EP_PROTOCOL`` from ``environ`` (default ``os.environ``).

        Unset or empty (blanks only) gives ``V1``; ``v1`` / ``v2`` select, case and
        surrounding blanks ignored.

        Raises:
            ValueError: any other value; the message names the variable, the value
                and the accepted values.
        """
        env = os.environ if environ is None else environ
        raw = env.get(PROTOCOL_ENV_VAR, "")
        value = raw.strip().lower()
        if not value:
            return cls.V1
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(repr(member.value) for member in cls)
            raise ValueError(
                f"{PROTOCOL_ENV_VAR}={raw!r} is not a protocol version; accepted: {accepted} (or unset/empty for 'v1')"
            ) from None


_CODES: Final[dict[EpProtocol, int]] = {EpProtocol.V1: 1, EpProtocol.V2: 2}
