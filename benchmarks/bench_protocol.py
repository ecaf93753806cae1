"""Latency of the protocol, over gloo and over shared memory, against floors and peers, in one run.

Families of cases, each per call (``harness`` says how a call is timed):

* ours over gloo (``TorchTransport``): headers v1 and v2, token arrays of 1 to
  65,536 tokens (from a list, from an ``array('I')``, buffer into buffer), and a
  batched decode step;
* ours over shared memory (``ShmTransport``): the v2 header, a follow-up word, a
  burst of words, token arrays, and the batched decode step;
* the decode step, Metrale's batched decode of 64 ``(seq_id, token)`` pairs (a
  header, a count word, the slot ids and the tokens as two arrays), in three forms:
  one message (``send_command``), item by item (the trait's per-word calls: four
  messages), and six messages (the previous wire's layout: each array behind a count
  message, emulated with the same link); over shared memory also after idle gaps of
  0.1, 1, 5 and 20 ms, a server's step cadence, with the spin learned from the gaps
  (the default) and fixed at 1 ms (a ring with ``max_spin_time=spin_time``);
* the decode step as the README recommends and the reference model sends it:
  ``send_batch`` from lists (and from arrays), read with ``recv_batch``;
* floors: a raw ``torch.distributed.broadcast`` of a preallocated int32 tensor of as
  many words (and a length word then the words), a local ``memoryview`` copy, and
  the Python limit: a count stored in one shared word that each worker spins on;
* peers, what a Python engine would pick: gloo's ``broadcast_object_list`` (pickle,
  two broadcasts), a ``multiprocessing.Queue`` and a ``multiprocessing.Pipe`` per
  worker, and ``PickleRing``, what vLLM's ``MessageQueue`` does (``peers.py``: each
  message pickled into a shared-memory ring with per-reader flags, readers that spin
  for a second after a message, then block), with the decode step and the gaps too,
  and a token buffer pickled as its bytes (vLLM sends a numpy array out of band).

After the rounds, an idle probe: a shared-memory worker waits 1 s, its CPU is read
over the next 3 s, then a header wakes it.  Prints medians (p25-p75) and the ratios of
the medians ("paired": the median of per-round ratios), then every target; writes the
figures as JSON and a log-log PNG.

    python benchmarks/bench_protocol.py [--quick] [--world-size N] [--out DIR]
    python benchmarks/bench_protocol.py --profile "decode step, one message (shm)"
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import time
from array import array
from collections.abc import MutableSequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from metrale_model_engine import EpLink, ProtocolVersion, SequenceState
from metrale_model_engine.batching import recv_batch, send_batch
from metrale_model_engine.shm import DEFAULT_MAX_SPIN_TIME, DEFAULT_SPIN_TIME, ShmTransport
from metrale_model_engine.torch import TorchTransport, default_backend, open_transport, run_group
from metrale_model_engine.wire import WIRE_VERSION
from output import DEFAULT_OUT, plotting_available, say_written

from harness import Case, Ready, Result, idle_probe, ready_page, results, run_rounds
from peers import PickleRing, PickleRingHandle
from report_protocol import plot, print_report

TOKEN_SIZES = (1, 128, 4_096, 65_536)
SEQ_ID, CMD, DECODE = 3, 7, 0xFFFF_FFE0
BATCH = 64
GAPS_S = (0.0001, 0.001, 0.005, 0.02)
BURST = 8
SLOTS = BATCH
IDLE_S, WINDOW_S = 1.0, 3.0
Slots = MutableSequence[SequenceState | None]


@dataclass(frozen=True)
class Peers:
    """What the parent makes for every rank: a queue and a pipe per worker, and the pickle ring."""

    queues: list[object]
    pipes: list[tuple[Connection, Connection]]
    ring: PickleRingHandle
    ping: str
    """A file of one page: the shared word of :class:`Ping`."""


class Ping:
    """The Python limit: the head stores a count in a shared word; each worker spins until it sees it.

    No framing, no copy, no check, no sleep: what any protocol in Python costs at the least.
    """

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), mmap.PAGESIZE)
        self._word = memoryview(self._map).cast("Q")
        self._count = 0

    def send(self) -> None:
        self._count += 1
        self._word[0] = self._count

    def receive(self) -> None:
        self._count += 1
        word, count = self._word, self._count
        while word[0] < count:
            pass

    def close(self) -> None:
        self._word.release()
        self._map.close()


def nothing(seq_id: int, cmd: int, slots: Slots) -> None:
    """A worker's command that does nothing: the header path is all that is timed."""


def decode_batch() -> tuple[list[int], list[int]]:
    """The decode step's slot ids and tokens, as a scheduler holds them."""
    return list(range(BATCH)), [(i * 7919) % 32_000 for i in range(BATCH)]


class DecodeStep:
    """One decode step in each form, on one link; the worker side reads it and keeps the values."""

    def __init__(self, link: EpLink) -> None:
        self.link = link
        self.ids, self.tokens = decode_batch()
        self.id_array, self.token_array = array("I", self.ids), array("I", self.tokens)
        self.slots: Slots = [None] * SLOTS
        self.live: Slots = [SequenceState(seq_id) for seq_id in range(SLOTS)]  # what recv_batch checks
        self.seen: tuple[list[int], list[int]] = ([], [])

    def one_message(self) -> None:
        self.link.send_command(0, DECODE, BATCH, self.ids, self.tokens)

    def one_message_of_arrays(self) -> None:
        self.link.send_command(0, DECODE, BATCH, self.id_array, self.token_array)

    def batched(self) -> None:
        """The way the README recommends and the reference model sends it: ``send_batch`` from lists."""
        send_batch(self.link, DECODE, self.ids, self.tokens)

    def batched_arrays(self) -> None:
        send_batch(self.link, DECODE, self.id_array, self.token_array)

    def receive_batch(self) -> None:
        self.link.step(self._read_batch, self.live)

    def _read_batch(self, seq_id: int, cmd: int, slots: Slots) -> None:
        self.seen = recv_batch(self.link, slots)

    def item_by_item(self) -> None:
        link = self.link
        link.send_header(0, DECODE)
        link.send_word(BATCH)
        link.send_tokens(self.ids)
        link.send_tokens(self.tokens)

    def six_messages(self) -> None:
        """The previous wire: header, count word, then each array as a count message and a bulk message."""
        link = self.link
        link.send_header(0, DECODE)
        link.send_word(BATCH)
        link.send_word(BATCH)
        link.send_tokens(self.ids)
        link.send_word(BATCH)
        link.send_tokens(self.tokens)

    def receive(self) -> None:
        self.link.step(self._read, self.slots)

    def receive_six(self) -> None:
        self.link.step(self._read_six, self.slots)

    def _read(self, seq_id: int, cmd: int, slots: Slots) -> None:
        count = self.link.recv_word()
        self.seen = (self.link.recv_tokens(count), self.link.recv_tokens(count))

    def _read_six(self, seq_id: int, cmd: int, slots: Slots) -> None:
        count = self.link.recv_word()
        self.link.recv_word()
        ids = self.link.recv_tokens(count)
        self.link.recv_word()
        self.seen = (ids, self.link.recv_tokens(count))


def sync_then_header(link: EpLink) -> None:
    """A sync point, then a header: a worker's step answers the sync on its way to the header."""
    link.sync()
    link.send_header(SEQ_ID, CMD)


def send_words(link: EpLink) -> None:
    """A burst of follow-up words, back to back: the head's cost per word when the ring has room."""
    for _ in range(BURST):
        link.send_word(CMD)


def receive_words(link: EpLink) -> None:
    for _ in range(BURST):
        link.recv_word()


def broadcast_two(count: torch.Tensor, payload: torch.Tensor) -> None:
    """Two raw broadcasts: a length word, then the payload (what a length-prefixed array needs)."""
    dist.broadcast(count, src=0)
    dist.broadcast(payload, src=0)


def send_object(payload: object) -> object:
    """The gloo peer: one pickled object from rank 0 (workers pass None and get it)."""
    holder = [payload]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def put_all(queues: list[object], payload: object) -> None:
    for queue in queues:
        queue.put(payload)  # type: ignore[attr-defined]


def send_all(pipes: list[Connection], payload: object) -> None:
    for pipe in pipes:
        pipe.send(payload)


def send_bytes_all(pipes: list[Connection], payload: array[int]) -> None:
    for pipe in pipes:
        pipe.send_bytes(payload)


def build_cases(rank: int, peers: Peers) -> tuple[list[Case], list[object]]:
    """Every case, and what must be closed after the run (links, the ring)."""
    v1 = EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V1)
    v2 = EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2)
    ring_transport = open_transport("shm")
    assert isinstance(ring_transport, ShmTransport)
    shm = EpLink(ring_transport, num_slots=SLOTS, protocol=ProtocolVersion.V2)
    fixed_spin = open_transport("shm", max_spin_time=DEFAULT_SPIN_TIME)  # the spin learning off: 1 ms, always
    fixed = EpLink(fixed_spin, num_slots=SLOTS, protocol=ProtocolVersion.V2)
    ring = PickleRing.attach_writer(peers.ring) if rank == 0 else PickleRing.attach(peers.ring, rank - 1)
    slots: Slots = [None] * SLOTS
    queues, pipes = peers.queues, [send for _, send in peers.pipes]
    mine_q = peers.queues[rank - 1] if rank else None
    mine_p = peers.pipes[rank - 1][0] if rank else None
    header = [SEQ_ID, CMD]
    ping = Ping(peers.ping)

    def headers(link: EpLink, name: str, family: str, words: int) -> Case:
        return Case(
            name, family, "header", words, partial(link.send_header, SEQ_ID, CMD), partial(link.step, nothing, slots)
        )

    cases = [
        headers(v1, "header v1 (gloo)", "gloo", 1),
        headers(v2, "header v2 (gloo)", "gloo", 2),
        headers(shm, "header v2 (shm)", "shm", 2),
        Case("word (shm)", "shm", "word", 1, partial(shm.send_word, CMD), shm.recv_word),
        Case("sync point, then a header (shm)", "shm", "sync", 2, partial(sync_then_header, shm),
             partial(shm.step, nothing, slots)),
        Case("sync point, then a header (gloo)", "gloo", "sync", 2, partial(sync_then_header, v2),
             partial(v2.step, nothing, slots)),
        Case(f"{BURST} words in a row (shm)", "shm", "burst", BURST, partial(send_words, shm),
             partial(receive_words, shm)),
        Case("peer object_list header", "peer", "header", 2, partial(send_object, header), partial(send_object, None)),
        Case("peer queue header", "peer", "header", 2, partial(put_all, queues, header),
             mine_q.get if mine_q is not None else int),  # type: ignore[attr-defined]
        Case("peer pipe header", "peer", "header", 2, partial(send_all, pipes, header),
             mine_p.recv if mine_p is not None else int),
        Case("peer pickle ring header", "peer", "header", 2, partial(ring.enqueue, header), ring.dequeue),
    ]  # fmt: skip
    cases += decode_cases(v2, shm, fixed, ring)
    for words in sorted({1, 2, 2 * BATCH + 9, *TOKEN_SIZES}):
        tensor = torch.zeros(words, dtype=torch.int32)
        raw = partial(dist.broadcast, tensor, src=0)
        cases.append(Case(f"floor {words} words", "floor", "words", words, raw, raw))
    for n in TOKEN_SIZES[1:]:  # the fair floor of an array whose length travels with it
        count, payload = torch.zeros(1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        both = partial(broadcast_two, count, payload)
        cases.append(Case(f"floor count+{n} words", "floor", "words2", n, both, both))
    for n in TOKEN_SIZES:
        tokens = [(i * 7919) % 32_000 for i in range(n)]
        buffer, target, copy = array("I", tokens), array("I", bytes(4 * n)), array("I", bytes(4 * n))
        source, destination = memoryview(buffer), memoryview(copy)
        cases += [
            Case(f"tokens {n} from list (gloo)", "gloo", "tokens-list", n, partial(v2.send_tokens, tokens),
                 partial(v2.recv_tokens, n)),
            Case(f"tokens {n} from buffer (gloo)", "gloo", "tokens-buffer", n, partial(v2.send_tokens, buffer),
                 partial(v2.recv_tokens, n)),
            Case(f"tokens {n} buffer into buffer (gloo)", "gloo", "tokens-into", n,
                 partial(v2.send_tokens, buffer), partial(v2.recv_tokens_into, target)),
            Case(f"tokens {n} from list (shm)", "shm", "tokens-list", n, partial(shm.send_tokens, tokens),
                 partial(shm.recv_tokens, n)),
            Case(f"tokens {n} buffer into buffer (shm)", "shm", "tokens-into", n,
                 partial(shm.send_tokens, buffer), partial(shm.recv_tokens_into, target)),
            Case(f"memoryview copy {n} words", "local", "copy", n,
                 partial(destination.__setitem__, slice(None), source), int),
            Case(f"peer object_list tokens {n}", "peer", "tokens-list", n, partial(send_object, tokens),
                 partial(send_object, None)),
            Case(f"peer queue tokens {n}", "peer", "tokens-list", n, partial(put_all, queues, tokens),
                 mine_q.get if mine_q is not None else int),  # type: ignore[attr-defined]
            Case(f"peer pipe tokens {n}", "peer", "tokens-list", n, partial(send_all, pipes, tokens),
                 mine_p.recv if mine_p is not None else int),
            Case(f"peer pipe bytes {n}", "peer", "tokens-into", n, partial(send_bytes_all, pipes, buffer),
                 partial(mine_p.recv_bytes_into, target) if mine_p is not None else int),
        ]  # fmt: skip
        if n <= 4_096:  # a pickle of 65,536 ints does not fit vLLM's 1 MiB chunk (it goes over zmq there)
            cases.append(Case(f"peer pickle ring tokens {n}", "peer", "tokens-list", n, partial(ring.enqueue, tokens),
                              ring.dequeue))  # fmt: skip
        # A buffer pickles as its bytes (vLLM sends a numpy array's out of band: one copy each side, as here).
        cases.append(Case(f"peer pickle ring tokens {n} from buffer", "peer", "tokens-into", n,
                          partial(ring.enqueue, buffer), ring.dequeue))  # fmt: skip
    cases.append(Case("shared-word ping (the Python limit)", "limit", "ping", 1, ping.send, ping.receive))
    return cases, [v1, v2, shm, fixed, ring, ping]


def decode_cases(gloo: EpLink, shm: EpLink, fixed: EpLink, ring: PickleRing) -> list[Case]:
    """The batched decode step: each form, each transport, the peers, and the step cadence."""
    words = 2 * BATCH + 9  # header 3, word 2, two arrays of 2 + 64
    steps = {"gloo": DecodeStep(gloo), "shm": DecodeStep(shm)}
    ids, tokens = decode_batch()
    cases = []
    for family, step in steps.items():
        cases += [
            Case(f"decode step, one message ({family})", family, "decode-one", words, step.one_message, step.receive),
            Case(f"decode step, item by item ({family})", family, "decode-items", words, step.item_by_item,
                 step.receive),
        ]  # fmt: skip
    shm_step = steps["shm"]
    cases.append(Case("decode step, six messages (shm)", "shm", "decode-six", words, shm_step.six_messages,
                      shm_step.receive_six))  # fmt: skip
    cases.append(Case("decode step, one message from arrays (shm)", "shm", "decode-arrays", words,
                      shm_step.one_message_of_arrays, shm_step.receive))  # fmt: skip
    cases.append(Case("decode step, send_batch/recv_batch from lists (shm)", "shm", "decode-batch", words,
                      shm_step.batched, shm_step.receive_batch))  # fmt: skip
    cases.append(Case("decode step, send_batch/recv_batch from arrays (shm)", "shm", "decode-batch", words,
                      shm_step.batched_arrays, shm_step.receive_batch))  # fmt: skip
    command = (DECODE, ids, tokens)
    cases.append(Case("peer pickle ring decode step", "peer", "decode-one", words, partial(ring.enqueue, command),
                      ring.dequeue))  # fmt: skip
    of_arrays = (DECODE, shm_step.id_array, shm_step.token_array)
    cases.append(Case("peer pickle ring decode step from arrays", "peer", "decode-arrays", words,
                      partial(ring.enqueue, of_arrays), ring.dequeue))  # fmt: skip
    cases.append(Case("peer object_list decode step", "peer", "decode-one", words, partial(send_object, command),
                      partial(send_object, None)))  # fmt: skip
    fixed_step = DecodeStep(fixed)
    for gap in GAPS_S:
        label = f"{gap * 1000:g} ms"
        cases.append(Case(f"decode step, one message (shm), after {label}", "shm", "cadence", words,
                          shm_step.one_message, shm_step.receive, gap))  # fmt: skip
        cases.append(Case(f"decode step, one message (shm, 1 ms spin), after {label}", "shm", "cadence", words,
                          fixed_step.one_message, fixed_step.receive, gap))  # fmt: skip
        cases.append(Case(f"peer pickle ring decode step, after {label}", "peer", "cadence", words,
                          partial(ring.enqueue, command), ring.dequeue, gap))  # fmt: skip
    return cases


def rank_main(rank: int, world_size: int, rounds: int, warmup: int, calls: int, peers: Peers, out: str) -> None:
    cases, owned = build_cases(rank, peers)
    ready = Ready(str(Path(out, "ready.bin")), world_size)
    samples = run_rounds(rank, cases, ready, rounds=rounds, warmup=warmup, calls=calls, seed=1234)
    (probe,) = [c for c in cases if c.name == "header v2 (shm)"]
    idle = idle_probe(rank, probe, IDLE_S, WINDOW_S)
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, {"samples": samples, "idle": idle})
    for resource in owned:
        resource.close()  # type: ignore[attr-defined]
    if rank != 0:
        return
    per_rank = [g for g in gathered if isinstance(g, dict)]
    found = results(cases, [g["samples"] for g in per_rank], calls)
    Path(out, "raw.json").write_text(json.dumps({"results": [r.__dict__ for r in found],
                                                 "idle": [g["idle"] for g in per_rank]}))  # fmt: skip


def profile_main(rank: int, world_size: int, name: str, calls: int, peers: Peers, out: str) -> None:
    """Run one case ``calls`` times under cProfile on every rank; each rank writes its top functions."""
    import cProfile
    import io
    import pstats

    cases, owned = build_cases(rank, peers)
    (case,) = [c for c in cases if c.name == name]
    call = case.head if rank == 0 else case.worker
    for _ in range(3):
        call()
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    dist.barrier()
    for resource in owned:
        resource.close()  # type: ignore[attr-defined]
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    role = "head" if rank == 0 else f"worker {rank}"
    Path(out, f"profile-rank{rank}.txt").write_text(f"== {role}: {name}, {calls} calls\n{text.getvalue()}")


def report(found: list[Result], idle: list[dict[str, float]], meta: dict[str, object], out: Path, plots: bool) -> None:
    targets, table = print_report(found, idle, meta)
    cases = [{**r.__dict__, "median_us": r.median_us, "head_median_us": r.head_median_us, "p25_us": r.spread_us[0],
              "p75_us": r.spread_us[1]} for r in found]  # fmt: skip
    document = {"meta": meta, "table": table, "targets": targets, "idle": idle, "cases": cases}
    (out / "bench_protocol.json").write_text(json.dumps(document, indent=1))
    if plots:
        plot(found, meta, out / "bench_protocol.png")
    say_written(out / "bench_protocol.json", *([out / "bench_protocol.png"] if plots else []))


def make_peers(world_size: int, out: Path) -> tuple[Peers, PickleRing]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ring = PickleRing.create(world_size - 1)  # the parent owns the block; rank 0 writes into it
    queues: list[object] = [context.Queue() for _ in range(world_size - 1)]
    pipes = [context.Pipe(duplex=False) for _ in range(world_size - 1)]
    ping = Path(out, "ping.bin")
    ping.write_bytes(bytes(mmap.PAGESIZE))
    return Peers(queues, pipes, ring.handle, str(ping)), ring


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a couple of minutes on 2 cores")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 40, quick 4)")
    parser.add_argument("--calls", type=int, default=None, help="calls per case and round (default 30, quick 8)")
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help=f"folder for the JSON and the PNG (default {DEFAULT_OUT})"
    )
    parser.add_argument("--profile", metavar="CASE", help="instead: profile one case by name on every rank")
    args = parser.parse_args()
    plots = plotting_available()
    rounds = args.rounds or (4 if args.quick else 40)
    calls = args.calls or (8 if args.quick else 30)
    warmup = 2
    backend = default_backend(args.world_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers, ring = make_peers(args.world_size, out)
    try:
        if args.profile:
            codes = run_group(profile_main, args.world_size, args.profile, calls * 10, peers, str(out), backend=backend)
            for rank in range(args.world_size):
                print((out / f"profile-rank{rank}.txt").read_text())
            raise SystemExit(1 if any(codes) else 0)
        ready = ready_page(out, args.world_size)
        started = time.monotonic()
        codes = run_group(rank_main, args.world_size, rounds, warmup, calls, peers, str(out), backend=backend,
                          timeout=900 if args.quick else 5400)  # fmt: skip
        ready.unlink()
    finally:
        Path(peers.ping).unlink(missing_ok=True)
        ring.close()
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    raw = json.loads((out / "raw.json").read_text())
    (out / "raw.json").unlink()
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": backend,
        "world_size": args.world_size,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "calls": calls,
        "wire_version": WIRE_VERSION,
        "spin_time_s": DEFAULT_SPIN_TIME,
        "max_spin_time_s": DEFAULT_MAX_SPIN_TIME,
        "seconds": round(time.monotonic() - started, 1),
        "argv": sys.argv[1:],
    }
    report([Result(**r) for r in raw["results"]], raw["idle"], meta, out, plots)
    print(f"took {meta['seconds']} s")


if __name__ == "__main__":
    main()
