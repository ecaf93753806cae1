"""The HTTP server as users use it: a real server process on the shipped model, driven by the official
``openai`` client (``OpenAI`` and ``AsyncOpenAI``): completions streamed and not, stop strings, seeds and
``n``, log-probabilities, every bad request and its error body, a full queue, a client that goes away.

One server serves the module (``shipped_server``); what it answers is checked against ``Server``
driven in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

import httpx
import openai

from metrale_model_engine import EpLink
from metrale_model_engine.reference import ReferenceLm, Request, Server
from metrale_model_engine.transport import SoloTransport

from helpers.greedy import byte_ids
from helpers.openai_server import CONSOLE_SCRIPT, RemoteServer, metric, metrics, sse_lines
from helpers.serial import Alone

pytestmark = pytest.mark.torch
MODEL = "tiny_moe"
FILLED = ("metrale_slots_used", "metrale_requests_waiting")
"""The gauges of a full server: 4 slots used, 2 requests waiting."""
PROMPT = "Licensed under the"


@pytest.fixture(scope="module")
def shipped_server() -> Iterator[RemoteServer]:
    """The installed ``metrale-serve`` console script: every test of the module drives it."""
    server = RemoteServer("--slots", "4", "--max-waiting", "2", "--drain-timeout", "2", program=CONSOLE_SCRIPT)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.output()


def greedy(text: str, new: int) -> str:
    """What ``Server`` continues ``text`` with, greedily, in this process."""
    server = Server(ReferenceLm(EpLink(SoloTransport(), num_slots=1)))
    return bytes(server.run([Request(0, tuple(byte_ids(text)), new)])[0].tokens).decode(errors="replace")


def test_the_first_line_names_the_model_and_every_ranks_pid(shipped_server: RemoteServer) -> None:
    first = shipped_server.lines[0]
    assert first.startswith("[head] MixtralForCausalLM from the shipped model") and "1 rank" in first
    assert shipped_server.pids == [shipped_server.process.pid]


def test_a_completion_is_the_servers_own_greedy_text(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client:
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert answer.object == "text_completion" and answer.model == MODEL and answer.id
    (choice,) = answer.choices
    assert choice.text == greedy(PROMPT, 24) and choice.finish_reason == "length"
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (18, 24)


def test_a_streamed_completion_gives_the_same_text_and_one_finish_reason(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == greedy(PROMPT, 24)
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_the_async_client_streams_several_prompts_at_once(shipped_server: RemoteServer) -> None:
    prompts = ["Licensed under the", "THE SOFTWARE IS", "you may not use", "Permission is"]

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> str:
        answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join([choice.text async for chunk in answer for choice in chunk.choices])

    async def all_of_them() -> list[str]:
        async with shipped_server.async_client() as client:
            return await asyncio.gather(*(stream(client, prompt) for prompt in prompts))

    assert asyncio.run(all_of_them()) == [greedy(prompt, 12) for prompt in prompts]


def test_a_stop_string_spanning_tokens_ends_the_text_before_it(shipped_server: RemoteServer) -> None:
    whole = greedy(PROMPT, 24)  # " Apache License, Version 2.0 ("
    stop = "License, V"  # ten tokens of the byte tokenizer
    assert stop in whole
    with shipped_server.client() as client:
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zz"])
        streamed = list(
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
        )
    assert answer.choices[0].text == whole[: whole.index(stop)] and answer.choices[0].finish_reason == "stop"
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == whole[: whole.index(stop)]
    assert [c.finish_reason for chunk in streamed for c in chunk.choices if c.finish_reason] == ["stop"]


def test_a_seed_gives_the_same_sampled_text_again_and_n_gives_that_many_choices(shipped_server: RemoteServer) -> None:
    asked: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 5.0, "seed": 7}
    with shipped_server.client() as client:
        first, second = (client.completions.create(**asked) for _ in range(2))
        two = client.completions.create(**asked, n=2)
        other = client.completions.create(**{**asked, "seed": 8})
    assert first.choices[0].text == second.choices[0].text
    assert other.choices[0].text != first.choices[0].text
    assert [choice.index for choice in two.choices] == [0, 1]
    assert two.choices[0].text == first.choices[0].text and two.choices[1].text != two.choices[0].text
    assert two.usage is not None and two.usage.prompt_tokens == 18 and two.usage.completion_tokens == 40


def test_logprobs_give_each_tokens_and_its_likeliest_alternatives(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client:
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.token_logprobs is not None and all(p is not None and p <= 0 for p in logprobs.token_logprobs)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [0, 1, 2, 3, 4]


def test_a_model_without_a_chat_template_is_told_so(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "has no chat template" in refused.value.message and "--chat-template FILE" in refused.value.message


def test_models_health_and_metrics(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client:
        assert [model.id for model in client.models.list()] == [MODEL]
    health = httpx.get(f"{shipped_server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    text = httpx.get(f"{shipped_server.url}/metrics", timeout=10).text
    for name in ("metrale_requests_running", "metrale_requests_waiting", "metrale_slots_used",
                 "metrale_kv_blocks_used", "metrale_preemptions_total", "metrale_prefix_cache_queries_total",
                 "metrale_prefix_cache_hits_total",
                 "metrale_prompt_tokens_total", "metrale_generation_tokens_total",
                 "metrale_time_to_first_token_seconds_bucket", "metrale_inter_token_latency_seconds_bucket",
                 'metrale_run_state{metrale_run_state="serving"} 1.0'):  # fmt: skip
        assert name in text, name
    assert metric(shipped_server, "metrale_generation_tokens_total") > 0


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"max_tokens": "x"}, "max_tokens", "max_tokens: input should be a valid integer, got 'x'"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens: input should be greater than or equal to 1, got 0"),
    ({"temperature": -1}, "temperature", "temperature: input should be greater than or equal to 0, got -1"),
    ({"top_p": 0}, "top_p", "top_p: input should be greater than 0, got 0"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"n": 0}, "n", "n: input should be greater than or equal to 1, got 0"),
    ({"n": 7}, "n", "the request makes 7 sequences (n times the prompts), more than this server holds at once"),
    ({"logprobs": 6}, "logprobs", "logprobs: input should be less than or equal to 5, got 6"),
    ({"seed": -1}, "seed", "seed: input should be greater than or equal to 0, got -1"),
    ({"stop": ""}, "stop", "stop: a stop string is empty"),
    ({"stop": ["a", ""]}, "stop[1]", "stop[1]: a stop string is empty"),
    ({"stream": "yes"}, "stream", "stream: input should be a valid boolean, got 'yes'"),
    ({"prompt": None}, "prompt", "prompt"),
    ({"prompt": []}, "prompt", "prompt: an empty list"),
    ({"prompt": [5, 300]}, "prompt", "prompt: token 1 is 300, outside the vocabulary (0 ..= 255)"),
    ({"prompt": "x" * 300}, "prompt", "prompt: the prompt has 300 tokens; this model's context is 256 tokens"),
    ({"max_tokens": 250}, "max_tokens", "250 new tokens and a prompt of 18 make 268, more than this model's context"),
    ({"echo": True}, "echo", "echo: input should be False, got True"),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_a_bad_request_is_a_400_naming_the_field_and_the_value(
    shipped_server: RemoteServer, change: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, **change}
    answer = httpx.post(f"{shipped_server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_or_has_no_model_is_a_400(shipped_server: RemoteServer) -> None:
    answer = httpx.post(f"{shipped_server.url}/v1/completions", content=b"{not json", timeout=30,
                        headers={"content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]
    answer = httpx.post(f"{shipped_server.url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
    assert "this field is required" in answer.json()["error"]["message"]


def test_an_unknown_model_is_a_404(shipped_server: RemoteServer) -> None:
    with shipped_server.client() as client, pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="gpt-5", prompt=PROMPT)
    assert "'gpt-5' does not exist" in refused.value.message and "'tiny_moe'" in refused.value.message


def test_bad_requests_disturb_no_other_stream(shipped_server: RemoteServer) -> None:
    async def run() -> str:
        async with shipped_server.async_client() as client:
            answer = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True
            )
            text = ""
            bad = iter(BAD[:6])
            async for chunk in answer:  # one bad request between two chunks, for the first six
                text += "".join(choice.text for choice in chunk.choices)
                if (change := next(bad, None)) is not None:
                    with pytest.raises(openai.BadRequestError):
                        await client.completions.create(model=MODEL, prompt=PROMPT, extra_body=change[0])
            return text

    assert asyncio.run(run()) == greedy(PROMPT, 40)


def test_a_full_queue_is_a_503_with_retry_after_and_a_client_gone_frees_its_slots(
    shipped_server: RemoteServer, alone: Alone
) -> None:
    """4 slots and 2 waiting: 6 sequences fill it; the 7th is refused; the client of the 6 leaves (timed alone: the
    slots filled within 10 s, freed within 2 s)."""
    with alone():
        before = metric(shipped_server, "metrale_requests_cancelled_total")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 230, "temperature": 0, "n": 6, "stream": True}
        import httpx as raw

        with raw.Client(timeout=30) as client, client.stream("POST", f"{shipped_server.url}/v1/completions", json=body):
            deadline = time.monotonic() + 10
            # Both from one answer: the first 4 end in a second or so, and the 2 waiting then take their slots.
            while (seen := metrics(shipped_server, *FILLED))[0] < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert seen == (4, 2)
            asked = {"model": MODEL, "prompt": PROMPT}
            full = httpx.post(f"{shipped_server.url}/v1/completions", json=asked, timeout=30)
            assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
            assert "the server is full: 6 requests running or waiting, at most 6" in full.json()["error"]["message"]
        gone = time.monotonic()
        with raw.Client(timeout=10) as reader:  # one connection: each read of /metrics takes a millisecond or two
            while metric(shipped_server, "metrale_slots_used", reader) and time.monotonic() < gone + 5:
                pass
            took = time.monotonic() - gone
        # A step of this model takes milliseconds; the cancel is applied before the next one
        # (tests/in_process/test_serve_app.py counts the steps); here the time, loosely bounded for a busy machine.
        assert metric(shipped_server, "metrale_slots_used") == 0, f"slots still used {took:.3f} s after the client left"
        assert took < 2.0, f"the slots were freed {took:.3f} s after the client left"
        assert metric(shipped_server, "metrale_requests_cancelled_total") == before + 6
    lines = sse_lines(f"{shipped_server.url}/v1/completions", {**body, "n": 1, "max_tokens": 5}, limit=10)
    assert lines[-1] == "data: [DONE]"  # served again
