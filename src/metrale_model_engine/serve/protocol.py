"""The OpenAI request bodies, checked field by field, and OpenAI's error body.

Every refusal is an [`ApiError`][metrale_model_engine.serve.protocol.ApiError]: its status (400 for a bad
field, 404 for an unknown model, 503 when the server cannot take the request now) and a message
that names the field (also in ``param``) and the value.  FastAPI's own validation errors
(its 422) become the same 400 in one place, the app's handler, through ``from_validation``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS: Final = 5
"""The most alternatives a completion's ``logprobs`` (a chat's ``top_logprobs``) may ask for, as OpenAI's API."""
MAX_SEED: Final = 2**63 - 1


class ApiError(Exception):
    """A refused request: its HTTP status, message, the field at fault and OpenAI's error type."""

    def __init__(self, status: int, message: str, param: str | None = None, *, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The error as OpenAI writes it: ``{"error": {"message", "type", "param", "code"}}``."""
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}
        code = {404: "model_not_found"}.get(self.status)
        error_type = kind.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": code}}


def bad(param: str, message: str) -> ApiError:
    """A 400 naming ``param``: ``"<param>: <message>"``."""
    return ApiError(400, f"{param}: {message}", param)


def from_validation(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The first of pydantic's errors as a 400 naming the field and the value."""
    if not errors:
        return ApiError(400, "the request body is not valid")
    error = errors[0]
    location = [part for part in error.get("loc", ()) if part != "body" and not _union_member(part)]
    if error.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', '')}".strip())
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".") or "body"
    if error.get("type") == "missing":
        return bad(param, "this field is required")
    message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
    return bad(param, f"{message[:1].lower()}{message[1:]}, got {error.get('input')!r}")


def _union_member(part: object) -> bool:
    """Whether a location's part names the member of a union pydantic tried (``str``, ``list[int]``)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))


class _Body(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class Sampled(_Body):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def stops(self) -> list[str]:
        """The stop strings (none empty).  Raises ``ApiError`` (400) for an empty one."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for index, stop in enumerate(stops):
            if not stop:
                raise bad("stop" if isinstance(self.stop, str) else f"stop[{index}]", "a stop string is empty")
        if len(stops) > 4:
            raise bad("stop", f"at most 4 stop strings, got {len(stops)}")
        return stops

    def checked_temperature(self) -> float:
        temperature = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(temperature):
            raise bad("temperature", f"must be a finite number, got {temperature}")
        return temperature


class CompletionBody(Sampled):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class Message(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    model_config: ClassVar[ConfigDict] = ConfigDict(strict=True, extra="allow")

    def as_template_input(self, index: int) -> dict[str, Any]:
        """The message as a template reads it: its content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for number, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{index}].content[{number}]", f"only text parts are served, got {part!r}")
                texts.append(part["text"])
            content = "".join(texts)
        extra = self.model_extra or {}
        return {**extra, "role": self.role, "content": content, **({"name": self.name} if self.name else {})}


class ChatBody(Sampled):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
