"""Ending this process's waits on a torch.distributed group from another thread, as a peer's death would.

``ProcessGroup.abort()`` leaves a wait of gloo's waiting, and a wait abandoned
(``Work.wait(timeout)``) keeps the process from exiting until the collective's own
timeout (both seen with torch 2.13).  A peer's death ends every wait on it at
once, by closing its connections; so ``sever_group_connections`` shuts down
this process's connections that gloo made, those with an end at an address a rank
published in the group's store at the rendezvous.  The store's own connections,
and any other of the program's, stay.  Linux (``/proc``).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import sys
from typing import Final

from torch._C._distributed_c10d import TCPStore
from torch.distributed import DistStoreError

_LOGGER = logging.getLogger("metrale_model_engine.torch")
_ESTABLISHED: Final = "01"
"""A connected socket's state in ``/proc/net/tcp``."""
_CONNECT_TIMEOUT: Final = datetime.timedelta(seconds=10)
"""The bound on a connection of its own to the store (a heartbeat's, a watch's, a severing's reader)."""
_READ_TIMEOUT: Final = datetime.timedelta(seconds=1)
"""The bound on reading one published key: a key listed, then deleted before its read, costs this, not the
store's own timeout (a read waits for a key that is not there)."""


def connect_to(store: TCPStore) -> TCPStore:
    """A connection of its own to ``store``'s server (its connect bounded by ``_CONNECT_TIMEOUT``, its waits too)."""
    return TCPStore(store.host, store.port, is_master=False, timeout=_CONNECT_TIMEOUT, wait_for_workers=False)


def sever_group_connections(store: TCPStore) -> int:
    """Shut down this process's TCP connections that gloo made; return how many (see the module).

    Gloo's are those with an end at an address some rank published in ``store``
    (its rendezvous records hold each rank's ``sockaddr``).  A descriptor is shut down
    only while it is still the socket found (one closed and reused meanwhile by another
    thread is left alone).  Best effort: with a store that takes no connection or
    cannot list its keys (an older torch), none, and a warning says why.
    """
    try:
        published = published_values(store)
    except Exception as error:  # noqa: BLE001
        _LOGGER.warning("cannot end the waits on the group (the store's keys could not be read): %s", error)
        return 0
    severed = 0
    connections = _tcp_connections()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        ends = connections.get(target)
        if ends is None or not any(_published(end, published) for end in ends):
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as connection:
                if f"socket:[{os.fstat(connection.fileno()).st_ino}]" != target:
                    continue  # closed and reused since it was read: another of the program's files now
                connection.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError as error:
            _LOGGER.debug("could not shut down socket %s: %s", fd, error)
    return severed


def published_values(store: TCPStore) -> bytes:
    """Every value in ``store``, ``\\0``-separated: the keys listed on ``store``'s connection (which fails at once
    where the store's server is gone; a new connection would retry for ``_CONNECT_TIMEOUT``), the values read
    through a connection of its own.

    A key that other ranks delete meanwhile (a heartbeat's last word, cleared at its start) is skipped: each
    read waits ``_READ_TIMEOUT`` at most, where the shared connection would wait the store's whole timeout
    (days, for a rendezvous store) and hold the severing, and the re-form waiting for it, that long.
    """
    keys = store.list_keys()  # on the connection there is: it fails at once where the store's server is gone
    reader = connect_to(store)
    reader.set_timeout(_READ_TIMEOUT)
    values = []
    for key in keys:
        try:
            values.append(reader.get(key))
        except DistStoreError:  # deleted since it was listed: no address of gloo's is ever deleted
            _LOGGER.debug("skipped store key %r: gone since it was listed", key)
    return b"\0".join(values)


Endpoint = tuple[int, bytes, int]
"""An end of a TCP connection: its address family, its address (network order) and its port."""


def tcp_table() -> list[tuple[int, list[str]]] | None:
    """The rows of this process's network namespace's TCP tables (``/proc/self/net/tcp`` and ``tcp6``), each as its
    address family and its fields; ``None`` where neither table can be read."""
    rows: list[tuple[int, list[str]]] | None = None
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{name}") as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        rows = (rows or []) + [(family, line.split()) for line in lines]
    return rows


def _tcp_connections() -> dict[str, tuple[Endpoint, Endpoint]]:
    """The connected TCP sockets of this process's network namespace, by ``socket:[inode]``: both ends."""
    return {
        f"socket:[{fields[9]}]": (_endpoint(fields[1], family), _endpoint(fields[2], family))
        for family, fields in tcp_table() or ()
        if fields[3] == _ESTABLISHED
    }


def _endpoint(text: str, family: int) -> Endpoint:
    """``ADDRESS:PORT`` of ``/proc/net/tcp*`` (the address in 32-bit words of host order) as an ``Endpoint``."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    packed = b"".join(raw[at : at + 4][::-1] for at in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if family == socket.AF_INET6 and packed[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 address, mapped
        return socket.AF_INET, packed[12:], int(port, 16)
    return family, packed, int(port, 16)


def _published(end: Endpoint, published: bytes) -> bool:
    """Whether ``end`` is an address (a ``sockaddr_in``/``sockaddr_in6``) found in ``published``."""
    family, address, port = end
    head = family.to_bytes(2, sys.byteorder) + port.to_bytes(2, "big")
    if family == socket.AF_INET:
        return head + address in published
    return re.search(re.escape(head) + b".{4}" + re.escape(address), published, re.DOTALL) is not None
