"""The FastAPI app: the two generating endpoints, ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and
OpenAI's error body for every refusal (FastAPI's 422 included, as a 400 naming the field).

``/health`` is 200 while the run serves and 503 from the moment it drains or stops (with the cause).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ..metrics import Metrics
from ..protocol import ApiError, ChatBody, CompletionBody, from_validation
from .routes import Served, chat_completions, completions


def build_app(served: Served, metrics: Metrics) -> FastAPI:
    """The app serving ``served``, its metrics read from ``metrics``."""
    app = FastAPI(title="metrale-serve", openapi_url=None, docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def refused(_: Request, error: ApiError) -> Response:
        headers = {} if error.retry_after is None else {"Retry-After": str(error.retry_after)}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> Response:
        return await refused(_, from_validation(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> Response:
        status = error.status_code
        return await refused(_, ApiError(status, str(error.detail)))

    @app.post("/v1/completions")
    async def post_completions(body: CompletionBody) -> Response:
        return await completions(served, body)

    @app.post("/v1/chat/completions")
    async def post_chat(body: ChatBody) -> Response:
        return await chat_completions(served, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": served.name, "object": "model", "created": created, "owned_by": "metrale-model-engine"}
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> Response:
        engine = served.engine
        if engine.state == "serving":
            return JSONResponse({"status": "ok"})
        cause = "the server is shutting down" if engine.state == "draining" else f"the run stopped: {engine.cause}"
        return JSONResponse({"status": engine.state, "cause": cause}, status_code=503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
