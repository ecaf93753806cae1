"""The paged KV cache, in this process: the head's block manager (``KvBlocks``), the pool's size from the memory
given, the block-table entries in the commands and what every rank checks of them, a sync point that names a worker
whose table diverged, admission by blocks and the refusal of what could never fit, preemption by recompute, and
prefix caching (the ranks' tokens against ``transformers``', across preemptions and prefix hits, are
``tests/ranks/test_checkpoint.py``)."""

from __future__ import annotations

import itertools
from array import array
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine import EpCommandRefused, EpDivergenceError, EpLink, ProtocolVersion, run_worker
from metrale_model_engine.reference import (
    CMD_ALLOC,
    CMD_DECODE,
    CMD_PREFILL,
    GREEDY,
    Checkpoint,
    KvBlocks,
    LmState,
    ReferenceLm,
    Request,
    Sampling,
    Server,
)
from metrale_model_engine.reference.rank import pool
from metrale_model_engine.reference.rank.checks import Pool, check_blocks, check_decode_blocks
from metrale_model_engine.testing import RecordingTransport, ReplayTransport
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import ItemKind, decode_item

from helpers import serving_sessions as sessions
from helpers.greedy import byte_ids
from helpers.pair import LinkPair

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]

POSITION_BYTES = 2 * 2 * 4 * 32 * 4
"""What one position of the shipped model's cache takes on one rank: keys and values, 2 layers, 4 KV heads of 32
float32s."""


def solo(slots: int = 4, **options: object) -> ReferenceLm:
    return ReferenceLm(EpLink(SoloTransport(), num_slots=slots), **options)  # type: ignore[arg-type]


# -- the block manager ---------------------------------------------------------


def test_blocks_are_handed_out_least_recently_freed_first_and_a_sequence_frees_its_end_first() -> None:
    blocks = KvBlocks(5, 2)
    assert (blocks.table(0, 3), blocks.table(1, 1)) == ([0, 1, 2], [3])
    assert (blocks.free, blocks.used, blocks.blocks_for(5)) == (1, 4, 3)
    blocks.release(0)
    assert blocks.free == 4 and blocks.held(0) == []
    assert blocks.table(2, 4) == [4, 2, 1, 0]  # never used first, then 0's last block first
    assert blocks.peak_used == 5
    with pytest.raises(RuntimeError, match=r"slot 5 needs 1 more KV block\(s\) of 2 tokens, but 0 of the 5 are free"):
        blocks.table(5, 1)
    assert blocks.held(5) == [] and blocks.free == 0  # nothing changed


def test_a_reservation_holds_a_prompts_blocks_or_nothing() -> None:
    blocks = KvBlocks(4, 4)
    assert blocks.reserve(0, list(range(9))) == 0 and blocks.held(0) == [0, 1, 2]
    assert blocks.reserve(1, list(range(5))) is None  # two blocks, one free: nothing held
    assert blocks.reserve(1, [7], spare=1) is None  # one block, but one is kept for a running sequence
    assert blocks.reserve(1, [7]) == 0 and blocks.held(1) == [3] and blocks.free == 0


def test_a_full_block_is_found_by_its_tokens_and_its_prefix_until_it_is_handed_out_again() -> None:
    blocks = KvBlocks(8, 4, identity=7)
    first = list(range(10, 20))  # two full blocks and two tokens
    assert blocks.reserve(0, first) == 0
    blocks.filled(0, first)
    blocks.release(0)  # the blocks keep their contents
    assert blocks.prefix(first) == [0, 1] and blocks.prefix(first[:9]) == [0, 1]
    assert blocks.prefix(first[:8]) == [0]  # one token is always left to compute
    assert blocks.prefix([*first[:7], 99, 5]) == [0]  # a token differs in the second block
    assert blocks.prefix([99, *first[1:]]) == []  # the second block's tokens, after another first block
    assert KvBlocks(8, 4, identity=8).prefix(first) == []  # another model: nothing of this one
    assert blocks.reserve(1, [*first[:8], 5, 6, 7], share=True) == 8
    assert blocks.held(1) == [0, 1, 3] and (blocks.hit_tokens, blocks.query_tokens) == (8, 21)
    assert blocks.reserve(2, first, share=False) == 0 and blocks.held(2) == [4, 5, 6]  # shares nothing
    blocks.release(1)
    blocks.release(2)
    assert blocks.reserve(3, list(range(32)), share=False) == 0  # every block handed out again
    assert blocks.prefix(first) == []


def test_a_shared_block_is_freed_by_its_last_holder() -> None:
    blocks = KvBlocks(4, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks.reserve(0, tokens)
    blocks.filled(0, tokens)
    assert blocks.reserve(1, tokens) == 4 and blocks.held(1)[:2] == blocks.held(0)[:2]
    blocks.release(0)
    assert blocks.free == 1  # 0's last block; the two it shares are still held
    blocks.release(1)
    assert blocks.free == 4


# -- the pool's size -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_memory", "error", "message"),
    [
        (True, TypeError, "kv_memory must be an int \\(bytes\\), a float \\(a fraction of the free memory\\) or None, "
         "got bool True"),
        ("1GiB", TypeError, "got str '1GiB'"),
        (0, ValueError, "kv_memory must be at least 1 byte, got 0"),
        (1.5, ValueError, "kv_memory as a fraction of the free memory must be in \\(0, 1\\], got 1.5"),
        (0.0, ValueError, "must be in \\(0, 1\\], got 0.0"),
        (POSITION_BYTES * 16 - 1, ValueError, "the KV cache holds no block: kv_memory=32767 bytes holds 0 block\\(s\\) "
         "of 32,768 bytes \\(16 positions\\) on rank 0"),
    ],
)  # fmt: skip
def test_the_kv_memory_is_checked(kv_memory: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        solo(kv_memory=kv_memory)


def test_the_pool_holds_what_its_memory_holds(
    shipped: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert solo(3).pool == Pool(48, 16)  # every slot's whole context: 3 x 256 positions
    assert solo(kv_memory=POSITION_BYTES * 100, block_size=4).pool == Pool(25, 4)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 999999 kB\nMemAvailable:    4096 kB\n")  # 4 MiB free
    monkeypatch.setattr(pool, "_MEMINFO", meminfo)
    weights = shipped.shard_bytes(0, 1, torch.float32)
    assert solo(kv_memory=0.5).pool.num_blocks == (4 * 2**20 - weights) // 2 // (POSITION_BYTES * 16)
    meminfo.write_text("MemTotal: 999999 kB\n")
    with pytest.raises(OSError, match="says no MemAvailable: give kv_memory in bytes"):
        solo(kv_memory=0.5)
    with pytest.raises(ValueError, match="block_size must be an int of at least 1, got 0"):
        solo(block_size=0)


# -- the tables on the wire, and what a worker checks of them ----------------------------


def recorded(slots: int = 4, **options: object) -> tuple[ReferenceLm, RecordingTransport]:
    transport = RecordingTransport(2)
    link = EpLink(transport, num_slots=slots, protocol=ProtocolVersion.V2)
    return ReferenceLm(link, all_reduce=lambda tensor: None, **options), transport  # type: ignore[arg-type]


def replayed(messages: list[list[int]], slots: int = 4, **options: object) -> tuple[ReferenceLm, ReplayTransport]:
    transport = ReplayTransport(messages)
    link = EpLink(transport, num_slots=slots, protocol=ProtocolVersion.V2)
    return ReferenceLm(link, all_reduce=lambda tensor: None, **options), transport  # type: ignore[arg-type]


def message(seq_id: int, cmd: int, *follow_ups: int | list[int]) -> list[int]:
    transport = RecordingTransport(2)
    EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2).send_command(seq_id, cmd, *follow_ups)
    return list(transport.messages[-1])


def test_the_commands_carry_the_blocks_each_sequence_gains_and_a_worker_holds_the_same_tables() -> None:
    head, recording = recorded(block_size=4)
    slots: list[LmState | None] = [None] * 4
    head.alloc(slots, 2)
    head.prefill(slots, 2, list(range(60, 69)), 0, 5)  # positions 0 ..= 4: two blocks
    head.prefill(slots, 2, list(range(60, 69)), 5, 4)  # positions 5 ..= 8: one more
    for token in (70, 71, 72, 73):
        head.decode(slots, [2], [token])  # positions 9 ..= 12: the last one starts a block
    assert slots[2] == LmState(2, [*range(60, 69), 70, 71, 72, 73], [0, 1, 2, 3])
    words = [list(message) for message in recording.messages]
    assert words[1] == message(2, CMD_PREFILL, 5, 0, 9, list(range(60, 69)), 0, [0, 1])
    assert words[2] == message(2, CMD_PREFILL, 4, 5, 9, list(range(60, 69)), 0, [2])
    assert words[3] == message(0, CMD_DECODE, 1, [2], [70], [])
    assert words[6] == message(0, CMD_DECODE, 1, [2], [73], [3])
    head.ep_link.shutdown_workers()
    worker, _ = replayed([list(message) for message in recording.messages], block_size=4)
    worker_slots: list[LmState | None] = [None] * 4
    assert run_worker(worker, worker_slots).commands_run == 7
    assert worker_slots == slots  # the same tables, decided by the head alone
    assert worker.kv_blocks.used == 0  # a worker allocates nothing


@pytest.mark.parametrize(
    ("prefill", "error"),
    [
        ((2, 0, 2, [65, 66], 0, []), "slot 0's table holds 0 block(s) of 4 positions, so positions up to 1 need 1"),
        ((2, 0, 2, [65, 66], 0, [0, 1]), "need 1 more, but the command gives 2"),
        ((2, 0, 2, [65, 66], 0, [256]), "blocks[0]=256 is out of range (0 ..= 255)"),  # 4 slots x 64 blocks
        ((1, 2, 3, [1, 2, 3], 2, [0]), "cached=2 is not a whole number of blocks of 4 positions"),
        ((1, 1, 3, [1, 2, 3], 2, [0]), "chunk starts at 1, but slot 0 holds 0 tokens and finds 2 cached"),
    ],
)  # fmt: skip
def test_a_worker_refuses_a_prefill_whose_blocks_are_not_the_ones_its_positions_need(
    prefill: tuple[int | list[int], ...], error: str
) -> None:
    commands = [message(0, CMD_ALLOC, 1), message(0, CMD_PREFILL, *prefill)]
    worker, _ = replayed(commands, block_size=4)
    no_slots: list[LmState | None] = [None] * 4
    with pytest.raises(EpCommandRefused) as info:
        run_worker(worker, no_slots, logger=sessions.QUIET)
    assert error in str(info.value)


def test_what_the_checks_of_the_tables_refuse() -> None:
    state, shape = LmState(0, [1] * 8, [3, 5]), Pool(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=r"blocks \[5\] name a block twice, or one the table holds already"):
        check_blocks(state, [5], 12, shape)
    with pytest.raises(TypeError, match="blocks\\[0\\] must be an int, got str '6'"):
        check_blocks(state, ["6"], 12, shape)  # type: ignore[list-item]
    other = LmState(1, [1] * 3, [0])
    assert check_decode_blocks([state, other], [6], shape) == [state]  # position 8 starts a block, 3 does not
    with pytest.raises(ValueError, match=r"a decode step gives 0 block\(s\), but 1 of its sequences start a block: "
                                         r"slot\(s\) \[0\]"):  # fmt: skip
        check_decode_blocks([state, other], [], shape)


def test_a_worker_whose_table_diverged_is_named_at_the_next_sync_point() -> None:
    pair = LinkPair(collective={CMD_PREFILL, CMD_DECODE})
    head = ReferenceLm(pair.head, all_reduce=lambda tensor: None, block_size=4)
    worker = ReferenceLm(pair.worker, all_reduce=lambda tensor: None, block_size=4)
    pair.run = worker.ep_run_command  # type: ignore[assignment]  # the pair's hook takes any state
    slots: list[LmState | None] = [None] * 4
    head.alloc(slots, 1)
    head.prefill(slots, 1, list(range(60, 70)), 0, 10)
    head.decode(slots, [1], [70])
    pair.head.sync(slots)  # the tables agree
    held = pair.slots[1][1]
    assert isinstance(held, LmState) and held.blocks == [0, 1, 2]
    held.blocks[2] = 7  # the worker's table says another block (its tokens are the head's)
    with pytest.raises(EpDivergenceError, match="worker rank 1: its state digest is") as info:
        pair.head.sync(slots)
    assert info.value.ranks == (1,)


# -- admission by blocks ---------------------------------------------------------


def test_a_request_that_could_never_fit_is_refused_in_one_line_with_the_numbers() -> None:
    server = Server(solo(kv_memory=POSITION_BYTES * 64))  # 4 blocks of 16 positions
    message = (r"request 1: a prompt of 50 tokens and 20 new tokens need 5 KV blocks of 16 positions, more than the "
               r"cache's 4 \(64 positions\): it could never run")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        server.submit(Request(1, (65,) * 50, 20))
    server.submit(Request(2, (65,) * 50, 15))  # 64 positions: the last token is never fed
    short = Server(ReferenceLm(EpLink(SoloTransport(), num_slots=4), max_seq_len=64, kv_memory=POSITION_BYTES * 64))
    short.submit(Request(3, (65,) * 60, 100))  # its context ends at 64: the cache need not hold more
    assert list(server.completions) == [2] and list(short.completions) == [3]


def test_a_request_is_admitted_when_its_prompts_blocks_are_free() -> None:
    requests = [Request(i, tuple(byte_ids(text)), 8) for i, text in enumerate(("Licensed under the", "THE SOFTWARE"))]
    tight = Server(solo(2, kv_memory=POSITION_BYTES * 32, block_size=8))  # 4 blocks of 8: one sequence at a time
    done = tight.run(requests)
    first = done[0].finished_step
    assert first is not None and (done[0].admitted_step, done[1].admitted_step) == (1, first + 1)
    assert all(c.preemptions == 0 for c in done.values()) and tight.preemptions == 0
    roomy = Server(solo(2)).run(requests)
    assert [done[i].tokens for i in range(2)] == [roomy[i].tokens for i in range(2)]
    assert roomy[1].admitted_step == 1


def test_the_step_says_when_a_direct_caller_runs_out_of_blocks() -> None:
    model = solo(2, kv_memory=POSITION_BYTES * 8, block_size=4)  # 2 blocks of 4
    slots: list[LmState | None] = [None] * 2
    model.alloc(slots, 0)
    model.prefill(slots, 0, [65] * 8, 0, 8)
    with pytest.raises(RuntimeError, match=r"the step needs 1 more KV block\(s\) of 4 tokens, but 0 of the 2 are free"):
        model.decode(slots, [0], [66])
    assert slots[0] == LmState(0, [65] * 8, [0, 1])  # nothing ran
    model.free(slots, 0)
    assert model.kv_blocks.free == 2


def test_the_http_server_refuses_what_its_cache_could_never_hold() -> None:
    pytest.importorskip("pydantic", reason="the serve extra is not installed")
    from metrale_model_engine.serve.limits import Limits
    from metrale_model_engine.serve.protocol import ApiError

    limits = Limits(max_seq_len=256, vocab_size=256, slots=4, max_waiting=0, kv_positions=64)
    assert limits.new_tokens([1] * 50, None, "max_tokens") == 15  # what the cache leaves: the last one is never fed
    assert limits.new_tokens([1] * 64, 1, "max_tokens") == 1
    with pytest.raises(ApiError) as refused:
        limits.new_tokens([1] * 50, 16, "max_tokens")
    assert (refused.value.status, refused.value.param) == (400, "max_tokens")
    assert refused.value.message == (
        "max_tokens: 16 new tokens and a prompt of 50 need 65 positions of the KV cache, more than the 64 it holds "
        "(at most 15 new tokens here)"
    )
    with pytest.raises(ApiError, match="prompt: the prompt has 65 tokens, more than the 64 positions this server's"):
        limits.new_tokens([1] * 65, 1, "max_tokens")


# -- preemption by recompute -------------------------------------------------------

TEXTS = ("Licensed under the", "Permission is hereby granted", "THE SOFTWARE IS PROVIDED", "you may not use this")


def preempting(fuse: bool) -> tuple[Server, list[tuple[int, int, int]]]:
    """A server whose cache holds 18 blocks of 4 positions, fewer than its 4 requests reach together: the newest
    is preempted as the others grow.  Its ``on_token`` calls, as ``(step, request, token)``."""
    seen: list[tuple[int, int, int]] = []
    server = Server(
        solo(kv_memory=POSITION_BYTES * 72, block_size=4), prefill_chunk=8, fuse=fuse,
        on_token=lambda request, token: seen.append((server.steps, request.id, token)),
    )  # fmt: skip
    return server, seen


def requests_of(count: int = 40) -> list[Request]:
    """Greedy and seeded sampled requests, each of ``count`` new tokens."""
    sampled = Sampling(temperature=0.8, top_k=50, seed=11)
    return [Request(i, tuple(byte_ids(text)), count, sampled if i % 2 else GREEDY) for i, text in enumerate(TEXTS)]


@pytest.mark.parametrize("fuse", [True, False])
def test_a_preempted_request_resumes_with_its_tokens_unchanged_and_its_stream_paused(fuse: bool) -> None:
    server, seen = preempting(fuse)
    done = server.run(requests_of())
    unhurried = Server(solo(), prefill_chunk=8, fuse=fuse).run(requests_of())
    assert {i: c.tokens for i, c in done.items()} == {i: c.tokens for i, c in unhurried.items()}  # sampled too
    assert server.preemptions >= 2 and sum(c.preemptions for c in done.values()) == server.preemptions
    assert all(c.finish_reason == "length" for c in done.values())
    assert not any(c.preemptions for c in unhurried.values())
    for request_id, completion in done.items():
        streamed = [(step, token) for step, rid, token in seen if rid == request_id]
        assert [token for _, token in streamed] == completion.tokens  # each token once, in order
    paused = next(i for i, c in done.items() if c.preemptions)
    steps = [step for step, rid, _ in seen if rid == paused]
    assert max(b - a for a, b in itertools.pairwise(steps)) > 1  # its stream paused, then went on
    assert server.model.kv_blocks.used == 0 and server.slots == [None] * 4


def test_a_preempted_request_can_be_cancelled_while_it_waits() -> None:
    server, _ = preempting(fuse=True)
    for request in requests_of(40):
        server.submit(request)
    while not server.preemptions:
        server.step()
    waiting = next(c for c in server.completions.values() if c.preemptions and c.finish_reason is None)
    assert waiting.tokens  # it had generated some
    server.cancel(waiting.request.id)
    assert waiting.finish_reason == "cancelled"
    done = server.run()
    assert all(c.finish_reason in ("length", "cancelled") for c in done.values())
    assert server.model.kv_blocks.used == 0


# -- prefix caching ---------------------------------------------------------------


def prefills(recording: RecordingTransport) -> list[tuple[int, int, int]]:
    """Each prefill command the head sent: ``(chunk_start, chunk_len, cached)``."""
    found = []
    for words in recording.messages:
        item = decode_item(memoryview(array("I", words)), 0)
        if item.kind is ItemKind.COMMAND and item.first == CMD_PREFILL:
            # [WORD, length, WORD, start, WORD, full, TOKENS, full, *prompt, WORD, cached, TOKENS, ...]
            length, start, full = words[item.end + 1], words[item.end + 3], words[item.end + 5]
            found.append((start, length, words[item.end + 9 + full]))
    return found


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_prompt_that_begins_with_cached_blocks_prefills_only_the_rest_on_every_rank(prefix_caching: bool) -> None:
    head, recording = recorded(block_size=4)
    server = Server(head, prefill_chunk=8, prefix_caching=prefix_caching)
    first = server.run([Request(0, tuple(byte_ids("Licensed under the")), 12)])[0]
    sent = len(prefills(recording))
    # its 18 prompt tokens and the first 11 of its 12 generated were written: 7 full blocks of 4
    prompt = (*first.request.prompt, *first.tokens, *byte_ids(" and"))  # 34 tokens
    second = server.run([Request(1, prompt, 8)])[1]
    chunks = prefills(recording)[sent:]
    if prefix_caching:  # its first 7 blocks are the first request's (the rest computed)
        assert chunks == [(28, 6, 28)] and head.kv_blocks.hit_tokens == 28
    else:
        assert chunks == [(0, 8, 0), (8, 8, 0), (16, 8, 0), (24, 8, 0), (32, 2, 0)] and not head.kv_blocks.query_tokens
    alone = Server(recorded(block_size=4)[0], prefill_chunk=8, prefix_caching=False).run([Request(1, prompt, 8)])[1]
    assert second.tokens == alone.tokens
    head.alloc(server.slots, 2)  # a slot held at the end, for the worker's slots to be compared
    head.prefill(server.slots, 2, second.request.prompt, 0, 3)
    head.ep_link.shutdown_workers()
    worker, _ = replayed([list(message) for message in recording.messages], block_size=4)
    slots: list[LmState | None] = [None] * 4
    assert run_worker(worker, slots).commands_failed == 0
    assert slots == server.slots  # the cached prefix's blocks, and its tokens, on the worker too


def test_a_cached_block_is_shared_while_its_sequence_runs_and_freed_by_the_last() -> None:
    model = solo(2, block_size=4)
    server = Server(model, prefill_chunk=4)
    prompt = tuple(byte_ids("THE SOFTWARE IS PROVIDED"))  # 24 tokens: 5 blocks are cached, the 6th computed
    server.submit(Request(0, prompt, 30))
    server.step()
    server.step()  # its first 8 tokens in 2 blocks, registered as they fill
    server.step()
    server.submit(Request(1, prompt[:13], 4))  # the first 3 blocks of the running one
    server.step()
    held = [state.blocks for state in server.slots if state is not None]
    assert held[0][:3] == held[1][:3] and model.kv_blocks.hit_tokens == 12
    done = server.run()
    assert done[1].tokens == Server(solo(1), prefix_caching=False).run([Request(1, prompt[:13], 4)])[1].tokens
    assert model.kv_blocks.used == 0


def test_requests_that_arrive_together_sharing_a_prefix_wait_for_the_first_to_write_it_then_share_it() -> None:
    """On a cold cache nothing is shared by requests admitted in one step (a block is keyed once written): the first
    computes the 6 shared blocks of 4, the others wait (and the queue behind them) until those are written, then
    compute only their own rest."""
    shared = tuple(byte_ids("THE SOFTWARE IS PROVIDED"))  # 24 tokens: 6 blocks of 4
    requests = [Request(i, (*shared, *byte_ids(end)), 4) for i, end in enumerate((" AS IS", " WITHOUT", " OF ANY"))]
    model = solo(4, block_size=4)
    server = Server(model, prefill_chunk=8)
    for request in requests:
        server.submit(request)
    admitted = []
    while server.busy:
        server.step()
        admitted.append(server.queued)
    # the first one's chunks of 8 write the shared blocks in 3 steps; the others are admitted in the 4th, together
    assert admitted[:4] == [(2, 1), (2, 1), (2, 1), (0, 3)]
    assert (model.kv_blocks.hit_tokens, model.kv_blocks.used) == (2 * 24, 0)
    alone = Server(solo(4, block_size=4), prefill_chunk=8, prefix_caching=False).run(requests)
    assert [server.completions[i].tokens for i in range(3)] == [alone[i].tokens for i in range(3)]
