"""The reference model served through the protocol, in this process: one rank's serving, the checks every rank
makes, a worker's hook replaying what a head sent, the head's failures, and the server kept whole whatever a step
meets (the multi-rank runs are ``tests/ranks/test_serving.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine import (
    EpCommandRefused,
    EpDivergenceError,
    EpLink,
    EpRoleError,
    EpWorkerFailed,
    ProtocolVersion,
    RunStopped,
    WorkerFailure,
    run_worker,
)
from metrale_model_engine.reference import (
    CMD_ALLOC,
    CMD_DECODE,
    CMD_PREFILL,
    LmConfig,
    LmSlots,
    LmState,
    ReferenceLm,
    Request,
    Server,
    check_decode,
    check_prefill,
    kv_digest,
)
from metrale_model_engine.reference.network.model import ShardedBlock
from metrale_model_engine.reference.rank import reduce
from metrale_model_engine.reference.rank.runner import Chunk
from metrale_model_engine.testing import RecordingTransport, ReplayTransport
from metrale_model_engine.transport import SoloTransport
from metrale_model_engine.wire import Report, decode_answer

from helpers import serving_sessions as sessions
from helpers.fakes import RealHead
from helpers.greedy import byte_ids

pytestmark = pytest.mark.torch


def solo_model(slots: int = 4) -> ReferenceLm:
    return ReferenceLm(EpLink(SoloTransport(), num_slots=slots))


# -- one rank, in this process ---------------------------------------------------


def test_one_rank_continues_license_text() -> None:
    server = Server(solo_model())
    (completion,) = server.run([Request(0, tuple(byte_ids("Licensed under the")), 28)]).values()
    assert bytes(completion.tokens).decode().startswith(" Apache License, Version 2.0")
    assert not solo_model().is_ep()


def test_requests_that_arrive_mid_run_get_the_tokens_they_get_alone(
    served_one_rank: tuple[dict[int, list[int]], ...],
) -> None:
    batched = served_one_rank[0]
    for request in sessions.WORKLOAD:
        alone = Server(solo_model(sessions.SLOTS), prefill_chunk=sessions.PREFILL_CHUNK).run([request])
        assert alone[request.id].tokens == batched[request.id], request
    assert all(len(tokens) == sessions.NEW_TOKENS for tokens in batched.values())


@pytest.mark.parametrize(
    ("fuse", "admitted", "finished"),
    [
        # two slots; 19-token prompts take 5 chunks, the step of the last one decodes too, one more decode: 6 steps
        (False, [1, 1, 7, 7, 13], [6, 6, 12, 12, 18]),
        # one forward a step: the first token comes with the last chunk, two decodes follow: 7 steps
        (True, [1, 1, 8, 8, 15], [7, 7, 14, 14, 21]),
    ],
)
def test_the_server_batches_queues_and_frees(fuse: bool, admitted: list[int], finished: list[int]) -> None:
    requests = [Request(i, tuple(byte_ids(f"request {i}: Licensed")), 3) for i in range(5)]
    server = Server(solo_model(2), prefill_chunk=4, fuse=fuse)
    done = server.run(requests)
    assert [done[i].admitted_step for i in range(5)] == admitted
    assert [done[i].finished_step for i in range(5)] == finished
    assert all(c.finished_step is not None and len(c.tokens) == 3 for c in done.values())
    assert server.slots == [None, None] and not server.busy
    assert max(step.batch for step in server.decode_steps) == 2
    assert all(step.total_s >= step.protocol_s + step.collectives_s for step in server.decode_steps)
    unfused = Server(solo_model(2), prefill_chunk=4, fuse=False).run(requests)
    assert [done[i].tokens for i in range(5)] == [unfused[i].tokens for i in range(5)]


def test_one_rank_fuses_a_steps_prefills_and_decode_into_one_forward() -> None:
    model = solo_model(3)
    calls: list[str] = []
    for name in ("prefill", "decode", "fused_step"):
        method = getattr(model, name)

        def noted(*args: object, _name: str = name, _method: Callable[..., torch.Tensor] = method) -> torch.Tensor:
            calls.append(_name)
            return _method(*args)

        setattr(model, name, noted)
    server = Server(model, prefill_chunk=8)
    assert server.fuse
    done = server.run([Request(i, tuple(byte_ids(text)), 4) for i, text in enumerate(("Licensed", "THE", "you"))])
    assert set(calls) == {"fused_step"} and len(calls) == server.steps == 4  # a prefill, then 3 decodes, all at once
    assert [len(c.tokens) for c in done.values()] == [4, 4, 4]
    with pytest.raises(RuntimeError, match=r"fused_step is the one-rank path: with several ranks \(is_ep\(\)\)"):
        ReferenceLm(EpLink(RecordingTransport(2), num_slots=2), all_reduce=print).fused_step([None] * 2, [], [0], [1])
    with pytest.raises(ValueError, match="a fused step names each slot once, got \\[0, 0\\]"):
        model.fused_step(server.slots, [(0, (1, 2), 0, 2)], [0], [5])
    with pytest.raises(ValueError, match=r"fuse=True: a model of several ranks \(is_ep\(\)\) sends each prefill"):
        Server(ReferenceLm(EpLink(RecordingTransport(2), num_slots=2), all_reduce=print), fuse=True)


def test_tokens_stream_as_they_are_chosen() -> None:
    seen: list[tuple[int, int]] = []
    server = Server(solo_model(), on_token=lambda request, token: seen.append((request.id, token)))
    done = server.run([Request(7, tuple(byte_ids("THE SOFTWARE")), 5)])
    assert seen == [(7, token) for token in done[7].tokens]


def test_a_sequence_ends_when_its_cache_is_full() -> None:
    model = solo_model()
    prompt = tuple(byte_ids("Licensed under the Apache License")) * 7  # 231 tokens of the 256 positions
    done = Server(model, prefill_chunk=64).run([Request(0, prompt, 1000)])
    assert len(done[0].tokens) == model.config.max_seq_len - len(prompt) + 1  # the last token is never fed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ()}, "request 1: the prompt is empty"),
        ({"prompt": (1, "2")}, "request 1: prompt\\[1\\] must be an int, got str"),
        ({"max_new_tokens": 0}, "request 1: max_new_tokens must be at least 1, got 0"),
        ({"max_new_tokens": 2.0}, "request 1: max_new_tokens must be an int, got float 2.0"),
        ({"id": -1}, "id=-1 is outside the u32 range"),
    ],
)
def test_bad_requests_are_refused(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"id": 1, "prompt": (1, 2), "max_new_tokens": 3, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        Request(**fields)  # type: ignore[arg-type]


def test_the_server_refuses_what_the_model_cannot_serve() -> None:
    server = Server(solo_model())
    server.submit(Request(1, (1,), 1))
    with pytest.raises(ValueError, match="request 1 was submitted already"):
        server.submit(Request(1, (2,), 1))
    with pytest.raises(ValueError, match="request 2: the prompt has 257 tokens, more than max_seq_len=256"):
        server.submit(Request(2, (1,) * 257, 1))
    with pytest.raises(ValueError, match="request 3: prompt\\[1\\]=256 is outside the vocabulary"):
        server.submit(Request(3, (1, 256), 1))
    assert list(server.completions) == [1]  # nothing of the refused ones was kept
    for name in ("prefill_chunk", "sync_every"):
        with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
            Server(solo_model(), **{name: 0})  # type: ignore[arg-type]


CONFIG = LmConfig()


def held(*lengths: int | None) -> list[LmState | None]:
    return [None if n is None else LmState(i, [65] * n) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("slots", "seq_id", "prompt", "start", "length", "error", "message"),
    [
        (held(0), 1, [1], 0, 1, IndexError, "seq_id=1 is out of range for 1 slots"),
        (held(None), 0, [1], 0, 1, KeyError, "slot 0 is free"),
        (held(0), 0, [1, 2], 0, 0, ValueError, "chunk 0 ..< 0 is not a non-empty part of a 2-token prompt"),
        (held(0), 0, [1, 2], 1, 2, ValueError, "chunk 1 ..< 3 is not a non-empty part of a 2-token prompt"),
        (held(2), 0, [1, 2, 3, 4], 1, 2, ValueError, "chunk starts at 1, but slot 0 holds 2 tokens"),
        (held(0), 0, [1] * 257, 0, 1, ValueError, "the prompt has 257 tokens, more than max_seq_len=256"),
        (held(0), 0, [1, 300], 0, 1, ValueError, "prompt\\[1\\]=300 is outside the vocabulary"),
        (held(0), 0, [1], True, 1, TypeError, "start must be an int, got bool"),
        (held(0), 0, [1, "x"], 0, 1, TypeError, "prompt\\[1\\] must be an int, got str 'x'"),
    ],
)
def test_check_prefill(
    slots: list[LmState | None],
    seq_id: int,
    prompt: list[int],
    start: int,
    length: int,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        check_prefill(slots, seq_id, prompt, start, length, CONFIG)


@pytest.mark.parametrize(
    ("slots", "seq_ids", "tokens", "error", "message"),
    [
        (held(1), [], [], ValueError, "a decode step needs at least one sequence"),
        (held(1, 1), [0, 1], [5], ValueError, "one token per sequence: 2 ids, 1 tokens"),
        (held(1), [1], [5], IndexError, "slot_ids\\[0\\]=1 is out of range for 1 slots"),
        (held(1, 1), [1, 1], [5, 5], ValueError, "slot_ids\\[1\\]=1 repeats"),
        (held(1, None), [0, 1], [5, 5], KeyError, "slot_ids\\[1\\]=1: the slot is free"),
        (held(1), [0], [256], ValueError, "tokens\\[0\\]=256 is outside the vocabulary"),
        (held(0), [0], [5], ValueError, "slot 0 holds 0 tokens: a decode needs 1 ..= 255"),
        (held(256), [0], [5], ValueError, "slot 0 holds 256 tokens: a decode needs 1 ..= 255"),
    ],
)
def test_check_decode(
    slots: list[LmState | None], seq_ids: list[int], tokens: list[int], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        check_decode(slots, seq_ids, tokens, CONFIG)


def test_the_head_checks_a_command_before_it_changes_anything() -> None:
    model = solo_model(2)
    slots: list[LmState | None] = [None, None]
    model.alloc(slots, 0)
    with pytest.raises(KeyError, match="slot 1 is free"):
        model.free(slots, 1)
    with pytest.raises(ValueError, match="chunk starts at 1"):
        model.prefill(slots, 0, [1, 2], 1, 1)
    with pytest.raises(ValueError, match="slot 0 holds 0 tokens"):
        model.decode(slots, [0], [5])
    with pytest.raises(IndexError, match="seq_id=2 is out of range for 2 slots"):
        model.alloc(slots, 2)
    assert slots == [LmState(0), None]  # checked before anything is sent or changed (at 2 ranks: the fault tests)
    assert model.ep_link.commands == 0  # one rank sends nothing at all


def test_kv_digest_tells_slots_apart() -> None:
    assert kv_digest(held(2, None)) == kv_digest(held(2, None))
    others = [held(None, 2), held(2, 0), held(3, None), [LmState(0, [66, 65]), None]]
    assert len({kv_digest(held(2, None)), *(kv_digest(slots) for slots in others)}) == 5


def test_several_ranks_need_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match=r"2 ranks share the model, but torch\.distributed is not initialised"):
        ReferenceLm(EpLink(RealHead(), num_slots=2))


def test_over_a_pretend_group_the_model_is_its_collectives_one_participant() -> None:
    head = ReferenceLm(EpLink(RecordingTransport(2), num_slots=2, protocol=ProtocolVersion.V2))  # no process group
    slots: list[LmState | None] = [None, None]
    head.alloc(slots, 0)
    head.prefill(slots, 0, [72, 105], 0, 2)  # its all-reduces leave each tensor as it is, checked and counted
    assert head.ep_link.commands == 2 and head.ep_link.stopped is None


def test_the_worker_hook_is_for_workers() -> None:
    with pytest.raises(EpRoleError):
        solo_model().ep_worker_step([None] * 4)


# -- the worker hook and the head's failures, in this process (an all-reduce that adds nothing) --


def no_reduce(tensor: torch.Tensor) -> None:
    """A stand-in all-reduce: each rank keeps its own shard's sum (wrong logits, the same on every run)."""


def no_slots(count: int) -> list[LmState | None]:
    return [None] * count


def recorded_head(slots: int = 4) -> tuple[ReferenceLm, RecordingTransport]:
    transport = RecordingTransport(2)
    link = EpLink(transport, num_slots=slots, protocol=ProtocolVersion.V2)
    return ReferenceLm(link, all_reduce=no_reduce), transport


def replaying_worker(
    messages: list[list[int]] | list[tuple[int, ...]], slots: int = 4
) -> tuple[ReferenceLm, ReplayTransport]:
    transport = ReplayTransport(messages)
    link = EpLink(transport, num_slots=slots, protocol=ProtocolVersion.V2)
    return ReferenceLm(link, all_reduce=no_reduce), transport


def message(seq_id: int, cmd: int, *follow_ups: int | list[int]) -> list[int]:
    """The words of one command as the head sends it."""
    transport = RecordingTransport(2)
    EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2).send_command(seq_id, cmd, *follow_ups)
    return list(transport.messages[-1])


def reports(transport: ReplayTransport) -> list[tuple[str, bool]]:
    """The error text of every failure the worker reported to the head, and whether it stopped the run."""
    return [(a.error, a.stopped) for a in map(decode_answer, transport.answers) if isinstance(a, Report)]


def test_a_worker_replays_what_the_head_served_to_the_same_kv_state() -> None:
    head, recording = recorded_head()
    server = Server(head, prefill_chunk=8)
    server.run(sessions.WORKLOAD[:3])
    head.alloc(server.slots, 1)
    head.prefill(server.slots, 1, sessions.TAIL.prompt, 0, len(sessions.TAIL.prompt))
    head.ep_link.shutdown_workers()
    worker, _ = replaying_worker(recording.messages)
    slots: list[LmState | None] = [None] * 4
    assert run_worker(worker, slots).commands_failed == 0
    assert kv_digest(slots) == kv_digest(server.slots) and slots[1] is not None


@pytest.mark.parametrize(
    ("command", "where", "error"),
    [
        (message(0, CMD_DECODE, 1, [1], [65], []), "seq_id=0, cmd=0xffffffe0", "KeyError: 'slot_ids[0]=1: the slot"),
        (message(2, CMD_PREFILL, 1, 0, 2, [65, 66], 0, [0]), "seq_id=2, cmd=0xfffffff0", "KeyError: 'slot 2 is free'"),
        (message(0, CMD_PREFILL, 2, 0, 2, [65, 300], 0, [0]), "seq_id=0, cmd=0xfffffff0", "prompt[1]=300 is outside"),
        # full_len says 3, the array holds 1; then one word too many, read past the command's end:
        (message(0, CMD_PREFILL, 1, 0, 3, [65]), "seq_id=0, cmd=0xfffffff0", "EpMismatchError: worker rank 1 expected"),
        (message(0, CMD_PREFILL, 1, 0), "seq_id=0, cmd=0xfffffff0", "expected a follow-up word, but command 2"),
        (message(0, CMD_DECODE, 1, [0], [65], [], 9), "seq_id=0, cmd=0xffffffe0", "left a follow-up word (9) unread"),
    ],
)
def test_a_worker_refuses_a_collective_command_it_cannot_run_and_leaves_having_told_the_head(
    command: list[int], where: str, error: str
) -> None:
    alloc_and_prefill = [message(0, CMD_ALLOC, 1), message(0, CMD_PREFILL, 1, 0, 1, [65], 0, [0])]
    worker, transport = replaying_worker([*alloc_and_prefill[: 1 if "0xfffffff0" in where else 2], command])
    number = 2 if "0xfffffff0" in where else 3
    with pytest.raises(EpCommandRefused) as info:
        run_worker(worker, no_slots(4), logger=sessions.QUIET)
    assert str(info.value).startswith(f"worker rank 1: command {number} ({where}), which runs collectives, failed")
    assert error in str(info.value)
    ((text, stops_run),) = reports(transport)
    assert stops_run and error in text, text
    stopped = worker.ep_link.stopped
    assert stopped is not None and str(stopped) == str(info.value) and stopped.failures == info.value.failures


def test_an_unknown_word_is_an_ordinary_failure() -> None:
    worker, transport = replaying_worker([message(0, 0x1234), header_shutdown()])
    summary = run_worker(worker, no_slots(4), logger=sessions.QUIET)
    assert (summary.commands_run, summary.commands_failed) == (0, 1)
    assert reports(transport) == [("ValueError: unknown command word 4660 (seq_id=0) for ReferenceLm", False)]


class FailsInItsForward(ReferenceLm):
    def forward_decode(self, states: object, tokens: object) -> torch.Tensor:
        raise RuntimeError("out of memory")


def test_an_error_inside_a_workers_forward_is_a_refusal_too() -> None:
    transport = ReplayTransport(
        [
            message(0, CMD_ALLOC, 1),
            message(0, CMD_PREFILL, 1, 0, 1, [65], 0, [0]),
            message(0, CMD_DECODE, 1, [0], [66], []),
        ]
    )
    worker = FailsInItsForward(EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2), all_reduce=no_reduce)
    with pytest.raises(EpCommandRefused, match=r"command 3 \(seq_id=0, cmd=0xffffffe0\), which runs collectives"):
        run_worker(worker, no_slots(4), logger=sessions.QUIET)


def test_a_bad_alloc_or_free_is_an_ordinary_failure_and_the_worker_stays() -> None:
    commands = [message(0, CMD_ALLOC, 2), message(3, CMD_ALLOC, 0), message(1, CMD_ALLOC, 1), header_shutdown()]
    worker, transport = replaying_worker(commands)
    slots: list[LmState | None] = [None] * 4
    summary = run_worker(worker, slots, logger=sessions.QUIET)
    assert (summary.commands_run, summary.commands_failed) == (1, 2)
    assert slots == [None, LmState(1), None, None]
    assert [(text.split(":")[0], stopped) for text, stopped in reports(transport)] == [
        ("ValueError", False),
        ("KeyError", False),
    ]
    assert "an alloc's word must be 1 (alloc) or 0 (free), got 2" in reports(transport)[0][0]


def header_shutdown() -> list[int]:
    transport = RecordingTransport(2)
    EpLink(transport, num_slots=4, protocol=ProtocolVersion.V2).shutdown_workers()
    return list(transport.messages[-1])


def test_a_worker_with_the_wrong_slot_count_leaves_at_once() -> None:
    worker, _ = replaying_worker([message(0, CMD_ALLOC, 1)])
    with pytest.raises(ValueError, match="slots has 3 entries, but the link has num_slots=4"):
        run_worker(worker, no_slots(3))


def test_the_heads_own_forward_failing_ends_the_run_for_good() -> None:
    class HeadFails(ReferenceLm):
        def forward_prefill(self, *args: object) -> torch.Tensor:
            raise RuntimeError("a bug on the head")

    link = EpLink(RecordingTransport(2), num_slots=2, protocol=ProtocolVersion.V2)
    head = HeadFails(link, all_reduce=no_reduce)
    slots: list[LmState | None] = [None, None]
    head.alloc(slots, 0)
    own = r"head: the run stopped: its own forward of command 2 \(seq_id=0, cmd=0xfffffff0\) failed: RuntimeError"
    with pytest.raises(RunStopped, match=own):
        head.prefill(slots, 0, [65], 0, 1)
    held = slots[0]
    assert link.closed and held is not None and not held.tokens and slots[1] is None  # never written: not recorded
    with pytest.raises(RunStopped, match="the run stopped earlier"):
        head.alloc(slots, 1)
    with pytest.raises(RunStopped, match="the run stopped earlier"):  # before any check of the arguments
        head.free(slots, 3)


def test_a_failed_all_reduce_the_link_cannot_explain_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tensor: torch.Tensor) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(reduce, "EXIT_GRACE", 0.01)
    head = ReferenceLm(EpLink(RecordingTransport(2), num_slots=2, protocol=ProtocolVersion.V2), all_reduce=broken)
    slots: list[LmState | None] = [None, None]
    head.alloc(slots, 0)
    with pytest.raises(RunStopped, match=r"head: the run stopped in command 2 .*: an all-reduce failed \(RuntimeError"):
        head.prefill(slots, 0, [65], 0, 1)
    with pytest.raises(RunStopped):
        head.decode(slots, [0], [66])


# -- several ranks, real processes ----------------------------------------------


# -- the server keeps every request whole, whatever a step meets -------------------


def test_a_completion_says_why_it_ended() -> None:
    prompt = tuple(byte_ids("Licensed under the Apache License")) * 7  # 231 of the 256 positions
    done = Server(solo_model(), prefill_chunk=64).run([Request(0, prompt, 1000), Request(1, (76, 105), 3)])
    assert (done[0].finish_reason, done[1].finish_reason) == ("context", "length")
    assert len(done[1].tokens) == 3 and done[0].error is None


def test_the_server_takes_nothing_after_its_shutdown_on_one_rank_as_on_two() -> None:
    for model in (solo_model(), recorded_head()[0]):
        server = Server(model)
        server.run([Request(0, (76,), 2)])
        with contextlib.suppress(EpDivergenceError):  # the recording's pretend workers compute no slot digest
            server.shutdown()
        with pytest.raises(RuntimeError, match=r"the server was shut down \(shutdown\(\)\): it takes no more"):
            server.submit(Request(1, (76,), 2))
        with pytest.raises(RuntimeError, match="the server was shut down"):
            server.step()
        assert list(server.completions) == [0]


def test_bad_arguments_are_type_errors_on_one_rank_as_on_many() -> None:
    for model in (solo_model(), recorded_head()[0]):
        server = Server(model)
        with pytest.raises(TypeError, match="request must be a Request, got str 'text'"):
            server.submit("text")  # type: ignore[arg-type]
        slots = no_slots(4)
        model.alloc(slots, 1)
        model.prefill(slots, 1, [65, 66], 0, 2)
        with pytest.raises(TypeError, match=r"slot_ids\[0\] must be an int, got bool True"):
            model.decode(slots, [True], [65])
        with pytest.raises(TypeError, match="seq_id must be an int, got bool True"):
            model.free(slots, True)
        assert slots[1] is not None  # nothing changed


def clean_run(requests: list[Request]) -> dict[int, list[int]]:
    return {i: c.tokens for i, c in Server(solo_model(2), prefill_chunk=4).run(requests).items()}


REQUESTS = [
    Request(i, tuple(byte_ids(text)), 6) for i, text in enumerate(("Licensed under", "THE SOFTWARE", "you may"))
]


class FailsOnce(ReferenceLm):
    """A head whose ``which`` call raises once, before anything is sent (as a report found at a send does)."""

    which = "prefill"
    error: Exception = RuntimeError("a send that failed before it began")

    def prefill(self, slots: LmSlots, seq_id: int, prompt: Sequence[int], start: int, length: int) -> torch.Tensor:
        self._maybe_fail("prefill")
        return super().prefill(slots, seq_id, prompt, start, length)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self._maybe_fail("decode")
        return super().decode(slots, seq_ids, tokens)

    def fused_step(
        self, slots: LmSlots, chunks: Sequence[Chunk], seq_ids: Sequence[int], tokens: Sequence[int]
    ) -> torch.Tensor:
        self._maybe_fail("fused_step")
        return super().fused_step(slots, chunks, seq_ids, tokens)

    def _maybe_fail(self, call: str) -> None:
        if call == self.which and not getattr(self, "failed", False):
            self.failed = True
            raise self.error


@pytest.mark.parametrize("which", ["prefill", "decode", "fused_step"])
def test_a_step_that_raises_leaves_every_request_untouched_and_the_server_goes_on(which: str) -> None:
    model = FailsOnce(EpLink(SoloTransport(), num_slots=2))
    model.which = which
    server = Server(model, prefill_chunk=4, fuse=which == "fused_step")
    for request in REQUESTS:
        server.submit(request)
    with pytest.raises(RuntimeError, match="a send that failed before it began"):
        while server.busy:
            server.step()
    done = server.run()
    assert {i: c.tokens for i, c in done.items()} == clean_run(REQUESTS)  # nothing lost, nothing fed twice
    assert all(c.finish_reason == "length" for c in done.values())


def test_a_worker_failure_fails_the_request_of_its_slot_and_the_others_go_on() -> None:
    model = FailsOnce(EpLink(SoloTransport(), num_slots=2))
    model.which = "decode"
    model.error = EpWorkerFailed([WorkerFailure(1, 3, 1, CMD_PREFILL, "KeyError: 'slot 1 is free'")])
    server = Server(model, prefill_chunk=4, fuse=False)  # the commands of several ranks, one by one
    with pytest.raises(EpWorkerFailed):
        server.run(REQUESTS)
    done = server.run()
    failed = done[1]  # request 1 ran in slot 1
    assert failed.finish_reason == "error" and failed.error is not None and "slot 1 is free" in failed.error
    expected = clean_run([REQUESTS[0], REQUESTS[2]])
    assert done[0].tokens == expected[0] and done[2].tokens == expected[2]
    assert server.slots == [None, None] and not server.busy


def test_a_callback_that_raises_fails_its_request_only() -> None:
    def on_token(request: Request, token: int) -> None:
        if request.id == 1:
            raise ValueError("the client went away")

    done = Server(solo_model(2), prefill_chunk=4, on_token=on_token).run(REQUESTS)
    assert done[1].finish_reason == "error" and done[1].error == "ValueError: the client went away"
    assert len(done[1].tokens) == 1  # the token whose callback failed, and no other
    expected = clean_run([REQUESTS[0], REQUESTS[2]])
    assert done[0].tokens == expected[0] and done[2].tokens == expected[2]


# -- the deeper sync point: KV cache values -----------------------------------------


def test_a_kv_cache_altered_after_the_write_changes_the_state_digest(caplog: pytest.LogCaptureFixture) -> None:
    model = ReferenceLm(EpLink(SoloTransport(), num_slots=3), check_kv_values=True, block_size=4)
    server = Server(model, prefill_chunk=8)
    server.run([Request(0, tuple(byte_ids("Licensed under")), 4)])
    slots = server.slots
    model.alloc(slots, 1)
    model.prefill(slots, 1, list(byte_ids("THE SOFTWARE")), 0, 12)
    model.decode(slots, [1], [65])  # position 12 starts the sequence's fourth block
    held = slots[1]
    digest = model.ep_link.state_digest
    assert held is not None and len(held.blocks) == 4 and digest is not None
    assert digest(slots) == kv_digest(slots)  # intact: the bookkeeping's digest alone
    block = model.lm.layers[1]
    assert isinstance(block, ShardedBlock)
    cache = block.attn.v_cache  # [blocks, positions of a block, KV heads, head width]
    cache[held.blocks[3], 1, 0, 0] += 1.0  # past the sequence's 13 positions: not held, not checked
    cache[max(held.blocks) + 1, 0, 0, 0] += 1.0  # a block no sequence holds
    assert digest(slots) == kv_digest(slots)
    cache[held.blocks[3], 0, 0, 0] += 1.0  # the decode's row
    with caplog.at_level("ERROR", logger="metrale_model_engine.reference"):
        assert digest(slots) != kv_digest(slots)
    assert f"the KV cache of slot(s) [1] differs from what was written (block(s) [{held.blocks[3]}])" in caplog.text
    model.alloc(slots, 1)  # a new sequence in the slot: what it held no longer counts
    assert digest(slots) == kv_digest(slots)


class FailsAt(ReferenceLm):
    """A head whose calls raise what :attr:`plan` says, once each: ``{(call, nth): error}``."""

    plan: dict[tuple[str, int], Exception]
    calls: dict[str, int]

    def alloc(self, slots: LmSlots, seq_id: int) -> None:
        self._count("alloc")
        super().alloc(slots, seq_id)

    def decode(self, slots: LmSlots, seq_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self._count("decode")
        return super().decode(slots, seq_ids, tokens)

    def _count(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        error = self.plan.pop((call, self.calls[call]), None)
        if error is not None:
            raise error


def failing_head(plan: dict[tuple[str, int], Exception]) -> FailsAt:
    model = FailsAt(EpLink(RecordingTransport(2), num_slots=2, protocol=ProtocolVersion.V2), all_reduce=no_reduce)
    model.plan, model.calls = plan, {}
    return model


def test_a_reset_that_fails_is_tried_again_and_the_first_error_is_the_one_raised() -> None:
    report = EpWorkerFailed([WorkerFailure(1, 5, 1, CMD_PREFILL, "KeyError: 'slot 1 is free'")])
    model = failing_head({("decode", 1): report, ("alloc", 3): RuntimeError("the reset's send failed")})
    server = Server(model, prefill_chunk=4)
    with pytest.raises(EpWorkerFailed) as info:
        server.run(REQUESTS)
    assert info.value is report
    with pytest.raises(RuntimeError, match="the reset's send failed"):  # the reset, at the next step
        server.step()
    done = server.run()
    assert done[1].finish_reason == "error" and {done[0].finish_reason, done[2].finish_reason} == {"length"}
    assert server.slots == [None, None]


def test_a_report_older_than_its_slots_allocation_leaves_the_new_request_alone() -> None:
    model = failing_head({})
    server = Server(model, prefill_chunk=4)
    server.run(REQUESTS[:1])  # in slot 0, from command 1 (its alloc) on
    stale = EpWorkerFailed([WorkerFailure(1, 1, 0, CMD_ALLOC, "ValueError: an old alloc")])
    model.plan = {("decode", model.calls["decode"] + 1): stale}
    with pytest.raises(EpWorkerFailed):
        server.run(REQUESTS[1:2])  # slot 0 again, allocated after command 1
    done = server.run()
    assert done[1].finish_reason == "length" and len(done[1].tokens) == 6  # untouched by the old report


def test_on_lost_rank_is_recover_or_stop() -> None:
    model = solo_model()
    assert Server(model).on_lost_rank == "recover" and Server(model, on_lost_rank="stop").on_lost_rank == "stop"
    with pytest.raises(ValueError, match="on_lost_rank must be 'recover' or 'stop', got 'retry'"):
        Server(model, on_lost_rank="retry")  # type: ignore[arg-type]


def test_a_model_over_a_group_of_its_own_refuses_to_reshard() -> None:
    from metrale_model_engine.reform import Reform

    model = solo_model()
    model._own_group = True  # as built with group=...: a re-form does not carry that group over
    reform = Reform(0, 0, 1, (0,), (), (), (), 0.0, 0.0, 0.0, 1)
    with pytest.raises(ValueError, match="reduces over a group of its own"):
        model.ep_reformed(reform, [None] * 4)
