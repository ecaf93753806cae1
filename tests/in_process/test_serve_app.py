"""The HTTP server's app and engine in this process, on the shipped model (one rank), through httpx's ASGI
transport: what a request's fields do to its tokens (``ignore_eos``, ``top_k``, ``top_p``), chat through a
template given as a file and the sandbox's refusal as a 400, a cancel applied before the next step, the prefix
cache's counters in ``/metrics``, and ``/health``'s 503 before a stopped run's error events."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

import httpx

from metrale_model_engine import EpLink, RunStopped
from metrale_model_engine.reference import ReferenceLm, Request, Server, Tokenizer
from metrale_model_engine.serve.api.app import build_app
from metrale_model_engine.serve.api.chat import ChatTemplate
from metrale_model_engine.serve.api.routes import Served
from metrale_model_engine.serve.engine import Engine, Update
from metrale_model_engine.serve.limits import Limits
from metrale_model_engine.serve.metrics import Metrics
from metrale_model_engine.transport import SoloTransport

from helpers.greedy import byte_ids

pytestmark = pytest.mark.torch
MODEL = "tiny_moe"
PROMPT = "Licensed under the"
SLOTS = 4
Test = Callable[[httpx.AsyncClient, Engine, Server], Awaitable[None]]


def greedy(text: str, new: int) -> str:
    server = Server(ReferenceLm(EpLink(SoloTransport(), num_slots=1)))
    return bytes(server.run([Request(0, tuple(byte_ids(text)), new)])[0].tokens).decode(errors="replace")


def serve(test: Test, *, template: ChatTemplate | None = None, eos_token_ids: Iterable[int] | None = None) -> None:
    """Run ``test`` against the app over the shipped model, its engine stepping on its own thread."""

    async def run() -> None:
        model = ReferenceLm(EpLink(SoloTransport(), num_slots=SLOTS))
        assert model.checkpoint.tokenizer_file is not None
        server = Server(model, eos_token_ids=eos_token_ids)
        metrics = Metrics()
        pool = model.kv_blocks
        limits = Limits(model.config.max_seq_len, model.config.vocab_size, SLOTS, 4, pool.num_blocks * pool.block_size)
        engine = Engine(server, limits, metrics, lambda cause: None)
        served = Served(engine, MODEL, Tokenizer.from_file(model.checkpoint.tokenizer_file), template)
        engine.start()
        try:
            transport = httpx.ASGITransport(app=build_app(served, metrics))
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=60) as client:
                await test(client, engine, server)
        finally:
            engine.close()
            await engine.closed

    asyncio.run(run())


async def complete(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    answer = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **fields})
    assert answer.status_code == 200, answer.text
    choice: dict[str, Any] = answer.json()["choices"][0]
    return {**choice, "usage": answer.json()["usage"]}


def test_ignore_eos_runs_past_an_end_of_sequence_id() -> None:
    whole = greedy(PROMPT, 24)  # " Apache License, Version 2.0 ("
    eos = ord("L")

    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        ended = await complete(client, max_tokens=24, temperature=0)
        assert (ended["text"], ended["finish_reason"]) == (whole[: whole.index("L") + 1], "stop")
        assert ended["usage"]["completion_tokens"] == whole.index("L") + 1
        past = await complete(client, max_tokens=24, temperature=0, ignore_eos=True)
        assert (past["text"], past["finish_reason"], past["usage"]["completion_tokens"]) == (whole, "length", 24)

    serve(test, eos_token_ids=[eos])


def test_top_k_1_and_a_tiny_top_p_keep_only_the_likeliest_token() -> None:
    whole = greedy(PROMPT, 20)

    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        hot = {"max_tokens": 20, "temperature": 5.0, "seed": 3}
        assert (await complete(client, **hot))["text"] != whole  # a hot draw is not the greedy text ...
        assert (await complete(client, **hot, top_k=1))["text"] == whole  # ... unless only the top token is left
        assert (await complete(client, **hot, top_p=1e-9))["text"] == whole
        assert (await complete(client, **hot, top_k=0))["text"] == (await complete(client, **hot))["text"]

    serve(test)


def test_chat_through_a_template_file_and_the_sandboxs_refusal_as_a_400(tmp_path: Path) -> None:
    given = tmp_path / "chat.jinja"
    given.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    template = ChatTemplate.find(tmp_path, given)
    assert template is not None and template.origin == str(given)
    expected = greedy("user: Licensed under\nassistant:", 8)

    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Licensed under"}], "max_tokens": 8}
        answer = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"] == {"role": "assistant", "content": expected}

    serve(test, template=template)

    async def refused(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = await client.post("/v1/chat/completions", json=body)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == "messages", answer.text
        assert error["message"].startswith("messages: the chat template failed: ") and "unsafe" in error["message"]
        assert not server.completions and server.steps == 0  # nothing reached the scheduler

    serve(refused, template=ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "test"))


def test_a_cancel_frees_the_slot_before_the_next_step() -> None:
    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        applied: list[tuple[int, bool]] = []
        cancel = server.cancel

        def recorded(request_id: int) -> Any:
            completion = cancel(request_id)
            applied.append((server.steps, all(state is None for state in server.slots)))
            return completion

        server.cancel = recorded  # type: ignore[method-assign]
        first = asyncio.Event()
        updates: list[Update] = []

        def sink(update: Update) -> None:
            updates.append(update)
            first.set()

        engine.submit([Request(engine.new_id(), tuple(byte_ids(PROMPT)), 200)], sink)
        await first.wait()
        called = server.steps
        engine.cancel([updates[0].request_id])
        while not applied:
            await asyncio.sleep(0.001)
        ((steps, free),) = applied
        assert steps - called <= 1, f"the cancel came {steps - called} steps after it was asked"
        assert free and engine.metrics.registry.get_sample_value("metrale_slots_used") == 0
        engine.ended(1)

    serve(test)


def test_a_prompt_sent_again_is_counted_in_the_prefix_caches_metrics() -> None:
    """The second of two requests with a 46-token prompt finds its first 2 blocks of 16 cached; the text is the
    same; /metrics counts both prompts looked up and the 32 tokens found."""
    prompt = "Licensed under the Apache License, Version 2.0"

    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        first = await complete(client, prompt=prompt, max_tokens=6, temperature=0)
        second = await complete(client, prompt=prompt, max_tokens=6, temperature=0)
        assert first["text"] == second["text"] == greedy(prompt, 6)
        text = (await client.get("/metrics")).text
        assert "metrale_prefix_cache_queries_total 92.0" in text and "metrale_prefix_cache_hits_total 32.0" in text

    serve(test)


def test_a_stopped_run_turns_health_to_503_before_any_stream_has_its_error_event() -> None:
    """The order the server keeps (in the process test it is a race with the exit): the state ``/health`` reads
    first, then the streams' error events, on one event loop."""
    why = "head: the run stopped: worker rank(s) [1] exited (killed by SIGKILL)"

    def stop() -> None:
        raise RunStopped(why)

    async def test(client: httpx.AsyncClient, engine: Engine, server: Server) -> None:
        assert (await client.get("/health")).status_code == 200
        errors: list[tuple[str | None, str]] = []
        ended = asyncio.Event()

        def sink(update: Update) -> None:
            if update.error is None:
                # The next step stops the run.
                server.step = stop  # type: ignore[method-assign]
                return
            errors.append((update.error, engine.state))
            ended.set()

        engine.submit([Request(engine.new_id(), tuple(byte_ids(PROMPT)), 200) for _ in range(2)], sink)
        await ended.wait()
        await asyncio.sleep(0)  # the other request's error event, delivered in the same callback
        assert errors == [(f"the run stopped: RunStopped: {why}", "stopped")] * 2
        health = await client.get("/health")
        assert health.status_code == 503, health.text
        assert health.json() == {"status": "stopped", "cause": f"the run stopped: RunStopped: {why}"}

    serve(test)
