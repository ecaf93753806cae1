"""``EpTransport``: what a backend gives the protocol, and the plain errors a backend raises.

A transport moves *messages* (runs of u32 words) from rank 0, the head, to every
other rank of a fixed group, in order, whole; it also gathers a few words from
every rank at setup.  It knows nothing of commands: [`EpLink`][metrale_model_engine.EpLink]
encodes those (see [`metrale_model_engine.wire`][metrale_model_engine.wire]) and maps every failure a
transport raises, once, to the library's own errors (a failed send to
``EpSendError``, a failed receive to ``EpReceiveError``, a failed setup exchange to
``EpLinkError``).  A transport raises plain errors: the classes below, ``OSError``,
or its backend's own.

A transport has two ends, by role: [`HeadTransport`][metrale_model_engine.transport.HeadTransport] (rank 0: sends, reads
answers) and [`WorkerTransport`][metrale_model_engine.transport.WorkerTransport] (receives, answers);
[`EpTransport`][metrale_model_engine.transport.EpTransport] is both, as ``EpLink`` takes it.  Implementations:
[`metrale_model_engine.shm.ShmTransport`][metrale_model_engine.shm.ShmTransport] (one host, shared memory) and
[`metrale_model_engine.torch.TorchTransport`][metrale_model_engine.torch.TorchTransport] (any torch.distributed group)
serve every rank; [`SoloTransport`][metrale_model_engine.transport.SoloTransport] (one rank) and the in-memory doubles
of [`metrale_model_engine.testing`][metrale_model_engine.testing] play one role, on
[`HeadEnd`][metrale_model_engine.transport.HeadEnd] or [`WorkerEnd`][metrale_model_engine.transport.WorkerEnd], whose
calls of the other role refuse.  A head transport that can tell which workers went silent (ranks on other hosts) also
gives [`NamesSilentRanks`][metrale_model_engine.transport.NamesSilentRanks], and the link's errors name them; one that
plays its whole group in one process (the doubles of [`metrale_model_engine.testing`][metrale_model_engine.testing])
gives [`PretendGroup`][metrale_model_engine.transport.PretendGroup], and a model's collectives over it have one
participant.  A transport whose ranks can form a new one once some are lost (a re-form of the link) leaves a
[`Regroup`][metrale_model_engine.transport.Regroup] channel behind, by
[`Reformable`][metrale_model_engine.transport.Reformable] (``ShmTransport``), or its launcher gives the link one
(``open_link``).
"""

from ._core.namespace import PublicDir, public_dir
from ._core.reform import Reformable, Regroup
from ._core.transport import (
    EpTransport,
    HeadEnd,
    HeadTransport,
    NamesSilentRanks,
    PeerLost,
    PretendGroup,
    SoloTransport,
    TransportClosed,
    TransportCorrupt,
    TransportTimeout,
    WorkerEnd,
    WorkerTransport,
)

__all__ = [
    "EpTransport",
    "HeadEnd",
    "HeadTransport",
    "NamesSilentRanks",
    "PeerLost",
    "PretendGroup",
    "Reformable",
    "Regroup",
    "SoloTransport",
    "TransportClosed",
    "TransportCorrupt",
    "TransportTimeout",
    "WorkerEnd",
    "WorkerTransport",
]
__dir__: PublicDir = public_dir(globals(), __all__)
