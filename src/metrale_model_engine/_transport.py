"""``EpTransport``: the two primitives a backend gives the wire protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from typing_extensions import Buffer

Broadcast = Callable[[float | None], None]
"""One in-place broadcast of a fixed buffer; the argument is a timeout in seconds
(``None``: wait as long as the backend's own group timeout allows)."""


class EpTransport(Protocol):
    """A fixed group of ranks that rank 0 broadcasts u32 words to.

    The protocol layer (:class:`~metrale_model_engine.WireEp`) speaks only in u32
    buffers; a backend (torch.distributed, an in-memory test double) implements
    this.  Any exception a backend raises is taken for a link failure.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group; 0 is the head."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        ...

    def bind(self, words: Buffer) -> Broadcast:
        """Return a broadcaster for ``words``, a C-contiguous native u32 buffer.

        Each call of the result is one collective broadcast from rank 0: the head's
        contents of ``words`` overwrite every other rank's.  Binding once and calling
        many times lets a backend keep its wrapping of the buffer.
        """
        ...

    def gather(self, words: Sequence[int]) -> list[list[int]]:
        """Every rank's ``words`` (each rank passes the same count), by rank."""
        ...
