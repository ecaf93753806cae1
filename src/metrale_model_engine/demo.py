"""The demo: a toy multi-rank model serving interleaved sequences over torch.distributed.

Run ``python -m metrale_model_engine.demo`` (2 local gloo ranks by default), or
under ``torchrun --nproc-per-node N -m metrale_model_engine.demo``.  The head
allocates ``--sequences`` slots, prefills each with its prompt, decodes them in
turn and frees them; the workers run :func:`~metrale_model_engine.run_worker`.  At
the end every rank's digest of its slot states is compared: exit 0 when all agree,
1 with a message when they do not, 2 when torch is missing or an argument is bad.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._protocol import EpProtocol
from ._worker import run_worker
from .toy import ToyModel, ToyState, slots_digest

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m metrale_model_engine.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world-size", type=_positive, default=2, help="local ranks to spawn (default 2; ignored under torchrun)"
    )
    parser.add_argument(
        "--protocol", choices=[p.value for p in EpProtocol], default=None, help="default: METRALE_EP_PROTOCOL, else v1"
    )
    parser.add_argument(
        "--sequences", type=_positive, default=4, help="interleaved sequences, one slot each (default 4)"
    )
    parser.add_argument("--decode-steps", type=_positive, default=8, help="decode steps per sequence (default 8)")
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with a CUDA device per rank, else gloo"
    )
    return parser.parse_args(argv)


def prompt_for(seq_id: int) -> list[int]:
    """A deterministic prompt of 3 + seq_id tokens."""
    return [(seq_id * 7919 + i * 104_729) % 32_000 for i in range(3 + seq_id)]


def serve(rank: int, world_size: int, protocol: EpProtocol, sequences: int, decode_steps: int) -> None:
    """One rank's part: build the model, drive (head) or serve (worker), compare digests."""
    import torch.distributed as dist

    from .torch import TorchTransport

    model = ToyModel(TorchTransport(), num_slots=sequences, protocol=protocol)
    slots: list[ToyState | None] = [None] * sequences
    if rank == 0:
        _drive(model, slots, decode_steps)
    else:
        summary = run_worker(model, slots)
        print(f"[worker {rank}] served {summary.commands_run} commands, {summary.commands_failed} failed", flush=True)
    digests: list[object] = [None] * world_size
    dist.all_gather_object(digests, slots_digest(slots))
    if rank == 0:
        for other, digest in enumerate(digests):
            print(f"[rank {other}] slot digest {digest}", flush=True)
    problem = digests_disagree(digests)
    if problem is not None:
        if rank == 0:
            print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if rank == 0:
        print(f"all {world_size} ranks agree", flush=True)


def digests_disagree(digests: Sequence[object]) -> str | None:
    """``None`` when every rank's digest is rank 0's, else a message naming the first that differs."""
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            return f"the ranks' slot states differ: rank {rank} has {digest}, rank 0 has {digests[0]}"
    return None


def _drive(model: ToyModel, slots: list[ToyState | None], decode_steps: int) -> None:
    count = len(slots)
    print(
        f"[head] {model.world_size} ranks, protocol {model.protocol.value}, "
        f"{count} sequences x {decode_steps} decode steps",
        flush=True,
    )
    for seq_id in range(count):
        model.alloc(slots, seq_id)
        prompt = prompt_for(seq_id)
        model.prefill(slots, seq_id, prompt)
        print(f"[head] seq {seq_id}: alloc + prefill {len(prompt)} tokens", flush=True)
    for step in range(1, decode_steps + 1):
        tokens = [model.decode(slots, seq_id) for seq_id in range(count)]
        if step == decode_steps or step % max(1, decode_steps // 4) == 0:
            print(f"[head] decode step {step}/{decode_steps}: {tokens}", flush=True)
    for seq_id in range(count - 1):  # the last sequence stays live, so digests cover a slot
        model.free(slots, seq_id)
    print(f"[head] freed {count - 1} sequences; shutting the workers down", flush=True)
    model.ep_shutdown_workers()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from . import torch as ep_torch
    except ImportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    protocol = EpProtocol(args.protocol) if args.protocol else EpProtocol.from_env()
    work = (protocol, args.sequences, args.decode_steps)
    if all(name in os.environ for name in _TORCHRUN_VARS):
        return _under_torchrun(args.backend, work)
    codes = ep_torch.run_local(serve, args.world_size, *work, backend=args.backend)
    if any(codes):
        print(f"error: rank exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def _under_torchrun(backend: str | None, work: tuple[EpProtocol, int, int]) -> int:
    import torch.distributed as dist

    from .torch import init_group_from_env

    init_group_from_env(backend=backend)
    try:
        serve(dist.get_rank(), dist.get_world_size(), *work)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
