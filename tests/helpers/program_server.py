"""Programs forked from one process that imported torch once: a start of the demo, the server or an example
in milliseconds, where a fresh interpreter spends about a second and a half of CPU importing torch.

``python -m helpers.program_server SOCKET PRELOAD`` (in ``tests/``) imports the comma-separated modules of
``PRELOAD``, freezes them out of the garbage collector (``gc.freeze``: shared with every
child, whose collections then copy none of their pages) and serves on the Unix socket
``SOCKET`` until its standard input closes (the test process that started it has gone).
Each connection asks for one program: a JSON line (``argv``, ``env``, ``cwd``,
``new_session``; ``isolate``: namespaces of its own, ``helpers.isolation``) sent with
three descriptors (the program's stdin, stdout and stderr).
The server forks a child that becomes that program and answers ``pid N``; once the child has
ended, ``status N`` (``waitstatus_to_exitcode``: negative for a signal) and closes the
connection.  ``helpers.programs`` is the client.

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
import json
import os
import runpy
import selectors
import socket
import sys
import types
from typing import cast

from metrale_model_engine._host.launch import start_ranks_as_forks

from helpers.isolation import Isolation, isolate

_MAX_REQUEST = 1 << 20
"""The longest request line, in bytes (an environment is a few KiB)."""


def serve(path: str) -> None:
    """Accept requests until standard input closes; fork each program (the child returns: it runs the program)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
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
                request = _receive(connection)
                if request is None:
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _become(request, [listener, connection, *(c for _, c in running.values())], list(running))
                    return
                for fd in request[1]:
                    os.close(fd)
                connection.sendall(f"pid {pid}\n".encode())
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


def _become(request: tuple[dict[str, object], list[int]], sockets: list[socket.socket], pidfds: list[int]) -> None:
    """In the child: give up what the server holds, take the program's descriptors and surroundings."""
    spec, fds = request
    for held in sockets:
        os.close(held.detach())
    for pidfd in pidfds:
        os.close(pidfd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if spec["new_session"]:
        os.setsid()
    if spec.get("isolate"):
        isolate(cast("Isolation", spec["isolate"]))  # the JSON of one
    os.chdir(str(spec["cwd"]))
    env = spec["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    argv = spec["argv"]
    assert isinstance(argv, list)
    _PROGRAM[:] = [str(word) for word in argv]


_PROGRAM: list[str] = []
"""In a child: the program's ``argv`` but the interpreter (``-m MODULE ARGS``, ``-c CODE ARGS``, ``SCRIPT ARGS``)."""


def _run_program(argv: list[str]) -> None:
    """Run the program as ``python`` would run ``argv``; its ``SystemExit`` ends this process."""
    python_path = _python_path()
    site = [entry for entry in _SITE if entry not in python_path]
    start_ranks_as_forks()
    if argv[0] == "-c":
        sys.path[:] = ["", *python_path, *site]
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # as python -c runs it
    elif argv[0] == "-m":
        sys.path[:] = [os.getcwd(), *python_path, *site]
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(script), *python_path, *site]
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")


def _python_path() -> list[str]:
    return [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


_SITE = [entry for entry in sys.path[1:] if entry not in _python_path()]
"""The server's ``sys.path`` but its own directory and ``PYTHONPATH``: what every program's path ends with."""

if __name__ == "__main__":
    socket_path, preload = sys.argv[1:3]
    for module in filter(None, preload.split(",")):
        importlib.import_module(module)
    gc.freeze()
    serve(socket_path)
    if _PROGRAM:  # the child: the server's loop returned here, with nothing of it left to unwind
        _run_program(_PROGRAM)
        raise SystemExit(0)
