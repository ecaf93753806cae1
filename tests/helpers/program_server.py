"""Programs forked from one process that imported torch once: a start of the demo, the server or an example
in milliseconds, where a fresh interpreter spends about a second and a half of CPU importing torch.

``python -m helpers.program_server SOCKET PRELOAD`` (in ``tests/``) imports the comma-separated modules of
``PRELOAD``, freezes them out of the garbage collector (``gc.freeze``: shared with every
child, whose collections then copy none of their pages) and serves on the Unix socket
``SOCKET`` until its standard input closes (the test process that started it has gone).
Each connection asks for one program: a JSON line (``argv``, ``env``, ``cwd``,
``new_session``; ``isolate``: namespaces of its own, ``helpers.isolation``) sent with
three descriptors (the program's stdin, stdout and stderr).  The server forks a child
that becomes that program, which answers ``pid N`` once it is in its session with its
streams; once the child has ended, the server answers ``status N``
(``waitstatus_to_exitcode``: negative for a signal) and closes the connection.
``helpers.programs`` is the client.

The child is the program as a fresh start makes it, but for what was imported before:
its own descriptors 0-2 and no other, its environment, directory, ``sys.argv`` and
``sys.path``; it runs the module (``-m``), code (``-c``) or script as ``__main__`` and ends through the
interpreter's own exit (exit hooks, then the teardown of every module).  Its ranks are
forks of it (``start_ranks_as_forks``): children of the program, as spawned ranks are.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import selectors
import socket
import sys
from typing import cast

from metrale_model_engine._host.launch import start_ranks_as_forks

from helpers.as_main import run_as_main
from helpers.isolation import Isolation, isolate

_MAX_REQUEST = 1 << 20
"""The longest request line, in bytes (an environment is a few KiB)."""


def serve(path: str) -> None:
    """Accept requests until standard input closes; fork each program (the child returns: it runs the program)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.new")
    listener.listen(64)
    os.rename(f"{path}.new", path)  # the path appears once a connection is taken
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the connection that asked)
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                return
            if key.data == "accept":
                connection, _ = listener.accept()
                try:
                    request = _receive(connection)
                except (OSError, ValueError):  # a client gone mid-request, a request that is not JSON
                    request = None
                if request is None:
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _become(request, connection, [listener, *(c for _, c in running.values())], list(running))
                    return
                for fd in request[1]:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (pid, connection)
                selector.register(pidfd, selectors.EVENT_READ, "ended")
            else:
                pidfd = key.fd
                selector.unregister(pidfd)
                pid, connection = running.pop(pidfd)
                os.close(pidfd)
                status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                with contextlib.suppress(OSError):  # the test that asked may have gone
                    connection.sendall(f"status {status}\n".encode())
                connection.close()


def _receive(connection: socket.socket) -> tuple[dict[str, object], list[int]] | None:
    """One request: its JSON and the three descriptors sent with it; ``None`` if it is not whole."""
    message, fds, _, _ = socket.recv_fds(connection, _MAX_REQUEST, 3)
    if len(fds) != 3 or not message.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        return None
    return json.loads(message), fds


def _become(
    request: tuple[dict[str, object], list[int]],
    connection: socket.socket,
    held: list[socket.socket],
    pidfds: list[int],
) -> None:
    """In the child: give up what the server holds, take the program's descriptors and surroundings; say its pid
    once it is the program's session and streams (a signal sent then reaches the program, not the server's copy)."""
    spec, fds = request
    for other in held:
        os.close(other.detach())
    for pidfd in pidfds:
        os.close(pidfd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if spec["new_session"]:
        os.setsid()
    connection.sendall(f"pid {os.getpid()}\n".encode())  # before the server's status, which waits for this end
    os.close(connection.detach())
    if spec.get("isolate"):
        isolate(cast("Isolation", spec["isolate"]))  # the JSON of one
    os.chdir(str(spec["cwd"]))
    env = spec["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    _take_start_variables()
    argv = spec["argv"]
    assert isinstance(argv, list)
    _PROGRAM[:] = [str(word) for word in argv]


def _take_start_variables() -> None:
    """What a fresh start takes from the environment that this process read at its own: the standard streams'
    buffering (``PYTHONUNBUFFERED``) and torch's threads (``OMP_NUM_THREADS``, read as torch is imported).  The
    client refuses the other such variables (``helpers.programs.START_VARIABLES``)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        line_buffered = (name == "stderr" or raw.isatty()) and not unbuffered
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding, errors=old.errors,
            line_buffering=line_buffered, write_through=unbuffered,
        )  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


_PROGRAM: list[str] = []
"""In a child: the program's ``argv`` but the interpreter (``-m MODULE ARGS``, ``-c CODE ARGS``, ``SCRIPT ARGS``)."""


if __name__ == "__main__":
    socket_path, preload = sys.argv[1:3]
    for module in filter(None, preload.split(",")):
        with contextlib.suppress(ImportError):  # an extra not installed (torch, serve): its programs import it
            importlib.import_module(module)
    gc.freeze()
    serve(socket_path)
    if _PROGRAM:  # the child: the server's loop returned here, with nothing of it left to unwind
        start_ranks_as_forks()
        run_as_main(_PROGRAM)
        raise SystemExit(0)
