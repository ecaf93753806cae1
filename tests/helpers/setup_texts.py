"""What the programs say when a setup fails, as the user reads it (one line each)."""

from __future__ import annotations

NO_ROOM = (
    "error: the shared-memory ring could not be set up (rank 0: /dev/shm has 0.1 MiB free, too little for the "
    "ring's 1.0 MiB: give the machine a larger /dev/shm (a container: docker run --shm-size), use the transport "
    "'torch' ('auto' falls back to it by itself), or create the ring with a smaller ring_bytes (ShmTransport.create))"
)
"""A ring of 1 MiB refused in a ``/dev/shm`` of 64 KiB."""
