"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a body checked, turned into requests, and answered
as OpenAI answers, whole or as server-sent events ending in ``data: [DONE]``.

A streamed response's first chat chunk carries ``delta.role``; every choice gets exactly one
``finish_reason`` (``stop``: an end-of-sequence id or a stop string; ``length``: ``max_tokens``,
or the context); with ``stream_options.include_usage`` a last chunk has the usage and no choices.
A request that fails (the run stopped, a worker failed its command) ends its stream with an
``error`` event naming the cause, or is answered 500 with it.  A client that goes away cancels its
requests: their slots are freed at the next step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from ...reference import Request, Sampling, Tokenizer, TokenLogprobs
from ..engine import Engine
from ..protocol import MAX_SEED, ApiError, ChatBody, CompletionBody, Sampled, bad
from .chat import ChatTemplate, ChatTemplateError
from .streams import Choices, Piece, RequestFailed, sse


@dataclass(frozen=True)
class Served:
    """What the endpoints serve: the engine, the model's name and tokenizer, its chat template."""

    engine: Engine
    name: str
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"The model {model!r} does not exist: this server serves {self.name!r}", "model")

    def decode(self, tokens: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(tokens)


def _requests(
    served: Served, body: Sampled, prompts: Sequence[Sequence[int]], max_tokens: int | None, param: str,
    logprobs: int | None, where: str,
) -> list[Request]:  # fmt: skip
    """One request per prompt and choice, checked against the limits; the ``n`` choices of a seeded body
    draw with ``seed``, ``seed + 1``, ..."""
    limits = served.engine.limits
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    top_p = 1.0 if body.top_p is None else body.top_p
    temperature = body.checked_temperature()
    requests = []
    for number, prompt in enumerate(prompts):
        new = limits.new_tokens(prompt, max_tokens, param, where if len(prompts) == 1 else f"{where}[{number}]")
        for choice in range(body.n):
            seed = None if body.seed is None else (body.seed + choice) % (MAX_SEED + 1)
            sampling = Sampling(temperature, top_k, top_p, seed)
            request_id = served.engine.new_id()
            requests.append(Request(request_id, tuple(prompt), new, sampling, logprobs, body.ignore_eos))
    return requests


def _completion_prompts(served: Served, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad("prompt", "an empty list: give a string, a list of strings, token ids or lists of them")
    texts = [item for item in prompt if isinstance(item, str)]
    if texts and served.tokenizer is None:
        raise bad("prompt", "this model has no tokenizer.json: give the prompt as token ids")
    if texts:
        assert served.tokenizer is not None
        return [served.tokenizer.encode(text) for text in texts]
    if all(isinstance(item, int) for item in prompt):
        return [[int(item) for item in prompt if isinstance(item, int)]]
    return [list(item) for item in prompt if isinstance(item, list)]


async def completions(served: Served, body: CompletionBody) -> Response:
    """Answer ``POST /v1/completions``."""
    served.check_model(body.model)
    stops = body.stops()
    prompts = _completion_prompts(served, body.prompt)
    requests = _requests(served, body, prompts, body.max_tokens, "max_tokens", body.logprobs, "prompt")
    choices = Choices(served.engine, requests, served.decode, stops, sum(map(len, prompts)))
    head = {"id": f"cmpl-{requests[0].id}", "object": "text_completion", "created": int(time.time())}
    head["model"] = served.name

    def choice(piece: Piece, offset: int) -> dict[str, Any]:
        logprobs = None if body.logprobs is None else _completion_logprobs(served, piece.logprobs, offset)
        return {"index": piece.index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish}

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        offsets = [0] * len(requests)

        def chunks(pieces: list[Piece]) -> dict[str, Any]:
            out = []
            for piece in pieces:
                out.append(choice(piece, offsets[piece.index]))
                offsets[piece.index] += len(piece.text)
            return {**head, "choices": out}

        return _stream(choices, chunks, head, include_usage, first=None)
    whole = await _gather(choices, len(requests))
    return JSONResponse({**head, "choices": [choice(piece, 0) for piece in whole], "usage": choices.usage()})


async def chat_completions(served: Served, body: ChatBody) -> Response:
    """Answer ``POST /v1/chat/completions``."""
    served.check_model(body.model)
    if served.chat_template is None:
        raise bad(
            "messages",
            f"the model {served.name!r} has no chat template (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja): start the server with --chat-template FILE, or use /v1/completions",
        )
    if served.tokenizer is None:
        raise bad("messages", f"the model {served.name!r} has no tokenizer.json to encode the messages with")
    stops = body.stops()
    messages = [message.as_template_input(index) for index, message in enumerate(body.messages)]
    try:
        text = served.chat_template.render(messages)
    except ChatTemplateError as error:
        raise bad("messages", str(error)) from None
    prompt = served.tokenizer.encode(text, add_special_tokens=False)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    most, param = (body.max_completion_tokens, "max_completion_tokens")
    if most is None:
        most, param = body.max_tokens, "max_tokens"
    requests = _requests(served, body, [prompt], most, param, body.wanted_logprobs(), "messages")
    choices = Choices(served.engine, requests, served.decode, stops, len(prompt))
    head = {"id": f"chatcmpl-{requests[0].id}", "object": "chat.completion", "created": int(time.time())}
    head["model"] = served.name

    def logprobs(piece: Piece) -> dict[str, Any] | None:
        return None if not body.logprobs else {"content": [_chat_logprob(served, entry) for entry in piece.logprobs]}

    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunk_head = {**head, "object": "chat.completion.chunk"}

        def chunks(pieces: list[Piece]) -> dict[str, Any]:
            out = [
                {"index": piece.index, "delta": {"content": piece.text} if piece.text else {},
                 "logprobs": logprobs(piece), "finish_reason": piece.finish}
                for piece in pieces
            ]  # fmt: skip
            return {**chunk_head, "choices": out}

        first = {**chunk_head, "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for index in range(len(requests))
        ]}  # fmt: skip
        return _stream(choices, chunks, chunk_head, include_usage, first=first)
    whole = await _gather(choices, len(requests))
    out = [
        {"index": piece.index, "message": {"role": "assistant", "content": piece.text}, "logprobs": logprobs(piece),
         "finish_reason": piece.finish}
        for piece in whole
    ]  # fmt: skip
    return JSONResponse({**head, "choices": out, "usage": choices.usage()})


async def _gather(choices: Choices, count: int) -> list[Piece]:
    """Every choice whole, in order; a failed request is answered 500 with its cause."""
    whole = [Piece(index) for index in range(count)]
    try:
        async for pieces in choices.pieces():
            for piece in pieces:
                into = whole[piece.index]
                into.text += piece.text
                into.tokens += piece.tokens
                into.logprobs += piece.logprobs
                into.finish = piece.finish or into.finish
    except RequestFailed as failed:
        raise ApiError(500, str(failed)) from None
    finally:
        choices.cancel()  # the client left before the end (a cancelled coroutine): free the slots
    return whole


def _stream(
    choices: Choices, chunks: Callable[[list[Piece]], dict[str, Any]], head: dict[str, Any], include_usage: bool,
    first: dict[str, Any] | None,
) -> StreamingResponse:  # fmt: skip
    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield sse(first)
            async for pieces in choices.pieces():
                if pieces:
                    yield sse(chunks(pieces))
            if include_usage:
                yield sse({**head, "choices": [], "usage": choices.usage()})
        except RequestFailed as failed:
            yield sse({"error": {"message": str(failed), "type": "server_error", "param": None, "code": 500}})
        finally:
            choices.cancel()  # a client gone mid-stream: its requests end, their slots are freed
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _completion_logprobs(served: Served, entries: Sequence[TokenLogprobs], offset: int) -> dict[str, Any]:
    tokens = [served.decode([entry.token]) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{served.decode([token]): logprob for token, logprob in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def _chat_logprob(served: Served, entry: TokenLogprobs) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = served.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**one(entry.token, entry.logprob), "top_logprobs": [one(token, lp) for token, lp in entry.top]}
