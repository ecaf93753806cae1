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

Exit status: 0 when every rank served and agreed, or every worker rank lost was recovered from (``--on-lost-rank
recover``, the default: the last line names them); 1 with one ``error: ...`` line
when the run failed (a rank died and was not recovered from, or diverged); 2 with one ``error: ...`` line when
it could not start: torch is missing, an argument or ``METRALE_EP_PROTOCOL`` is bad,
the checkpoint cannot be served (a missing or malformed file, an unsupported
architecture or field, a missing or misshapen tensor: the line names which and
where), the world size cannot split the model (more ranks than attention heads), a prompt is empty or outside the
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, NoReturn, TextIO


def _interrupted_while_importing(signum: int, frame: object) -> None:
    print("interrupted", file=sys.stderr)
    os._exit(130)  # nothing started yet: nothing to wait for


if __name__ == "__main__":  # Ctrl-C while the imports below run, before run() takes it over: the one line, 130
    signal.signal(signal.SIGINT, _interrupted_while_importing)

from ._core.errors import EpSetupError
from ._core.namespace import PublicDir, public_dir
from ._core.protocol import ProtocolVersion
from ._demo.args import PROMPT_TEXT
from ._demo.args import parse_args as _parse_args
from ._demo.choices import default_threads, prompt_ids, under_torchrun_env
from ._demo.launch import Start, ranks_line, recovered_ranks, run

if TYPE_CHECKING:
    from . import EpLink
    from .reference import Completion, ReferenceLm, Sampling

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
    "context": " (cut short: its context is full)",
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
    kv_memory: int | float | None = None
    """Each rank's KV cache (``ReferenceLm``'s ``kv_memory``); ``None``: every slot's whole context."""
    block_size: int = 16
    prefix_caching: bool = True
    on_lost_rank: Literal["recover", "stop"] = "recover"
    """What a lost worker rank does (``Server``'s ``on_lost_rank``)."""


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
    """A log of a rank, one line per record (the error, never a traceback), after ``who``: ``[worker N]``,
    ``[head]``."""

    def __init__(self, who: str) -> None:
        super().__init__(logging.INFO)
        self._who = who

    def emit(self, record: logging.LogRecord) -> None:
        error = f": {record.exc_info[1]}" if record.exc_info and record.exc_info[1] else ""
        _say(f"{self._who} {record.getMessage()}{error}", sys.stderr)


Head = Callable[["ReferenceLm", Work, Sequence[int]], "Sequence[int] | None"]
"""``head(model, work, pids)``: what rank 0 does with the model, every rank's pid at hand; it returns the worker
ranks whose loss its run recovered from (numbered as at the start; ``None``: none)."""


def serve(rank: int, world_size: int, work: Work, head: Head | None = None) -> tuple[int, ...]:
    """One rank's part: build the model over a link, then drive it (head) or serve it (worker).

    ``head`` is what rank 0 does with the model (default: serve the work's prompts and
    report them); the run fails on this rank, in one line, when it raises.  Returns, on rank 0, the
    worker ranks whose loss its run recovered from (``head``'s answer), for the launcher to count them
    as recovered rather than failed; ``()`` on a worker.

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
            kv_memory=work.kv_memory,
            block_size=work.block_size,
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
                recovered = (head or _drive)(model, work, pids)
            except Exception as error:  # noqa: BLE001
                _fail(f"error: {type(error).__name__}: {error}")
            return tuple(recovered or ())
        from . import run_worker

        logger = logging.getLogger(f"metrale_model_engine.demo.worker{rank}")
        logger.addHandler(_OneLine(f"[worker {rank}]"))
        logger.propagate = False
        try:
            served = run_worker(model, slots, logger=logger)
        except Exception:  # noqa: BLE001  (the logger said it, in one line)
            raise SystemExit(1) from None
        _say(f"[worker {rank}] served {served.commands_run} commands, {served.commands_failed} failed")
        return ()


def _open_link(world_size: int, work: Work) -> EpLink:
    if world_size == 1:
        from . import EpLink
        from .transport import SoloTransport

        return EpLink(SoloTransport(), num_slots=work.slots, protocol=work.protocol)
    from .torch import open_link

    return open_link(work.transport, num_slots=work.slots, protocol=work.protocol)


def _drive(model: ReferenceLm, work: Work, pids: Sequence[int]) -> list[int]:
    from .reference import GREEDY, Request, Server, Tokenizer, run_summary, summary_lines

    link = model.ep_link
    checkpoint = model.checkpoint
    tokenizer = None if checkpoint.tokenizer_file is None else Tokenizer.from_file(checkpoint.tokenizer_file)
    name = "the shipped model" if work.model is None else str(checkpoint.directory)
    _say(
        ranks_line(model, name, pids, slots=work.slots, prefill_chunk=work.prefill_chunk, cuda_graphs=work.cuda_graphs)
    )

    def shown(tokens: Sequence[int]) -> str:
        return repr(list(tokens)) if tokenizer is None else repr(tokenizer.decode(tokens))

    def report(completion: Completion) -> None:
        request = completion.request
        late = f", arrived after step {completion.submitted_step}" if completion.submitted_step else ""
        ended = _ENDED.get(completion.finish_reason or "", "")
        _say(f"[request {request.id}{late}] {shown(request.prompt)} -> {shown(completion.tokens)}{ended}")

    server = Server(
        model, prefill_chunk=work.prefill_chunk, sync_every=work.sync_every, prefix_caching=work.prefix_caching,
        on_lost_rank=work.on_lost_rank,
    )  # fmt: skip
    said = logging.getLogger("metrale_model_engine.reference")  # a recovery's one line
    said.addHandler(_OneLine("[head]"))
    said.propagate = False
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
    return recovered_ranks(server.recoveries)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns its exit status (see the module), once every rank process it started has ended."""
    return run(lambda: parse_args(argv), _work, serve)


def _work(start: Start) -> Work:
    """What the ranks will do, once the prompts and (on the CPU) the memory they need are checked.

    Raises:
        ValueError: a prompt, or the memory, cannot be served; the message is the line to print.
    """
    from .reference import Sampling, Tokenizer

    args, checkpoint = start.args, start.checkpoint
    tokenizer = None if checkpoint.tokenizer_file is None else Tokenizer.from_file(checkpoint.tokenizer_file)
    given = [(PROMPT_TEXT, text) for text in PROMPTS] if args.prompts is None else args.prompts
    prompts = prompt_ids(given, checkpoint, tokenizer)
    kv_memory = start.kv_memory()
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    return Work(
        start.protocol,
        args.transport,
        args.slots,
        args.max_new_tokens,
        args.prefill_chunk,
        args.sync_every,
        args.json,
        args.check_kv,
        device=start.device,
        cuda_graphs=args.cuda_graphs,
        threads=args.threads or default_threads(start.local_ranks),
        model=args.model,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        prompts=tuple(prompts),
        late=LATE_PROMPTS if args.prompts is None else 0,
        sampling=None if sampling.greedy and args.seed is None else sampling,
        kv_memory=kv_memory,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        on_lost_rank=args.on_lost_rank,
    )


__dir__: PublicDir = public_dir(globals(), __all__)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, run() answers Ctrl-C
    raise SystemExit(main())
