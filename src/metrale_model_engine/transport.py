"""``EpTransport``: what a backend gives the protocol, and the plain errors a backend raises.

A transport moves *messages* (runs of u32 words) from rank 0, the head, to every
other rank of a fixed group, in order, whole; it also gathers a few words from
every rank at setup.  It knows nothing of commands: :class:`~metrale_model_engine.EpLink`
encodes those (see :mod:`metrale_model_engine.wire`) and maps every failure a
transport raises, once, to the library's own errors (a failed send to
``EpSendError``, a failed receive to ``EpReceiveError``, a failed setup exchange to
``EpLinkError``).  A transport raises plain errors: the classes below, ``OSError``,
or its backend's own.

Implementations: :class:`metrale_model_engine.shm.ShmTransport` (one host, shared
memory), :class:`metrale_model_engine.torch.TorchTransport` (any
torch.distributed group), and the in-memory doubles of
:mod:`metrale_model_engine.testing`.
"""

from ._core.transport import EpTransport, PeerLost, SoloTransport, TransportClosed, TransportCorrupt, TransportTimeout

__all__ = ["EpTransport", "PeerLost", "SoloTransport", "TransportClosed", "TransportCorrupt", "TransportTimeout"]

for _class in (EpTransport, PeerLost, SoloTransport, TransportClosed, TransportCorrupt, TransportTimeout):
    _class.__module__ = __name__  # reprs and docs name the public home
