"""What a request may ask of ``Server`` beyond its tokens: to be cancelled between steps, log-probabilities of
each token and its likeliest alternatives, and to run past an end-of-sequence id."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine import EpLink, ProtocolVersion
from metrale_model_engine.reference import CMD_ALLOC, LmState, ReferenceLm, Request, Server, Tokenizer
from metrale_model_engine.testing import RecordingTransport
from metrale_model_engine.transport import SoloTransport

from helpers.greedy import byte_ids

pytestmark = pytest.mark.torch


def solo_server(slots: int = 2) -> Server:
    return Server(ReferenceLm(EpLink(SoloTransport(), num_slots=slots)), prefill_chunk=8)


def request(request_id: int, text: str, new: int = 6) -> Request:
    return Request(request_id, tuple(byte_ids(text)), new)


def test_a_cancelled_request_frees_its_slot_at_once_and_the_others_go_on() -> None:
    server = solo_server()
    server.submit(request(0, "Licensed under the"))
    server.submit(request(1, "THE SOFTWARE IS"))
    server.step()
    server.step()
    held = [state.seq_id for state in server.slots if isinstance(state, LmState)]
    assert held == [0, 1]
    cancelled = server.cancel(0)
    assert cancelled.finish_reason == "cancelled" and cancelled.finished_step == 2
    assert server.slots[0] is None and server.slots[1] is not None  # freed before the next step
    done = server.run()
    alone = solo_server().run([request(1, "THE SOFTWARE IS")])
    assert done[1].tokens == alone[1].tokens and done[1].finish_reason == "length"
    assert len(done[0].tokens) < 6


def test_a_waiting_request_leaves_the_queue_and_sends_nothing() -> None:
    transport = RecordingTransport(2)
    model = ReferenceLm(EpLink(transport, num_slots=1, protocol=ProtocolVersion.V2), all_reduce=lambda _: None)
    server = Server(model)
    server.submit(request(0, "Licensed"))
    server.submit(request(1, "THE"))
    server.step()
    sent = len(transport.messages)
    assert server.cancel(1).finish_reason == "cancelled"
    assert len(transport.messages) == sent
    assert not server.completions[1].tokens and server.completions[1].admitted_step is None


def test_a_running_request_is_freed_on_every_rank_by_a_command_of_its_own() -> None:
    transport = RecordingTransport(2)
    model = ReferenceLm(EpLink(transport, num_slots=2, protocol=ProtocolVersion.V2), all_reduce=lambda _: None)
    server = Server(model)
    server.submit(request(0, "Licensed"))
    server.step()
    sent = len(transport.messages)
    server.cancel(0)
    (free,) = transport.messages[sent:]
    expected = RecordingTransport(2)
    EpLink(expected, num_slots=2, protocol=ProtocolVersion.V2).send_command(0, CMD_ALLOC, 0)
    assert list(free) == list(expected.messages[-1])
    assert server.slots == [None, None] and not server.busy


def test_cancel_refuses_an_unknown_id_and_a_shut_down_server_and_leaves_a_finished_request() -> None:
    server = solo_server()
    done = server.run([request(3, "you may", 2)])
    assert server.cancel(3) is done[3] and done[3].finish_reason == "length"
    with pytest.raises(KeyError):
        server.cancel(4)
    server.shutdown()
    with pytest.raises(RuntimeError, match="the server was shut down"):
        server.cancel(3)


def test_logprobs_are_the_models_own_and_the_likeliest_come_first() -> None:
    server = solo_server()
    asked = Request(0, tuple(byte_ids("Licensed under the")), 4, logprobs=3)
    done = server.run([asked, request(1, "Licensed under the", 4)])
    kept = done[0].logprobs
    assert [entry.token for entry in kept] == done[0].tokens == done[1].tokens
    assert not done[1].logprobs
    prompt = list(asked.prompt)
    with torch.no_grad():
        logits = ReferenceLm(EpLink(SoloTransport(), num_slots=1)).lm.forward(torch.tensor([prompt]))[0, -1]
    expected = torch.log_softmax(logits, dim=-1)
    first = kept[0]
    assert len(first.top) == 3 and first.top[0][0] == first.token  # greedy: the chosen one is the likeliest
    assert first.logprob == pytest.approx(float(expected[first.token]), abs=1e-4)
    assert [p for _, p in first.top] == sorted((p for _, p in first.top), reverse=True)
    assert [t for t, _ in first.top] == torch.topk(expected, 3).indices.tolist()


def test_logprobs_zero_keeps_the_tokens_own_alone() -> None:
    done = solo_server().run([Request(0, tuple(byte_ids("THE")), 2, logprobs=0)])
    assert [entry.top for entry in done[0].logprobs] == [(), ()]
    assert all(entry.logprob <= 0 for entry in done[0].logprobs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"logprobs": 21}, ValueError, r"request 0: logprobs must be in 0 \.\.= 20, got 21"),
        ({"logprobs": -1}, ValueError, r"logprobs must be in 0 \.\.= 20, got -1"),
        ({"logprobs": 2.0}, TypeError, "request 0: logprobs must be an int, got float"),
        ({"ignore_eos": 1}, TypeError, "request 0: ignore_eos must be a bool, got int"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Request(0, (1, 2), 3, **kwargs)  # type: ignore[arg-type]


def test_ignore_eos_runs_past_an_end_of_sequence_id() -> None:
    plain = solo_server().run([request(0, "Licensed under the", 8)])[0].tokens
    eos = plain[2]
    stopped = Server(solo_server().model, eos_token_ids=[eos]).run([request(0, "Licensed under the", 8)])[0]
    assert stopped.tokens == plain[: plain.index(eos) + 1] and stopped.finish_reason == "stop"
    ignoring = Request(0, tuple(byte_ids("Licensed under the")), 8, ignore_eos=True)
    went_on = Server(solo_server().model, eos_token_ids=[eos]).run([ignoring])[0]
    assert went_on.tokens == plain and went_on.finish_reason == "length"


def test_a_tokenizer_encodes_with_or_without_its_special_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, processors

    raw = Raw(models.WordLevel({"<s>": 0, "a": 1}, unk_token="a"))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tokenizer.encode("a") == [0, 1]
    assert tokenizer.encode("a", add_special_tokens=False) == [1]
