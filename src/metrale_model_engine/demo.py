"""The main job: a MoE transformer from a checkpoint in the Hugging Face layout, served over the protocol by
several ranks.

Run ``python -m metrale_model_engine.demo`` (2 local ranks by default), or under
``torchrun --nproc-per-node N -m metrale_model_engine.demo``.  Every rank opens the
checkpoint (``--model DIR``, a ``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM``;
default the shipped model, [`SHIPPED_MODEL`][metrale_model_engine.reference.SHIPPED_MODEL])
and reads its own shard: its query and KV heads and its experts.  The head serves
the prompts (``--prompt TEXT``, encoded by the model's ``tokenizer.json``, and
``--prompt-ids 1,2,3``; by default a handful from the project's license texts, two of
which arrive while the others run) with continuous batching, greedy unless
``--temperature`` says otherwise; the workers run
[`run_worker`][metrale_model_engine.run_worker].  It prints each request's prompt and
generated text (its ids, without a tokenizer), then tokens/s and how the head's
decode step splits into compute, collectives and protocol (``--json PATH`` writes it
all too).  Sync points compare every rank's KV bookkeeping as it goes and at the end.

Exit status: 0 when every rank served and agreed; 1 with one ``error: ...`` line
when the run failed (a rank died or diverged); 2 with one ``error: ...`` line when
it could not start: torch is missing, an argument or ``METRALE_EP_PROTOCOL`` is bad,
the checkpoint cannot be served (a missing or malformed file, an unsupported
architecture or field, a missing or misshapen tensor: the line names which and
where), the world size cannot split the model, a prompt is empty or outside the
vocabulary, the weights and KV caches would not fit the machine's memory, or the
ranks could not set up their link (``--transport shm`` with too little
``/dev/shm``, say; the line gives the root cause, once, whichever rank had it); 130
with the one line ``interrupted`` on Ctrl-C (SIGINT), once every rank has gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn, TextIO

from ._core.errors import EpSetupError
from ._core.namespace import PublicDir, public_dir
from ._core.protocol import ProtocolVersion
from ._demo_args import PROMPT_TEXT
from ._demo_args import parse_args as _parse_args
from ._demo_choices import (
    check_memory,
    cuda_devices,
    default_threads,
    device_and_backend,
    open_checkpoint,
    prompt_ids,
    under_torchrun_env,
)
from ._host.launch import INTERRUPTED, stop_resource_tracker

if TYPE_CHECKING:
    from . import EpLink
    from .reference import Checkpoint, Completion, ReferenceLm, Sampling

__all__ = ["LATE_PROMPTS", "LATE_STEP", "PROMPTS", "Work", "main", "parse_args", "serve"]

PROMPTS: Final[tuple[str, ...]] = (
    "Licensed under the",
    "Permission is hereby granted",
    "THE SOFTWARE IS PROVIDED",
    "you may not use this file",
    "Unless required by applicable law",
    "The above copyright notice",
)
"""What the demo asks by default; the last ``LATE_PROMPTS`` arrive at step ``LATE_STEP``, while the others
run.  Prompts given on the command line all arrive at once."""
LATE_PROMPTS: Final = 2
LATE_STEP: Final = 6
_ENDED: Final = {
    "stop": " (end of sequence)",
    "context": " (cut short: its slot's cache is full)",
    "error": " (failed)",
}
"""What a request's line adds when it did not end with its ``--max-new-tokens``."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's command line (``sys.argv[1:]`` by default); a bad argument exits 2 with one ``error:`` line.

    ``--json PATH`` is refused here when ``PATH``'s directory does not exist or ``PATH`` is a
    directory, not after the run; what needs the model is checked by ``main``, before any rank starts.
    """
    return _parse_args(argv, description=__doc__.split("\n\n")[0])


@dataclass(frozen=True)
class Work:
    """What every rank is asked to do (picklable, for spawned ranks)."""

    protocol: ProtocolVersion
    transport: str
    slots: int
    max_new_tokens: int
    prefill_chunk: int
    sync_every: int
    json_path: Path | None
    check_kv: bool = False
    device: str = "cpu"
    cuda_graphs: bool = False
    threads: int = 1
    model: Path | None = None
    """The checkpoint's directory; ``None``: the shipped model."""
    dtype: str | None = None
    """What the model runs in; ``None``: the checkpoint's own dtype."""
    max_seq_len: int | None = None
    prompts: tuple[tuple[int, ...], ...] = ()
    """The prompts, as token ids; the last ``late`` of them arrive at step ``LATE_STEP``."""
    late: int = 0
    sampling: Sampling | None = None
    """How every request picks its tokens; ``None``: greedy."""


def _say(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` in one write and flush it: the ranks share the terminal, and ``print`` writes the
    newline separately, which lets another rank's line in between."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()


def _fail(line: str) -> NoReturn:
    _say(line, sys.stderr)
    raise SystemExit(1)


class _OneLine(logging.Handler):
    """The worker loop's log, one line per record (the error, never a traceback)."""

    def __init__(self, rank: int) -> None:
        super().__init__(logging.INFO)
        self._rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        error = f": {record.exc_info[1]}" if record.exc_info and record.exc_info[1] else ""
        _say(f"[worker {self._rank}] {record.getMessage()}{error}", sys.stderr)


def serve(rank: int, world_size: int, work: Work) -> None:
    """One rank's part: build the model over a link, then drive it (head) or serve it (worker).

    Raises ``SystemExit(1)`` after one line on stderr when the run fails on this rank,
    and lets [`EpSetupError`][metrale_model_engine.EpSetupError] (the link's setup failed, the
    same on every rank) through, for ``main`` to report once.
    """
    import torch

    from .reference import LmState, ReferenceLm
    from .reference.checkpoint import DTYPES

    torch.set_num_threads(work.threads)
    device = None
    if work.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"]) if under_torchrun_env() else rank
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        model = ReferenceLm(
            _open_link(world_size, work),
            checkpoint=work.model,
            dtype=None if work.dtype is None else DTYPES[work.dtype],
            max_seq_len=work.max_seq_len,
            check_kv_values=work.check_kv,
            device=device,
            cuda_graphs=work.cuda_graphs,
        )
        pids = model.ep_link.gather_u32(os.getpid())
    except EpSetupError:
        raise
    except Exception as error:  # noqa: BLE001  (one line, not a traceback)
        _fail(f"error: rank {rank} could not start: {error}")
    with model:
        slots: list[LmState | None] = [None] * work.slots
        if rank == 0:
            try:
                _drive(model, work, pids)
            except Exception as error:  # noqa: BLE001
                _fail(f"error: {type(error).__name__}: {error}")
            return
        from . import run_worker

        logger = logging.getLogger(f"metrale_model_engine.demo.worker{rank}")
        logger.addHandler(_OneLine(rank))
        logger.propagate = False
        try:
            served = run_worker(model, slots, logger=logger)
        except Exception:  # noqa: BLE001  (the logger said it, in one line)
            raise SystemExit(1) from None
        _say(f"[worker {rank}] served {served.commands_run} commands, {served.commands_failed} failed")


def _open_link(world_size: int, work: Work) -> EpLink:
    if world_size == 1:
        from . import EpLink
        from .transport import SoloTransport

        return EpLink(SoloTransport(), num_slots=work.slots, protocol=work.protocol)
    from .torch import open_link

    return open_link(work.transport, num_slots=work.slots, protocol=work.protocol)


def _drive(model: ReferenceLm, work: Work, pids: Sequence[int]) -> None:
    from .reference import GREEDY, Request, Server, Tokenizer, run_summary, summary_lines

    link = model.ep_link
    checkpoint = model.checkpoint
    tokenizer = None if checkpoint.tokenizer_file is None else Tokenizer.from_file(checkpoint.tokenizer_file)
    ranks = f"{link.world_size} ranks over {type(link.transport).__name__}" if model.is_ep() else "1 rank"
    name = "the shipped model" if work.model is None else str(checkpoint.directory)
    _say(
        f"[head] {checkpoint.family.architecture} from {name} ({sum(p.numel() for p in model.lm.parameters()):,} "
        f"parameters on this rank, {str(model.lm.embed.dtype).removeprefix('torch.')}, on {model.lm.embed.device}"
        f"{', CUDA graphs' if work.cuda_graphs else ''}), {ranks}, protocol {link.protocol.value}; {work.slots} "
        f"slots of {model.config.max_seq_len} positions, prefill chunks of {work.prefill_chunk}; "
        f"pids {' '.join(map(str, pids))}"
    )

    def shown(tokens: Sequence[int]) -> str:
        return repr(list(tokens)) if tokenizer is None else repr(tokenizer.decode(tokens))

    def report(completion: Completion) -> None:
        request = completion.request
        late = f", arrived after step {completion.submitted_step}" if completion.submitted_step else ""
        ended = _ENDED.get(completion.finish_reason or "", "")
        _say(f"[request {request.id}{late}] {shown(request.prompt)} -> {shown(completion.tokens)}{ended}")

    server = Server(model, prefill_chunk=work.prefill_chunk, sync_every=work.sync_every)
    sampling = work.sampling or GREEDY
    requests = [Request(i, prompt, work.max_new_tokens, sampling) for i, prompt in enumerate(work.prompts)]
    split = len(requests) - work.late
    early, late = requests[:split], requests[split:]
    for request in early:
        server.submit(request)
    reported: set[int] = set()
    started = time.perf_counter()
    while server.busy or late:
        if server.steps == LATE_STEP or not server.busy:
            for request in late:
                server.submit(request)
            late = []
        server.step()
        for completion in server.completions.values():
            if completion.finished_step is not None and completion.request.id not in reported:
                reported.add(completion.request.id)
                report(completion)
    wall_s = time.perf_counter() - started
    summary = run_summary(model, server, wall_s, tokenizer)
    for line in summary_lines(summary):
        _say(line)
    server.shutdown()  # a last sync point: it raises unless every rank's KV bookkeeping is the head's
    if model.is_ep():
        sync_points = server.steps // work.sync_every + 1
        points = f"{sync_points} sync point{'s' if sync_points != 1 else ''}"
        what = "KV bookkeeping and cache values" if work.check_kv else "KV bookkeeping"
        _say(f"[head] all {link.world_size} ranks agree: {what} compared at {points}")
    else:
        _say("[head] one rank: the single-GPU path, no command sent (is_ep() is false)")
    if work.json_path is not None:
        work.json_path.write_text(json.dumps(summary, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns its exit status (see the module), once every rank process it started has ended."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, from its first moment (torch imports for seconds): one line
        return _interrupted()
    finally:  # its ranks have ended (run_group waits for them); the helper their start made goes too
        stop_resource_tracker()


def _main(argv: Sequence[str] | None) -> int:
    with _interrupts_end_it_at_once():  # the start: reading the arguments imports torch, for seconds
        args = parse_args(argv)
        started = _start(args)
    if isinstance(started, int):
        return started
    work, backend = started
    try:
        if under_torchrun_env():
            return _under_torchrun(backend, work)
        if args.world_size == 1:
            return _exit_code(lambda: serve(0, 1, work))
        from .torch import run_group

        codes = run_group(serve, args.world_size, work, backend=backend)
    except EpSetupError as error:  # the ranks' link could not be set up; they exited 2 without a word
        return _cannot_start(error)
    if INTERRUPTED in codes:  # a rank was interrupted (a signal to the ranks alone)
        return _interrupted()
    if codes[0] == 0 and any(codes):  # the head said nothing: say which ranks failed
        print(f"error: worker rank exit codes {codes[1:]}", file=sys.stderr)
    return 1 if any(codes) else 0


def _start(args: argparse.Namespace) -> tuple[Work, str] | int:
    """What every rank is asked to do, and the backend; or the exit status of a demo that cannot start."""
    try:
        from . import torch  # noqa: F401  (first: without torch, its ImportError says what to install)

        protocol = ProtocolVersion(args.protocol) if args.protocol else ProtocolVersion.from_env()
        torchrun = under_torchrun_env()
        world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
        checkpoint = open_checkpoint(args.model, args.max_seq_len, world_size)
        device, backend = device_and_backend(args, local_ranks, cuda_devices(), checkpoint.config.world_sizes())
        work = _work(args, checkpoint, protocol, device, world_size, local_ranks)
    except (ImportError, ValueError, OSError) as error:
        return _cannot_start(error)
    return work, backend


@contextmanager
def _interrupts_end_it_at_once() -> Iterator[None]:
    """While the block runs (the demo's start, before any rank exists), Ctrl-C ends the process at once.

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
    _interrupted()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


def _work(
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    protocol: ProtocolVersion,
    device: str,
    world_size: int,
    local_ranks: int,
) -> Work:
    """What the ranks will do, once the prompts and (on the CPU) the memory they need are checked.

    Raises:
        ValueError: a prompt, or the memory, cannot be served; the message is the line to print.
    """
    from .reference import Sampling, Tokenizer
    from .reference.checkpoint import DTYPES

    tokenizer = None if checkpoint.tokenizer_file is None else Tokenizer.from_file(checkpoint.tokenizer_file)
    given = [(PROMPT_TEXT, text) for text in PROMPTS] if args.prompts is None else args.prompts
    prompts = prompt_ids(given, checkpoint, tokenizer)
    if device == "cpu":
        dtype = checkpoint.dtype if args.dtype is None else DTYPES[args.dtype]
        check_memory(checkpoint, dtype, args.slots, world_size, local_ranks)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    return Work(
        protocol,
        args.transport,
        args.slots,
        args.max_new_tokens,
        args.prefill_chunk,
        args.sync_every,
        args.json,
        args.check_kv,
        device=device,
        cuda_graphs=args.cuda_graphs,
        threads=args.threads or default_threads(local_ranks),
        model=args.model,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        prompts=tuple(prompts),
        late=LATE_PROMPTS if args.prompts is None else 0,
        sampling=None if sampling.greedy and args.seed is None else sampling,
    )


def _interrupted() -> int:
    """Say that the run was interrupted, in one line (under torchrun, from rank 0 alone), and return 130.

    A second Ctrl-C is ignored from here on: the program is leaving, with no traceback.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(os.environ.get("RANK", "0")) == 0:
        print("interrupted", file=sys.stderr)
    return INTERRUPTED


def _cannot_start(error: Exception) -> int:
    """Say why the demo could not start, in one line (under torchrun, from rank 0 alone), and return 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {error}", file=sys.stderr)
    return 2


def _exit_code(run: Callable[[], None]) -> int:
    try:
        run()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except KeyboardInterrupt:
        return _interrupted()
    return 0


def _under_torchrun(backend: str | None, work: Work) -> int:
    import torch.distributed as dist

    from .torch import init_group_from_env

    init_group_from_env(backend=backend)
    try:
        return _exit_code(lambda: serve(dist.get_rank(), dist.get_world_size(), work))
    finally:
        dist.destroy_process_group()


__dir__: PublicDir = public_dir(globals(), __all__)

if __name__ == "__main__":
    raise SystemExit(main())
