"""A simulated host's launcher: its ranks started with torchrun's variables, each exit code reported.

``python -m helpers.host_launch HOSTS HOST RANKS_PER_HOST HEAD_ADDRESS PORT -- COMMAND...``
starts ``RANKS_PER_HOST`` copies of ``COMMAND`` (ranks ``HOST * RANKS_PER_HOST ..``),
waits for every one and prints ``exit codes {rank: code, ...}`` as its last line.
Unlike torchrun's agent, it never stops a rank because another failed: the tests
check that each rank ends by itself.  Imports nothing but the standard library.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> None:
    hosts, host, per_host, head_address, port = argv[:5]
    command = argv[6:]
    first = int(host) * int(per_host)
    world = {"WORLD_SIZE": str(int(hosts) * int(per_host)), "LOCAL_WORLD_SIZE": per_host, "GROUP_RANK": host}
    world |= {"MASTER_ADDR": head_address, "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    ranks = {
        first + local: subprocess.Popen(
            command, env={**os.environ, **world, "RANK": str(first + local), "LOCAL_RANK": str(local)}
        )
        for local in range(int(per_host))
    }
    codes = {rank: process.wait() for rank, process in ranks.items()}
    print(f"exit codes {codes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
