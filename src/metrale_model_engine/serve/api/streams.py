"""One HTTP request's choices as they arrive from the scheduler: text, log-probabilities, ends, and the
OpenAI JSON of each chunk or of the whole response.

A [`Choices`][metrale_model_engine.serve.api.streams.Choices] gets the
[`Update`][metrale_model_engine.serve.engine.Update]s of its requests (one per choice) in an asyncio queue, turns
tokens into text
([`TextStream`][metrale_model_engine.serve.api.text.TextStream]: held back where a stop string may begin), and
cancels a request whose stop string it found.  Its ``events`` yields, for each update, the
choices' text and ends; the endpoints write them as OpenAI's chunks or gather them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...reference import Request, TokenLogprobs
from ..engine import Engine, Update
from .text import TextStream

Decode = Callable[[Sequence[int]], str]


@dataclass
class Piece:
    """What one choice got at one update: its text, the tokens it came from, and how the choice ended."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: Literal["stop", "length"] | None = None


class RequestFailed(Exception):
    """A choice ended with an error (the run stopped, a worker failed its command): the message says which."""


class Choices:
    """The requests of one HTTP request, one per choice, and their text (see the module)."""

    def __init__(
        self, engine: Engine, requests: Sequence[Request], decode: Decode, stops: Sequence[str], prompt_tokens: int
    ) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._index = {request.id: index for index, request in enumerate(requests)}
        self._texts = [TextStream(decode, request.prompt, stops) for request in requests]
        self._open = set(self._index)
        self.generated: list[int] = [0] * len(requests)
        """Tokens each choice generated (up to a stop string found)."""
        self.prompt_tokens: int = prompt_tokens
        """The prompts' tokens, each prompt once (as OpenAI's ``usage`` counts them)."""
        engine.submit(requests, self._queue.put_nowait)

    @property
    def done(self) -> bool:
        return not self._open

    async def pieces(self) -> AsyncIterator[list[Piece]]:
        """Each update's pieces, until every choice has ended.

        Raises:
            RequestFailed: a choice failed (the others are cancelled).
        """
        while self._open:
            update = await self._queue.get()
            merged: dict[int, Piece] = {}
            while True:
                piece = self._piece(update)
                into = merged.setdefault(piece.index, Piece(piece.index))
                into.text += piece.text
                into.tokens += piece.tokens
                into.logprobs += piece.logprobs
                into.finish = piece.finish or into.finish
                if self._queue.empty():
                    break
                update = self._queue.get_nowait()
            yield [piece for piece in merged.values() if piece.text or piece.tokens or piece.finish]

    def cancel(self) -> None:
        """End the choices still open (their client went away); the slots are freed at the next step."""
        if self._open:
            self._engine.cancel(sorted(self._open))
            self._end(*self._open)

    def _piece(self, update: Update) -> Piece:
        index = self._index[update.request_id]
        if update.request_id not in self._open:  # after its stop string: the step that was under way
            return Piece(index)
        if update.error is not None:
            self.cancel()
            raise RequestFailed(update.error)
        text = self._texts[index]
        piece = Piece(index, logprobs=update.logprobs)
        for token in update.tokens:
            piece.text += text.add(token)
            piece.tokens.append(token)
            if text.stopped:
                break
        piece.logprobs = piece.logprobs[: len(piece.tokens)]
        self.generated[index] += len(piece.tokens)
        if text.stopped:
            piece.finish = "stop"
            self._engine.cancel([update.request_id])
        elif update.finish is not None:
            piece.text += text.finish()
            piece.finish = "stop" if update.finish == "stop" else "length"
        if piece.finish is not None:
            self._end(update.request_id)
        return piece

    def _end(self, *request_ids: int) -> None:
        for request_id in request_ids:
            self._open.discard(request_id)
        self._engine.ended(len(request_ids))

    def usage(self) -> dict[str, int]:
        completion = sum(self.generated)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` (or the text given), then a blank line."""
    import json

    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"
