"""The protocol over shared memory: one host's ranks exchange messages in microseconds.

[`ShmTransport`][metrale_model_engine.shm.ShmTransport] is an [`EpTransport`][metrale_model_engine.EpTransport] over a
ring in a shared-memory segment, one writer (the head) and ``world_size - 1`` readers
(the workers).  The head creates the segment ([`ShmTransport.create`][metrale_model_engine.shm.ShmTransport.create]),
passes its [`name`][metrale_model_engine.shm.ShmTransport.name] to the workers by any means (process arguments, an
environment variable), and each worker attaches by name
([`ShmTransport.attach`][metrale_model_engine.shm.ShmTransport.attach]).  Over a torch.distributed group,
``metrale_model_engine.torch.open_transport("shm")`` does that rendezvous, and
``open_transport("auto")`` uses it whenever every rank is on one host.  This module
needs only the standard library and never imports torch.  Linux only (x86-64 and
arm64): it sleeps on futexes and watches peers through pidfds.

How the ring works, memory ordering included, is in ``_shm.ring``'s docstring; how
ranks wait, in ``_shm.waiting``'s.  In short: the head writes each message into
consecutive 64-byte-aligned records and never waits unless the ring is full; each
worker copies messages out and publishes how far it read; a waiting rank spins,
for as long as the gaps between its messages call for, then sleeps on a futex.

Faults
    Every wait checks, at least every [`CHECK_INTERVAL`][metrale_model_engine.shm.CHECK_INTERVAL], that its peers are
    alive (pidfds, so a reused pid is never taken for the peer) and that they have
    not left.  A worker whose receive fails marks itself gone before it raises, and
    the head's next send raises for it at once; a worker killed outright is found by
    the head's liveness check, which every send runs at most once per
    [`CHECK_INTERVAL`][metrale_model_engine.shm.CHECK_INTERVAL], and which every wait for room runs.  A dead or closed
    head ends a worker's wait once the worker has read everything the head
    published.  A failed send ends the ring for the head: every later send raises at
    once, and each worker raises when it reaches the cut message.

Lifecycle
    The head unlinks the segment's name as soon as every worker has attached (at
    the first [`gather`][metrale_model_engine.shm.ShmTransport.gather], which ``EpLink`` runs at setup), so no
    crash of any rank after setup can leave a file in ``/dev/shm``; the mappings
    live on until each rank closes.  A segment left by a run that crashed during
    setup is removed by the next [`create`][metrale_model_engine.shm.ShmTransport.create] on the machine (its
    creator's pid is dead), and never breaks a new run: every name is new.

Errors are plain (see [`metrale_model_engine.transport`][metrale_model_engine.transport]): ``PeerLost``,
``TransportTimeout``, ``TransportClosed``, ``TransportCorrupt``; ``EpLink`` maps
them.  Not thread-safe: one thread of each rank uses its transport.
"""

from ._core.namespace import PublicDir, public_dir
from ._shm.run import run_local as run_local  # deprecated: kept importable, not in __all__
from ._shm.run import run_ring
from ._shm.segment import MAX_WORLD_SIZE
from ._shm.transport import DEFAULT_CHUNK_BYTES, DEFAULT_RING_BYTES, DEFAULT_SETUP_TIMEOUT, ShmTransport, shm_supported
from ._shm.waiting import CHECK_INTERVAL, DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME

__all__ = [
    "CHECK_INTERVAL",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_SPIN_TIME",
    "DEFAULT_RING_BYTES",
    "DEFAULT_SETUP_TIMEOUT",
    "DEFAULT_SPIN_TIME",
    "MAX_WORLD_SIZE",
    "ShmTransport",
    "run_ring",
    "shm_supported",
]

__dir__: PublicDir = public_dir(globals(), __all__)
