"""Starting a served model's ranks, for the demo and the HTTP server alike: what every rank is asked to do,
checked before any rank starts; the ranks run here (one), under torchrun, or as local processes; one exit status.

Exit status: what the ranks' function says (0, or 1 after its one ``error:`` line); 2 with one
``error: ...`` line when the run could not start (torch missing, a bad argument, a checkpoint
that cannot be served, a link that could not be set up); 130 with the one line ``interrupted``
on Ctrl-C, once every rank has gone.  A worker rank that ended otherwise than with 0 makes it 1
(``error: worker rank exit codes [...]``), unless the head recovered from its loss: the head's
function returns the worker ranks whose loss its run recovered from, the head's process sends them
to this launcher over a pipe of their own, and the launcher's last line names them (``worker rank(s)
[3] lost and recovered from ...``) instead of failing the run.  Under torchrun, its agent decides.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Final, TypeVar

from .._core.errors import EpSetupError
from .._core.protocol import ProtocolVersion
from .._host.launch import INTERRUPTED, stop_resource_tracker
from .choices import (
    check_memory,
    cuda_devices,
    device_and_backend,
    kv_memory,
    open_checkpoint,
    under_torchrun_env,
)

if TYPE_CHECKING:
    from ..reference import Checkpoint, Recovery, ReferenceLm

RANK_0_SAYS_WHY_S: Final = 2.0
"""How long a rank other than 0 that cannot start waits under torchrun before it exits (see ``_cannot_start``)."""
W = TypeVar("W")
"""What every rank is asked to do: picklable, for spawned ranks."""


@dataclass(frozen=True)
class Start:
    """What the start chose, before any rank exists: the work is made from it."""

    args: argparse.Namespace
    checkpoint: Checkpoint
    """Opened and checked against the world size."""
    protocol: ProtocolVersion
    device: str
    world_size: int
    local_ranks: int
    """The ranks on this host."""

    def kv_memory(self) -> int | float | None:
        """Each rank's KV memory (``--kv-memory``, or its default: ``kv_memory``), once this host is checked, on
        the CPU, to hold its ranks' weights and KV caches (``--dtype``, ``--slots``).

        Raises:
            ValueError: it does not; the message is the line to print.
            OSError: the host's free memory cannot be read, for a fraction of it.
        """
        from ..reference.checkpoint import DTYPES

        dtype = self.checkpoint.dtype if self.args.dtype is None else DTYPES[self.args.dtype]
        per_rank = kv_memory(
            self.checkpoint, dtype, self.args.kv_memory, self.device, self.world_size, self.local_ranks
        )
        if self.device == "cpu":
            kv_bytes = per_rank if isinstance(per_rank, int) else None
            check_memory(self.checkpoint, dtype, self.args.slots, self.world_size, self.local_ranks, kv_bytes)
        return per_rank


MakeWork = Callable[[Start], W]
"""``make_work(start)``: the work, or a ``ValueError`` whose message is the line to print."""
Target = Callable[[int, int, W], Sequence[int] | None]
"""``target(rank, world_size, work)``: one rank's part; the head's returns the worker ranks whose loss its run
recovered from (``recovered_ranks``), ``None`` or empty when none was lost."""


def recovered_ranks(recoveries: Sequence[Recovery]) -> list[int]:
    """The worker ranks that a server's ``recoveries`` (in order) lost, as they were numbered at the start of the run.

    Each recovery names its lost ranks in the numbering of the epoch before it, and ``Recovery.ranks`` maps the
    epoch after it back to that one.
    """
    if not recoveries:
        return []
    first = list(range(recoveries[0].ranks_before))  # by rank in the epoch now, its rank at the start
    lost: list[int] = []
    for recovery in recoveries:
        lost += [first[gone.rank] for gone in recovery.lost]
        first = [first[rank] for rank in recovery.ranks]
    return sorted(lost)


def ranks_line(
    model: ReferenceLm, name: str, pids: Sequence[int], *, slots: int, prefill_chunk: int, cuda_graphs: bool
) -> str:
    """The head's first line: the model, where it runs, the ranks and their pids, the slots and the KV cache."""
    link = model.ep_link
    checkpoint = model.checkpoint
    ranks = f"{link.world_size} ranks over {type(link.transport).__name__}" if model.is_ep() else "1 rank"
    graphs = ", CUDA graphs" if cuda_graphs else ""
    pool = model.pool
    cache = sum(block.attn.kv_cache.nbytes for block in model.lm.blocks())
    return (
        f"[head] {checkpoint.family.architecture} from {name} ({sum(p.numel() for p in model.lm.parameters()):,} "
        f"parameters on this rank, {str(model.lm.embed.dtype).removeprefix('torch.')}, on {model.lm.embed.device}"
        f"{graphs}), {ranks}, protocol {link.protocol.value}; {slots} slots of up to {model.config.max_seq_len} "
        f"positions, a KV cache of {pool.num_blocks:,} blocks of {pool.block_size} ({cache / 2**20:,.1f} MiB on "
        f"this rank), prefill chunks of {prefill_chunk}; pids {' '.join(map(str, pids))}"
    )


def run(parse: Callable[[], argparse.Namespace], make_work: MakeWork[W], target: Target[W]) -> int:
    """Parse the arguments, check the work, run ``target(rank, world_size, work)`` on every rank: the exit status."""
    try:
        with _interrupts_end_it_at_once():  # the start: reading the arguments imports torch, for seconds
            args = parse()
            started = _start(args, make_work)
        if isinstance(started, int):
            return started
        work, backend = started
        return _launch(args.world_size, target, work, backend)
    except KeyboardInterrupt:  # Ctrl-C, from its first moment (torch imports for seconds): one line
        return interrupted()
    finally:  # its ranks have ended (run_group waits for them); the helper their start made goes too
        stop_resource_tracker()


def _start(args: argparse.Namespace, make_work: MakeWork[W]) -> tuple[W, str] | int:
    """What every rank is asked to do, and the backend; or the exit status of a run that cannot start."""
    try:
        from .. import torch  # noqa: F401  (first: without torch, its ImportError says what to install)

        protocol = ProtocolVersion(args.protocol) if args.protocol else ProtocolVersion.from_env()
        torchrun = under_torchrun_env()
        world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
        checkpoint = open_checkpoint(args.model, args.max_seq_len, world_size)
        device, backend = device_and_backend(args, local_ranks, cuda_devices(), checkpoint.config.world_sizes())
        work = make_work(Start(args, checkpoint, protocol, device, world_size, local_ranks))
    except (ImportError, ValueError, OSError) as error:
        return _cannot_start(error)
    return work, backend


def _launch(world_size: int, target: Target[W], work: W, backend: str) -> int:
    try:
        if under_torchrun_env():
            return _under_torchrun(backend, target, work)
        if world_size == 1:
            return _exit_code(lambda: target(0, 1, work))
        from ..torch import run_group

        heard, told = Pipe(duplex=False)  # the head's word to this launcher: the ranks it recovered from
        with heard, told:
            codes = run_group(_telling, world_size, target, work, told, backend=backend)
            recovered: list[int] = heard.recv() if heard.poll() else []
    except EpSetupError as error:  # the ranks' link could not be set up; they exited 2 without a word
        return _cannot_start(error)
    if INTERRUPTED in codes:  # a rank was interrupted (a signal to the ranks alone)
        return interrupted()
    return verdict(codes, recovered)


def _telling(rank: int, world_size: int, target: Target[W], work: W, launcher: Connection) -> None:
    """One rank's part under ``_launch``: ``target``'s; then the head tells ``launcher`` the ranks it recovered from."""
    try:
        recovered = target(rank, world_size, work)
        if rank == 0 and recovered:
            launcher.send(sorted(recovered))
    finally:
        launcher.close()


def verdict(codes: Sequence[int], recovered: Sequence[int]) -> int:
    """The exit status of a run whose ranks exited with ``codes`` (by rank), its head having recovered from the loss
    of the worker ranks ``recovered``; when the head exited 0, a last line on the workers.

    0 when every rank exited 0 but those the head recovered from (the line names them, on stdout); else 1, and
    when the head said nothing (it exited 0), ``error: worker rank exit codes [...]`` names the workers' codes.
    """
    failed = [rank for rank, code in enumerate(codes) if code and rank not in recovered]
    if codes[0] == 0 and failed:
        also = f"; worker rank(s) {list(recovered)} lost and recovered from" if recovered else ""
        print(f"error: worker rank exit codes {list(codes[1:])}{also}", file=sys.stderr)
    elif codes[0] == 0 and recovered:
        print(
            f"worker rank(s) {list(recovered)} lost and recovered from: the run went on over the ranks left "
            f"(worker rank exit codes {list(codes[1:])})",
            flush=True,
        )
    return 1 if failed else 0


@contextmanager
def _interrupts_end_it_at_once() -> Iterator[None]:
    """While the block runs (the start, before any rank exists), Ctrl-C ends the process at once.

    The start imports torch (seconds), whose import can swallow the
    ``KeyboardInterrupt`` raised inside it (seen: the demo then ran to its end as
    if no Ctrl-C had come).  Nothing is held yet: the one line, and exit 130.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    previous = signal.signal(signal.SIGINT, _leave_at_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _leave_at_once(signum: int, frame: object) -> None:
    interrupted()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


def interrupted() -> int:
    """Say that the run was interrupted, in one line (under torchrun, from rank 0 alone), and return 130.

    A second Ctrl-C is ignored from here on: the program is leaving, with no traceback.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(os.environ.get("RANK", "0")) == 0:
        print("interrupted", file=sys.stderr)
    return INTERRUPTED


def _cannot_start(error: Exception) -> int:
    """Say why the run could not start, in one line (under torchrun, from rank 0 alone), and return 2.

    Under torchrun another rank returns only ``RANK_0_SAYS_WHY_S`` seconds later: torchrun's agent
    ends every rank once one has exited, and rank 0, held up by the same check, would else be
    ended before it said why.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {error}", file=sys.stderr)
    elif under_torchrun_env():
        time.sleep(RANK_0_SAYS_WHY_S)
    return 2


def _exit_code(run: Callable[[], object]) -> int:
    try:
        run()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except KeyboardInterrupt:
        return interrupted()
    return 0


def _under_torchrun(backend: str | None, target: Target[W], work: W) -> int:
    import torch.distributed as dist

    from ..torch import init_group_from_env

    init_group_from_env(backend=backend)
    try:
        return _exit_code(lambda: target(dist.get_rank(), dist.get_world_size(), work))
    finally:
        dist.destroy_process_group()
