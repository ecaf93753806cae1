"""A multi-rank model over shared memory, without torch: three local ranks share one ring.

python examples/shm_local.py

Each rank prints its slots' digest, the same on all three.  Exit code 0; 2 with one
``error: ...`` line when the ring cannot be set up (too little ``/dev/shm``, say);
130 with the line ``interrupted`` on Ctrl-C.
"""

import sys

from metrale_model_engine import EpLink, EpSetupError, ProtocolVersion, run_worker
from metrale_model_engine.shm import ShmTransport, run_ring
from metrale_model_engine.toy import ToyModel, ToyState, slots_digest


def serve(transport: ShmTransport) -> None:
    model = ToyModel(EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2))  # collective: every rank
    slots: list[ToyState | None] = [None] * 4
    if transport.rank == 0:
        model.alloc(slots, 1)
        model.prefill(slots, 1, list(range(100_000)))  # 400 KB: one message, four records of the ring
        for _ in range(3):
            model.decode(slots, 1)
        model.ep_link.shutdown_workers()  # a sync point: raises if a worker failed a command or diverged
    elif run_worker(model, slots).commands_failed:
        raise SystemExit(1)  # exit codes tell the truth
    print(f"rank {transport.rank}: slot digest {slots_digest(slots)}\n", end="", flush=True)  # one write per line


def main() -> None:
    codes = run_ring(serve, 3)  # spawned processes; rank 0 creates the ring, the others attach
    if any(codes):
        raise SystemExit(f"rank exit codes {codes}")


if __name__ == "__main__":
    try:
        main()
    except EpSetupError as error:  # no ring (too little /dev/shm, say): the ranks said nothing, run_ring says why
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C: the ranks left quietly (run_ring ended any that lingered)
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
