"""``Popen`` for the programs the tests run as a user runs them, forked from a process that imported torch once.

``Popen([sys.executable, "-m", MODULE, *args], ...)`` (or ``"-c", CODE`` or ``SCRIPT``)
takes ``subprocess.Popen``'s arguments that the tests use (``stdin``, ``stdout``,
``stderr``: ``PIPE``, ``DEVNULL``, ``STDOUT``, ``None`` or a file; ``text``, ``env``,
``cwd``, ``start_new_session``) and its methods (``poll``, ``wait``,
``communicate``, ``send_signal``, ``terminate``, ``kill``), but the program is a child of
``helpers.program_server`` (one per test process, started at its first use) instead
of a fresh interpreter: it starts without importing torch again (about 1.5 s of CPU),
and so do its ranks, which are forks of it.  ``run`` is ``subprocess.run`` so.

What a fresh start alone shows stays with ``subprocess``: an interrupt during the
imports, the processes a program leaves behind (the resource tracker included),
spawned ranks (their target pickled, ``__main__`` imported again), the variables an
interpreter reads at its start (``START_VARIABLES``, refused here; the server shares
its hash seed with every program).  A test of one of those keeps ``subprocess``, and
each program keeps at least one test started afresh: the demo's license-text run, the
console script's server, the examples' own runs, the README's program.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from helpers.isolation import Isolation

TESTS = Path(__file__).resolve().parents[1]
PRELOAD = (
    "torch.distributed",
    "metrale_model_engine.torch",
    "metrale_model_engine.shm",
    "metrale_model_engine.reference",
    "metrale_model_engine._demo.launch",
    "metrale_model_engine.serve.api.app",
    "metrale_model_engine.serve.engine",
    "uvicorn",
)
"""What the server imports once: what the programs import before they run, but never a module run as ``__main__``
(``runpy`` warns when the module it runs was imported already)."""
_READY_S = 120.0
"""How long the server may take to listen (it imports torch, on a loaded machine)."""
START_VARIABLES = (
    "PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONUTF8",
    "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONTRACEMALLOC",
)  # fmt: skip
"""Variables an interpreter reads at its start, which the server read at its own: a program whose environment
sets one otherwise than the server's is refused (``PYTHONUNBUFFERED`` and ``OMP_NUM_THREADS`` are taken)."""


class _Server:
    """The program server of this process, started at the first program (in a session of its own: a terminal's
    Ctrl-C of the test run is not its)."""

    def __init__(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="metrale-programs-"))
        self.path = str(self._folder / "socket")
        self.environ = dict(os.environ)
        log_path = self._folder / "server.log"
        with log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "helpers.program_server", self.path, ",".join(PRELOAD)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, cwd=TESTS, start_new_session=True,
            )  # fmt: skip
        atexit.register(self.close)
        deadline = time.monotonic() + _READY_S
        while not os.path.exists(self.path):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the program server did not start: {log_path.read_text()}")
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        return connection

    def close(self) -> None:
        """End the server (its programs go on: each test ends its own); remove its folder."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10)
        shutil.rmtree(self._folder, ignore_errors=True)


_server: list[_Server | RuntimeError] = []


def _the_server() -> _Server:
    """This process's server; one that failed to start is not tried again (each program raises its error)."""
    if not _server:
        try:
            _server.append(_Server())
        except RuntimeError as error:
            _server.append(error)
    server = _server[0]
    if isinstance(server, RuntimeError):
        raise server
    return server


def _program(args: Sequence[str]) -> list[str]:
    """``args`` as the server takes it, the interpreter left out: ``-m MODULE ...``, ``-c CODE ...``, ``SCRIPT ...``."""
    if len(args) < 2 or args[0] != sys.executable or (args[1].startswith("-") and args[1] not in ("-m", "-c")):
        raise ValueError(f"not this interpreter running a module (-m), code (-c) or a script: {args}")
    return [str(arg) for arg in args[1:]]


class Popen:
    """A program forked from the program server; ``subprocess.Popen``'s subset that the tests use."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        start_new_session: bool = False,
        isolate: Isolation | None = None,
    ) -> None:
        """``isolate``: the program in namespaces of its own (a simulated host's, a private ``/dev/shm``)."""
        self.args = list(args)
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        server = _the_server()
        environ = dict(os.environ if env is None else env)
        if differ := [name for name in START_VARIABLES if environ.get(name) != server.environ.get(name)]:
            raise ValueError(f"{differ} set otherwise than the program server's start: run {args} with subprocess")
        request = {
            "argv": _program(args),
            "env": environ,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": start_new_session,
            "isolate": isolate,
        }
        theirs: list[int] = []
        ours: list[tuple[str, int]] = []
        try:
            for name, given in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
                if given == subprocess.STDOUT and name == "stderr":
                    theirs.append(os.dup(theirs[1]))
                elif given == subprocess.PIPE:
                    read, write = os.pipe()
                    child, parent = (read, write) if name == "stdin" else (write, read)
                    theirs.append(child)
                    ours.append((name, parent))
                elif given == subprocess.DEVNULL or (given is None and name == "stdin"):
                    theirs.append(os.open(os.devnull, os.O_RDWR))
                elif given is None:
                    theirs.append(os.dup(("stdin", "stdout", "stderr").index(name)))
                elif isinstance(given, int):
                    theirs.append(os.dup(given))
                else:
                    theirs.append(os.dup(given.fileno()))
            self._connection = server.connect()
            socket.send_fds(self._connection, [json.dumps(request).encode() + b"\n"], theirs)
        except BaseException:
            for _, fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        for name, fd in ours:
            mode = "w" if name == "stdin" else "r"
            setattr(self, name, open(fd, mode + ("" if text else "b")))  # noqa: SIM115  (closed as Popen's are)
        self._answers = b""
        self._readers: dict[str, threading.Thread] = {}
        self._read: dict[str, Any] = {}
        first = self._answer(None)
        if not first.startswith("pid "):
            raise RuntimeError(f"the program server could not start {self.args}: {first}")
        self.pid = int(first.removeprefix("pid "))

    def _answer(self, timeout: float | None) -> str:
        """The server's next line (``pid N``, ``status N``); ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._answers:
            self._connection.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk = self._connection.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            if not chunk:
                raise RuntimeError(f"the program server refused {self.args}, or ended before it did")
            self._answers += chunk
        line, _, self._answers = self._answers.partition(b"\n")
        return line.decode()

    def poll(self) -> int | None:
        """The exit status if the program has ended, else ``None``."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the program's end; its exit status (negative: the signal that ended it)."""
        if self.returncode is None:
            self.returncode = int(self._answer(timeout).removeprefix("status "))
            self._connection.close()
        return self.returncode

    def communicate(self, input: str | bytes | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their ends, wait: ``(stdout, stderr)`` (``None`` if not piped)."""
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        if not self._readers:  # once: a call after a timeout goes on reading where the last one was
            self._readers = {
                name: threading.Thread(target=lambda name=name, file=file: self._read.__setitem__(name, file.read()))
                for name, file in (("stdout", self.stdout), ("stderr", self.stderr))
                if file is not None
            }
            for reader in self._readers.values():
                reader.daemon = True
                reader.start()
        readers = self._readers.values()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._close_streams()
        return self._read.get("stdout"), self._read.get("stderr")

    def _close_streams(self) -> None:
        """Close the pipes, but one a reader still reads (``close`` would wait for it: the program's ranks may hold
        the other end after a kill); its thread ends with the pipe."""
        reading = {name for name, reader in self._readers.items() if reader.is_alive()}
        for name in ("stdin", "stdout", "stderr"):
            file = getattr(self, name)
            if file is not None and name not in reading:
                file.close()

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the program, unless it has ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended, the server's answer on its way
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_streams()
        self.wait()


def run(
    args: Sequence[str],
    *,
    capture_output: bool = False,
    text: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    check: bool = False,
    isolate: Isolation | None = None,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` of a program forked from the program server; a timeout kills it and raises as ``run`` does."""
    pipe = subprocess.PIPE if capture_output else None
    with Popen(args, stdout=pipe, stderr=pipe, text=text, env=env, cwd=cwd, isolate=isolate) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args, stdout, stderr)
    return subprocess.CompletedProcess(process.args, process.returncode or 0, stdout, stderr)
