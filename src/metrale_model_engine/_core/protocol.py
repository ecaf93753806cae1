"""Protocol versions: the shape of a command header on the wire."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Final

PROTOCOL_ENV_VAR: Final[str] = "METRALE_EP_PROTOCOL"
"""Environment variable that selects the protocol: ``v1`` (default) or ``v2``."""


class ProtocolVersion(enum.Enum):
    """The protocol version every rank of a run must agree on.

    * ``V1``: the Rust engine's v1 headers do not carry ``seq_id``.  On this
      library's wire the header carries it anyway unless a link turns that off
      (``EpLink(seq_id_on_wire=False)``, then every command runs in slot 0).
    * ``V2``: every header carries ``seq_id``; the worker runs the command in
      ``slots[seq_id]``.

    What a model sees is [`ep_protocol_v2`][metrale_model_engine.ModelEp.ep_protocol_v2].
    Links confirm at setup that all ranks use the same version (by [`code`][metrale_model_engine.ProtocolVersion.code]).
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProtocolVersion:
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


_CODES: Final[dict[ProtocolVersion, int]] = {ProtocolVersion.V1: 1, ProtocolVersion.V2: 2}
