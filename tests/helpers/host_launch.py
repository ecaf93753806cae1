"""A simulated host's launcher: its ranks forked with torchrun's variables, each exit code reported.

``python -m helpers.host_launch HOSTS HOST RANKS_PER_HOST HEAD_ADDRESS PORT PRELOAD -- ARGS...``
imports the comma-separated modules of ``PRELOAD`` once (``-``: none), then forks
``RANKS_PER_HOST`` ranks (``HOST * RANKS_PER_HOST ..``), each running what
``python ARGS...`` runs (``-m MODULE ...`` or ``SCRIPT ...``) as ``__main__`` and ending
through the interpreter's own exit, as a program started afresh ends: only the
preloaded imports (torch's: about a second of CPU each) are shared, frozen out of the
garbage collector (``gc.freeze``) so that a rank's collections, its exit's included,
skip them instead of copying their pages (half a second of CPU an exit).  It waits for
every rank and prints ``exit codes {rank: code, ...}`` as its last line.  Unlike
torchrun's agent, it never stops a rank because another failed: the tests check that
each rank ends by itself.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

from helpers.as_main import run_as_main


def run_rank(env: dict[str, str], args: list[str]) -> None:
    """In a forked rank: what ``python ARGS...`` runs, with ``env`` added to the environment."""
    os.environ.update(env)
    run_as_main(args)


def main(argv: list[str]) -> None:
    hosts, host, per_host, head_address, port, preload = argv[:6]
    args = argv[7:]
    first = int(host) * int(per_host)
    world = {"WORLD_SIZE": str(int(hosts) * int(per_host)), "LOCAL_WORLD_SIZE": per_host, "GROUP_RANK": host}
    world |= {"MASTER_ADDR": head_address, "MASTER_PORT": port}
    os.environ["OMP_NUM_THREADS"] = "1"  # read once, as torch is imported: before the preload
    for module in filter(None, preload.removeprefix("-").split(",")):
        importlib.import_module(module)
    gc.freeze()  # what the ranks share with this process: never collected in one
    ranks = {}
    for local in range(int(per_host)):
        sys.stdout.flush()  # nothing buffered here may be written twice, once by the rank
        pid = os.fork()
        if pid == 0:
            run_rank({**world, "RANK": str(first + local), "LOCAL_RANK": str(local)}, args)
            raise SystemExit(0)  # ends the rank like a program whose script ran to its end
        ranks[first + local] = pid
    codes = {rank: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for rank, pid in ranks.items()}
    print(f"exit codes {codes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
