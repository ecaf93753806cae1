"""A real server process on a free port, driven with the official ``openai`` client (as vLLM's tests do).

[`RemoteServer`][helpers.openai_server.RemoteServer] starts ``python -m metrale_model_engine.serve`` with
``--port 0``, reads the port and every rank's pid from its first lines, and hands out
``openai.OpenAI`` and ``openai.AsyncOpenAI`` clients; its output is kept for the assertions.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai

from helpers import programs

READY_S = 120.0
"""How long a server may take to say where it serves (fresh interpreters import torch, on a loaded machine)."""


PYTHON_M: Sequence[str] = (sys.executable, "-m", "metrale_model_engine.serve")
CONSOLE_SCRIPT: Sequence[str] = (str(Path(sys.executable).with_name("metrale-serve")),)
"""The console script the package installs beside this interpreter."""


class RemoteServer:
    """``python -m metrale_model_engine.serve *args --port 0`` (or ``program``: the console script, torchrun),
    started at once, stopped by ``kill`` or ``stop``; forked from the program server (``helpers.programs``), but
    the console script, which starts afresh as a user's does."""

    def __init__(self, *args: str, program: Sequence[str] = PYTHON_M) -> None:
        command = [*program, *args, "--port", "0"]
        start = programs.Popen if command[0] == sys.executable else subprocess.Popen  # a console script: afresh
        self.process = start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.errors: list[str] = []
        said: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._readers = [
            threading.Thread(target=_read, args=(stream, kept, tell), daemon=True)
            for stream, kept, tell in (
                (self.process.stdout, self.lines, said),
                (self.process.stderr, self.errors, None),
            )
        ]
        for reader in self._readers:
            reader.start()
        deadline = time.monotonic() + READY_S
        self.pids: list[int] = []
        while True:
            try:
                line = said.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"the server said nothing in {READY_S} s: {self.output()}") from None
            if line == "":
                raise RuntimeError(f"the server exited {self.process.wait()}: {self.output()}")
            if match := re.search(r"; pids ([\d ]+)$", line):
                self.pids = [int(pid) for pid in match.group(1).split()]
            if match := re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line):
                self.port = int(match.group(1))
                break
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **options)

    def async_client(self, **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **options)

    def output(self) -> str:
        return "\n".join([*self.lines, *self.errors])

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """Kill the process and every rank its first line named (under torchrun they outlive a killed agent)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> int:
        """SIGTERM, and its exit status (killed after 60 s), once its output was read to its end (5 s at most more)."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        for reader in self._readers:
            reader.join(5)
        return self.process.wait()


def _read(stream: Any, kept: list[str], tell: queue.SimpleQueue[str] | None) -> None:
    for line in stream:
        kept.append(line.rstrip("\n"))
        if tell is not None:
            tell.put(line.rstrip("\n"))
    if tell is not None:
        tell.put("")


def sse_lines(url: str, body: dict[str, Any], limit: int) -> Sequence[str]:
    """The first ``limit`` ``data:`` lines of a streamed POST, read raw (the connection then dropped)."""
    import httpx

    lines: list[str] = []
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) >= limit:
                break
    return lines


def metric(server: RemoteServer, name: str, client: Any = None) -> float:
    """A metric's value, read from ``/metrics`` (through ``client``, an ``httpx.Client``, if given)."""
    return metrics(server, name, client=client)[0]


def metrics(server: RemoteServer, *names: str, client: Any = None) -> tuple[float, ...]:
    """The values of metrics ``names``, read from one answer of ``/metrics`` (through ``client``, if given)."""
    import httpx

    text = (client or httpx).get(f"{server.url}/metrics", timeout=10).text
    values = []
    for name in names:
        found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        assert found, f"{name} is not in /metrics:\n{text}"
        values.append(float(found.group(1)))
    return tuple(values)


def chat_checkpoint(directory: Path) -> Path:
    """A tiny Mixtral written by ``transformers`` (the oracle's), with a tokenizer of a character per id and a
    chat template."""
    from helpers.chars import CHAT_TEMPLATE, write_char_tokenizer
    from helpers.oracle import VOCAB, write_checkpoint

    write_checkpoint(directory, "mixtral")
    return write_char_tokenizer(directory, VOCAB, CHAT_TEMPLATE)
