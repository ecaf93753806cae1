"""Hosts simulated on this machine, for the tests that cross a host boundary.

A simulated host is what a process on another machine (or in another container)
sees differently from the head's:

* its own network namespace, whose one interface (``eth0``, address ``10.77.0.<i+1>``)
  plugs into a bridge that lives in a namespace of its own: the hosts reach each
  other and nothing else, so no test traffic touches this machine's network;
* its own mount namespace, with a fresh ``/dev/shm`` (shared memory is per host)
  and an ``/etc/hosts`` that names every host (as a cluster's resolver would);
* its own pid namespace (pids of one host mean nothing on another) and hostname.

Ranks are started in a host as on a real machine: one command per host
(``torchrun --nnodes ... --node-rank i``, or :mod:`helpers.host_launch`, which
forks them), whose whole process tree dies with the host.  The command is forked
from the program server (:mod:`helpers.programs`: torch imported once) into the
host's namespaces (:mod:`helpers.isolation`: what ``ip netns exec`` and ``unshare
--fork --kill-child --mount-proc`` do).  Cutting a host's cable is ``ip link set
... down`` on its bridge port.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not when one is missing.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from helpers import programs
from helpers.isolation import Isolation

SUBNET = "10.77.0"
"""The hosts' network: host ``i`` is ``10.77.0.<i+1>``, inside the bridge's namespace only."""
RENDEZVOUS_PORT = 29500
"""torchrun's port on the head's host (each run has fresh namespaces, so it is always free)."""
KILL_BOUND = 10.0
"""Seconds a killed host's processes may take to end (each process frees its memory, torch's included, as it ends)."""
TESTS = Path(__file__).resolve().parents[1]
PRELOAD = ("torch.distributed", "metrale_model_engine.torch")
"""What a host's launcher imports once for its ranks (:meth:`SimulatedHosts.ranks`)."""


def unavailable() -> str | None:
    """Why hosts cannot be simulated here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces and mounts), as CI runs"
    if shutil.which("ip") is None:
        return "simulated hosts need ip (iproute2)"
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, address, and the bridge port its cable plugs into."""

    index: int
    namespace: str
    port: str

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index + 1}"

    @property
    def name(self) -> str:
        return f"host{self.index}"


class SimulatedHosts:
    """``count`` hosts joined by one bridge; a context manager that removes every trace on exit.

    Each :meth:`start` runs one command as the host's first process; leaving the
    block kills what still runs (every process of a host dies with its first) and
    deletes the namespaces.
    """

    def __init__(self, count: int) -> None:
        tag = f"mtl{os.getpid()}"
        self.switch = f"{tag}-switch"
        self.hosts = [Host(index, f"{tag}-h{index}", f"m{os.getpid()}p{index}") for index in range(count)]
        self._processes: list[programs.Popen] = []
        self._host_of: dict[int, Host] = {}  # by the pid of a host's first process
        self._files = tempfile.TemporaryDirectory(prefix="metrale-hosts-")

    def __enter__(self) -> SimulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "bridge", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "bridge", "up")
        names = "".join(f"{host.address} {host.name}\n" for host in self.hosts)
        Path(self._files.name, "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            inside = f"{host.port}i"
            _ip("link", "add", inside, "type", "veth", "peer", "name", host.port)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("link", "set", host.port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", host.port, "master", "bridge", "up")
            _ip("-n", host.namespace, "link", "set", inside, "name", "eth0")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def start(self, index: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> programs.Popen:
        """Run ``argv`` (this interpreter's) as host ``index``'s first process (stdout and stderr piped, as text),
        forked from the program server into the host's namespaces (``helpers.isolation``)."""
        host = self.hosts[index]
        isolation: Isolation = {
            "netns": host.namespace,
            "hostname": host.name,
            "shm": "mode=1777",
            "binds": [(str(Path(self._files.name, "hosts")), "/etc/hosts")],
            "pid": True,
        }
        process = programs.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            isolate=isolation,
        )
        self._processes.append(process)
        self._host_of[process.pid] = host
        return process

    def torchrun(
        self, index: int, ranks_per_host: int, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> programs.Popen:
        """Start ``ranks_per_host`` ranks of ``python argv`` on host ``index`` with torchrun, the head on host 0."""
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(self.hosts)}"]
        command += [f"--node-rank={index}", f"--nproc-per-node={ranks_per_host}"]
        command += [f"--master-addr={self.hosts[0].address}", f"--master-port={RENDEZVOUS_PORT}", *argv]
        return self.start(index, command, {"OMP_NUM_THREADS": "1", "PYTHONPATH": self._python_path(), **(env or {})})

    def ranks(
        self,
        index: int,
        ranks_per_host: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = PRELOAD,
    ) -> programs.Popen:
        """Start ``ranks_per_host`` ranks of ``python argv`` on host ``index`` (:mod:`helpers.host_launch`).

        The host's launcher imports ``preload`` once and forks its ranks from itself.
        The last line of the process's stdout is ``exit codes {rank: code, ...}``.
        """
        command = [sys.executable, "-m", "helpers.host_launch", str(len(self.hosts)), str(index)]
        command += [str(ranks_per_host), self.hosts[0].address, str(RENDEZVOUS_PORT), ",".join(preload) or "-"]
        command += ["--", *argv]
        return self.start(index, command, {"PYTHONPATH": self._python_path(), **(env or {})})

    def _python_path(self) -> str:
        return os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))

    def cut(self, index: int) -> None:
        """Unplug host ``index``'s cable: nothing reaches it or leaves it, and nobody is told."""
        _ip("-n", self.switch, "link", "set", self.hosts[index].port, "down")

    def kill_all(self, process: programs.Popen, bound: float = KILL_BOUND) -> None:
        """Kill a host's first process, and so every process of that host; return once none is left.

        Their sockets close, so peers learn of it at once; a machine losing power
        closes nothing, which :meth:`cut` plays.  The kernel kills the host's
        processes after its first one, as the host's pid namespace ends, so the
        host is still running when the signal is sent: a test that goes on at once
        (telling the head that the host is gone) would race its ranks, which can
        still answer a command or two.  So this waits until no process is left in
        the host's network namespace (``bound`` seconds at most, else
        ``AssertionError`` naming the pids left).
        """
        namespace = self._host_of[process.pid].namespace
        process.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + bound
        while left := _pids_in(namespace):
            assert time.monotonic() < deadline, f"host {namespace}: pids {left} still ran {bound} s after its kill"
            time.sleep(0.005)

    def close(self) -> None:
        """Kill what still runs, then delete the namespaces and the files."""
        for process in self._processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        for namespace in [*(host.namespace for host in self.hosts), self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._files.cleanup()


def exit_codes(stdout: str) -> dict[int, int]:
    """The last line of :meth:`SimulatedHosts.ranks`' stdout, ``exit codes {rank: code, ...}``, as a dict."""
    last = stdout.splitlines()[-1] if stdout else ""
    assert last.startswith("exit codes "), stdout
    codes: dict[int, int] = ast.literal_eval(last.removeprefix("exit codes "))
    return codes


def _pids_in(namespace: str) -> list[int]:
    """The processes of this machine in the network namespace ``namespace`` (as ``ip netns pids`` lists them).

    A process that has ended leaves its namespaces before its parent reaps it (its sockets closed before that), so
    a zombie is not listed.
    """
    inode = os.stat(f"/run/netns/{namespace}").st_ino
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # ended meanwhile, or a zombie: no namespace left
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino == inode:
                    pids.append(int(entry.name))
    return pids


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
