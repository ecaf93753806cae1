"""The server's process: its ranks started as the demo starts them, rank 0 serving HTTP with uvicorn.

``python -m metrale_model_engine.serve --model DIR`` (or ``metrale-serve``) checks its
arguments and the checkpoint before any rank starts (exit 2 and one ``error:`` line), then runs
``--world-size`` local ranks (under ``torchrun``: this process is one of its ranks): rank 0 builds
the model, prints the demo's first line (the model, the ranks and their pids) and then the
address it serves, and serves until it is told to stop; the other ranks run
[`run_worker`][metrale_model_engine.run_worker].

Signals: SIGTERM stops taking requests (503), lets the running ones finish within
``--drain-timeout`` seconds (those left end with an error), shuts the workers down and exits 0 (also after
recovering from lost workers: the launching process's last line names them); a
second SIGTERM, or Ctrl-C, ends every rank at once (exit 143, or 130).  With local ranks the
launching process passes SIGTERM on to them (the workers ignore it: the head ends them).  A
stopped run (a lost worker not recovered from, a failed collective) ends every open stream with an error event
naming the cause, turns ``/health`` to 503 at once, and exits 1 with one ``error:`` line as soon as the
streams have their events: a rank that failed, and the launching process once its ranks have
ended, leave at once (``os._exit``) rather than through the interpreter's teardown, which takes
seconds with torch loaded on a busy machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn

from .._demo.choices import default_threads
from .._demo.launch import Start, ranks_line, recovered_ranks, run
from ..demo import Work
from ..demo import serve as serve_rank_of_demo
from .args import parse_args

if TYPE_CHECKING:
    import uvicorn

    from ..reference import ReferenceLm, Server, Tokenizer
    from .api.chat import ChatTemplate
    from .engine import Engine

STREAMS_WRITTEN_S: Final = 0.5
"""After a stopped run (or a drain), the longest the server waits for its open responses to end (their error
events written) before it stops serving: they take milliseconds, unless a client stopped reading."""
INTERRUPTED_BY_TERM: Final = 128 + signal.SIGTERM


@dataclass(frozen=True)
class HttpOptions:
    """What rank 0 serves, and how (picklable, for spawned ranks)."""

    host: str
    port: int
    name: str
    max_waiting: int
    chat_template: Path | None
    drain_timeout: float


@dataclass(frozen=True)
class ServeWork:
    """Every rank's work: the model's (the demo's ``Work``) and rank 0's HTTP options."""

    work: Work
    http: HttpOptions


Head = Callable[["HttpOptions", "ReferenceLm", Work, Sequence[int]], "Sequence[int] | None"]
"""``head(http, model, work, pids)``: what rank 0 does with the model; by default ``serve_http``.  It returns the
worker ranks whose loss it recovered from (the demo's ``Head``)."""


def main(argv: Sequence[str] | None = None, *, head: Head | None = None) -> int:
    """Run the server; its exit status (see the module), once every rank it started has ended.

    ``head`` replaces what rank 0 does with the model, the start being the server's own (a benchmark drives
    ``Server`` there without HTTP); it must be picklable for local ranks.
    """
    terms = _Terms()
    signal.signal(signal.SIGTERM, terms.pass_on_to_ranks)
    code = run(lambda: parse_args(argv), _make_work, functools.partial(serve_rank, head=head or serve_http))
    return INTERRUPTED_BY_TERM if terms.count > 1 else code


class _Terms:
    """The launcher's SIGTERMs: the first is passed on to the ranks, a second kills them; before they exist, one
    ends the launcher."""

    def __init__(self) -> None:
        self.count = 0

    def pass_on_to_ranks(self, signum: int, frame: object) -> None:
        ranks = multiprocessing.active_children()
        if not ranks:
            os._exit(INTERRUPTED_BY_TERM)
        self.count += 1
        for rank in ranks:
            if rank.pid is not None:
                os.kill(rank.pid, signal.SIGKILL if self.count > 1 else signal.SIGTERM)


def _make_work(start: Start) -> ServeWork:
    """Every rank's work, once the memory (on the CPU) and the chat template are checked (``ValueError``)."""
    from .api.chat import ChatTemplate, ChatTemplateError

    args, checkpoint = start.args, start.checkpoint
    kv_memory = start.kv_memory()
    try:
        ChatTemplate.find(checkpoint.directory, args.chat_template)
    except ChatTemplateError as error:
        raise ValueError(str(error)) from None
    work = Work(
        start.protocol, args.transport, args.slots, 1, args.prefill_chunk, args.sync_every, None, args.check_kv,
        device=start.device, cuda_graphs=args.cuda_graphs, threads=args.threads or default_threads(start.local_ranks),
        model=args.model, dtype=args.dtype, max_seq_len=args.max_seq_len, kv_memory=kv_memory,
        block_size=args.block_size, prefix_caching=args.prefix_caching, on_lost_rank=args.on_lost_rank,
    )  # fmt: skip
    name = args.served_model_name or checkpoint.directory.resolve().name
    http = HttpOptions(args.host, args.port, name, args.max_waiting, args.chat_template, args.drain_timeout)
    return ServeWork(work, http)


def serve_http(http: HttpOptions, model: ReferenceLm, work: Work, pids: Sequence[int]) -> list[int]:
    """Rank 0: serve ``model`` over HTTP until a SIGTERM's drain ends (returns the worker ranks whose loss it
    recovered from, numbered as at the start) or the run stops (raises)."""
    from ..reference import Tokenizer
    from .api.chat import ChatTemplate

    checkpoint = model.checkpoint
    name = "the shipped model" if work.model is None else str(checkpoint.directory)
    _say(
        ranks_line(model, name, pids, slots=work.slots, prefill_chunk=work.prefill_chunk, cuda_graphs=work.cuda_graphs)
    )
    tokenizer = None if checkpoint.tokenizer_file is None else Tokenizer.from_file(checkpoint.tokenizer_file)
    template = ChatTemplate.find(checkpoint.directory, http.chat_template)
    server = make_server(model, work)
    logging.basicConfig(format="[head] %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    cause = asyncio.run(_serve(http, server, tokenizer, template))
    if cause is not None:
        raise RuntimeError(f"the run stopped: {cause}")
    return recovered_ranks(server.recoveries)


def serve_rank(rank: int, world_size: int, served: ServeWork, head: Head = serve_http) -> tuple[int, ...]:
    """One rank: rank 0 serves HTTP over the model (``head``); a worker runs its commands (and ignores SIGTERM).

    A rank whose run failed (its one line said) leaves at once with its status, its link closed.  Returns what the
    demo's ``serve`` does: on rank 0, the worker ranks whose loss it recovered from.
    """
    if rank > 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return serve_rank_of_demo(rank, world_size, served.work, head=functools.partial(head, served.http))
    except SystemExit as failed:
        if failed.code:
            leave_now(int(failed.code))
        raise


def leave_now(code: int) -> NoReturn:
    """End this process now with ``code``, its output flushed: no interpreter teardown (torch's takes seconds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_server(model: ReferenceLm, work: Work) -> Server:
    """The scheduler rank 0 serves with: ``work``'s prefill chunks, sync points, prefix caching and
    ``on_lost_rank``."""
    from ..reference import Server

    return Server(
        model, prefill_chunk=work.prefill_chunk, sync_every=work.sync_every, prefix_caching=work.prefix_caching,
        on_lost_rank=work.on_lost_rank,
    )  # fmt: skip


async def _serve(
    http: HttpOptions, server: Server, tokenizer: Tokenizer | None, template: ChatTemplate | None
) -> str | None:
    """Serve until a drain ends (``None``) or the run stops (its cause)."""
    import uvicorn

    from .api.app import build_app
    from .api.routes import Served
    from .engine import Engine
    from .limits import Limits
    from .metrics import Metrics

    loop = asyncio.get_running_loop()
    config = server.model.config
    pool = server.model.kv_blocks
    limits = Limits(
        config.max_seq_len, config.vocab_size, len(server.slots), http.max_waiting, pool.num_blocks * pool.block_size
    )
    metrics = Metrics()
    listening = socket.create_server((http.host, http.port))

    def stopped(_: str) -> None:
        leaving.append(loop.create_task(_stop_serving(engine, uv)))

    engine = Engine(server, limits, metrics, stopped)
    app = build_app(Served(engine, http.name, tokenizer, template), metrics)
    uv = _uvicorn_without_signals(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    terms = 0
    leaving: list[asyncio.Task[None]] = []

    def term() -> None:
        nonlocal terms
        terms += 1
        if terms > 1:
            _leave_at_once(INTERRUPTED_BY_TERM)
        engine.drain()
        leaving.append(loop.create_task(_drain(engine, http.drain_timeout, uv)))

    loop.add_signal_handler(signal.SIGTERM, term)
    loop.add_signal_handler(signal.SIGINT, _leave_at_once, 130)
    engine.start()
    host, port = listening.getsockname()[:2]
    _say(f"[head] serving {http.name!r} at http://{host}:{port}/v1 (the OpenAI API; /health, /metrics)")
    try:
        await uv.serve(sockets=[listening])
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
    if engine.state != "stopped" and not engine.closed.done():  # uvicorn ended without a drain
        engine.close()
        await engine.closed
    return engine.cause


async def _drain(engine: Engine, timeout: float, uv: uvicorn.Server) -> None:
    """Let the running requests finish (``timeout`` seconds at most), shut the workers down, stop serving."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.held and loop.time() < deadline and engine.state != "stopped":
        await asyncio.sleep(0.02)
    engine.close()
    await engine.closed
    await _stop_serving(engine, uv)


async def _stop_serving(engine: Engine, uv: uvicorn.Server) -> None:
    """Stop serving once every open response has its end (its last event written), ``STREAMS_WRITTEN_S`` at
    most; ``/health`` says 503 until then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STREAMS_WRITTEN_S
    while engine.held and loop.time() < deadline:
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.005)  # the responses' last writes: they follow their ends by a turn or two of the loop
    uv.config.timeout_graceful_shutdown = 1
    uv.should_exit = True


def _uvicorn_without_signals(config: uvicorn.Config) -> uvicorn.Server:
    """A uvicorn server that leaves the signals to this process's handlers (above)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


def _leave_at_once(code: int) -> None:
    _say("[head] interrupted: every rank ends now")
    leave_now(code)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
