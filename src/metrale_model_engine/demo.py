"""The demo: a toy multi-rank model serving interleaved sequences over torch.distributed.

Run ``python -m metrale_model_engine.demo`` (2 local gloo ranks by default), or
under ``torchrun --nproc-per-node N -m metrale_model_engine.demo``.  The head
allocates ``--sequences`` slots, prefills each with a ``--prompt-tokens`` prompt,
decodes them in turn and frees them; the workers run
:func:`~metrale_model_engine.run_worker`.  It ends with a summary (commands, words
and tokens broadcast, wall time, per-command latency on the head; ``--json PATH``
writes it too) and every rank's digest of its slot states: exit 0 when all agree,
1 with a message when they do not, 2 with one ``error: ...`` line when torch is
missing or an argument or ``METRALE_EP_PROTOCOL`` is bad.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO, TypeVar

from ._protocol import ProtocolVersion
from ._tokens import TokenArray, token_count
from ._worker import run_worker
from .toy import ToyModel, ToySlots, ToyState, slots_digest

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DETAILED_ITEMS = 4
"""Sequences and decode steps shown one line each; past them, progress only."""
R = TypeVar("R")
_PROGRESS_SECONDS = 1.0
"""How often a non-terminal output gets a progress line."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m metrale_model_engine.demo", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--world-size", type=_positive, default=2, help="local ranks to spawn (default 2; ignored under torchrun)")
    versions = [p.value for p in ProtocolVersion]
    add("--protocol", choices=versions, default=None, help="default: METRALE_EP_PROTOCOL, else v1")
    add("--sequences", type=_positive, default=4, help="interleaved sequences, one slot each (default 4)")
    add("--prompt-tokens", type=_positive, default=16, help="tokens in each prompt (default 16)")
    add("--decode-steps", type=_positive, default=8, help="decode steps per sequence (default 8)")
    add(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with a CUDA device per rank, else gloo"
    )
    add(
        "--transport",
        choices=["auto", "shm", "torch"],
        default="auto",
        help="what carries the commands: shared memory (shm), the backend (torch), or shm when all ranks share "
        "a host (auto, the default)",
    )
    add("--json", type=Path, default=None, metavar="PATH", help="also write the head's summary to PATH as JSON")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Work:
    """What every rank is asked to do (picklable, for spawned ranks)."""

    protocol: ProtocolVersion
    transport: str
    sequences: int
    prompt_tokens: int
    decode_steps: int
    json_path: Path | None


def prompt_for(seq_id: int, length: int) -> list[int]:
    """A deterministic prompt of ``length`` tokens for sequence ``seq_id``."""
    return [(seq_id * 7919 + i * 104_729) % 32_000 for i in range(length)]


@dataclass
class Traffic:
    """What the head sent, counted at the trait's broadcast methods."""

    commands: int = 0
    words: int = 0
    tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    """Seconds per command as the head saw it, checks and broadcasts included."""


class CountingToy(ToyModel):
    """The toy model, counting every command, follow-up word and token the head sends."""

    __slots__ = ("traffic",)

    traffic: Traffic

    def alloc(self, slots: ToySlots, seq_id: int) -> None:
        super().alloc(slots, seq_id)
        self.traffic.commands += 1

    def prefill(self, slots: ToySlots, seq_id: int, prompt: TokenArray) -> None:
        super().prefill(slots, seq_id, prompt)
        self.traffic.commands += 1
        self.traffic.tokens += token_count(prompt)

    def decode(self, slots: ToySlots, seq_id: int) -> int:
        token = super().decode(slots, seq_id)
        self.traffic.commands += 1
        self.traffic.words += 1
        return token

    def free(self, slots: ToySlots, seq_id: int) -> None:
        super().free(slots, seq_id)
        self.traffic.commands += 1


def serve(rank: int, world_size: int, work: Work) -> None:
    """One rank's part: build the model, drive (head) or serve (worker), compare digests."""
    import torch.distributed as dist

    from .torch import open_link

    with CountingToy(open_link(work.transport, num_slots=work.sequences, protocol=work.protocol)) as model:
        model.traffic = Traffic()
        slots: list[ToyState | None] = [None] * work.sequences
        if rank == 0:
            started = time.perf_counter()
            _drive(model, slots, work)
            summary = _summary(model, time.perf_counter() - started, dist.get_backend())
            _print_summary(summary)
            if work.json_path is not None:
                work.json_path.write_text(json.dumps(summary, indent=1) + "\n")
        else:
            served = run_worker(model, slots)
            _say(f"[worker {rank}] served {served.commands_run} commands, {served.commands_failed} failed")
    digests: list[object] = [None] * world_size
    dist.all_gather_object(digests, slots_digest(slots))
    if rank == 0:
        for other, digest in enumerate(digests):
            _say(f"[rank {other}] slot digest {digest}")
    problem = digests_disagree(digests)
    if problem is not None:
        if rank == 0:
            _say(f"error: {problem}", sys.stderr)
        raise SystemExit(1)
    if rank == 0:
        _say(f"all {world_size} ranks agree")


def digests_disagree(digests: Sequence[object]) -> str | None:
    """``None`` when every rank's digest is rank 0's, else a message naming the first that differs."""
    for rank, digest in enumerate(digests):
        if digest != digests[0]:
            return f"the ranks' slot states differ: rank {rank} has {digest}, rank 0 has {digests[0]}"
    return None


def _say(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` to ``stream`` (default stdout) in one write and flush it: the ranks
    share the terminal, and ``print`` writes the newline separately, which lets another
    rank's line in between."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()


class _Progress:
    """One line per item for the first few, then a progress line: in place on a terminal, else periodic."""

    def __init__(self, total: int, label: str) -> None:
        self._total, self._label = total, label
        self._tty = sys.stdout.isatty()
        self._last = time.monotonic()

    def item(self, done: int, detail: str) -> None:
        if done <= _DETAILED_ITEMS:
            _say(f"[head] {detail}")
            return
        now = time.monotonic()
        if self._tty:
            end = "\n" if done == self._total else ""
            print(f"\r[head] {self._label}: {done}/{self._total}", end=end, flush=True)
        elif done == self._total or now - self._last >= _PROGRESS_SECONDS:
            _say(f"[head] {self._label}: {done}/{self._total}")
            self._last = now


def _drive(model: CountingToy, slots: MutableSequence[ToyState | None], work: Work) -> None:
    count, latencies = len(slots), model.traffic.latencies_s
    _say(
        f"[head] {model.ep_link.world_size} ranks, protocol {model.ep_link.protocol.value}, {count} sequences x "
        f"{work.prompt_tokens}-token prompts x {work.decode_steps} decode steps"
    )

    progress = _Progress(count, "alloc + prefill")
    for seq_id in range(count):
        prompt = prompt_for(seq_id, work.prompt_tokens)
        _timed(latencies, partial(model.alloc, slots, seq_id))
        _timed(latencies, partial(model.prefill, slots, seq_id, prompt))
        progress.item(seq_id + 1, f"seq {seq_id}: alloc + prefill {len(prompt)} tokens")
    progress = _Progress(work.decode_steps, "decode steps")
    for step in range(1, work.decode_steps + 1):
        tokens = []
        for seq_id in range(count):
            tokens.append(_timed(latencies, partial(model.decode, slots, seq_id)))
        shown = tokens if len(tokens) <= 8 else [*tokens[:8], "..."]
        progress.item(step, f"decode step {step}/{work.decode_steps}: {shown}")
    for seq_id in range(count - 1):  # the last sequence stays live, so digests cover a slot
        _timed(latencies, partial(model.free, slots, seq_id))
    _say(f"[head] freed {count - 1} sequences; shutting the workers down")
    model.ep_link.shutdown_workers()


def _timed(latencies: list[float], command: Callable[[], R]) -> R:
    """Run one head command, appending its duration in seconds to ``latencies``."""
    started = time.perf_counter()
    result = command()
    latencies.append(time.perf_counter() - started)
    return result


def _summary(model: CountingToy, wall_s: float, backend: str) -> dict[str, object]:
    traffic = model.traffic
    latencies = sorted(traffic.latencies_s)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "ranks": model.ep_link.world_size,
        "protocol": model.ep_link.protocol.value,
        "transport": type(model.ep_link.transport).__name__,
        "backend": backend,
        "commands": traffic.commands,
        "words": traffic.words,
        "tokens": traffic.tokens,
        "wall_s": round(wall_s, 4),
        "command_latency_us": {
            "median": round(statistics.median(latencies) * 1e6, 1),
            "p99": round(p99 * 1e6, 1),
        },
    }


def _print_summary(summary: dict[str, object]) -> None:
    latency = summary["command_latency_us"]
    assert isinstance(latency, dict)
    _say(
        f"[head] summary: {summary['commands']} commands, {summary['words']} follow-up words, "
        f"{summary['tokens']} tokens broadcast in {summary['wall_s']:.3f} s; per command on the head: "
        f"median {latency['median']:.0f} us, p99 {latency['p99']:.0f} us "
        f"({summary['transport']} over {summary['backend']})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    speaks = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 alone reports errors
    try:
        from . import torch as ep_torch
    except ImportError as error:
        if speaks:
            print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        protocol = ProtocolVersion(args.protocol) if args.protocol else ProtocolVersion.from_env()
        if args.backend == "nccl" and not ep_torch.cuda_available():
            raise ValueError("--backend nccl needs a CUDA device, and this machine has none; use --backend gloo")
    except ValueError as error:
        if speaks:
            print(f"error: {error}", file=sys.stderr)
        return 2
    work = Work(protocol, args.transport, args.sequences, args.prompt_tokens, args.decode_steps, args.json)
    if all(name in os.environ for name in _TORCHRUN_VARS):
        return _under_torchrun(args.backend, work)
    codes = ep_torch.run_group(serve, args.world_size, work, backend=args.backend)
    if any(codes):
        print(f"error: rank exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def _under_torchrun(backend: str | None, work: Work) -> int:
    import torch.distributed as dist

    from .torch import init_group_from_env

    init_group_from_env(backend=backend)
    try:
        serve(dist.get_rank(), dist.get_world_size(), work)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
