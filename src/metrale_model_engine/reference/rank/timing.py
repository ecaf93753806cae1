"""Where a rank's time goes: ``TimeSpent``, summed by the head's sends and by the forward's all-reduces."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TimeSpent:
    """Seconds a rank spent, summed since it was built: sending commands, and inside its all-reduces.

    On the CPU an all-reduce returns when it is done; on CUDA it returns once queued,
    so there ``collectives_s`` counts only the launch.
    """

    protocol_s: float = 0.0
    collectives_s: float = 0.0

    def copy(self) -> TimeSpent:
        """A snapshot, to subtract from a later one."""
        return dataclasses.replace(self)
