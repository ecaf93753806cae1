"""An OpenAI-compatible HTTP server over the reference model served by N ranks (extras ``torch`` and ``serve``).

``python -m metrale_model_engine.serve --model DIR`` (or ``metrale-serve``) starts the ranks as
the demo does, and rank 0 serves ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` with FastAPI and uvicorn, while the
scheduler ([`Server`][metrale_model_engine.reference.Server]) steps on a thread of its own
(docs/serving.md).  Its modules, one job each: ``args`` (the command line), ``process`` (the
ranks, signals, uvicorn), ``engine`` (the scheduler's thread and the way to it), ``limits`` (what
is admitted), ``protocol`` (the request bodies and OpenAI's error body), ``metrics`` (Prometheus);
and ``api``, the endpoints and what they write: ``app`` and ``routes`` (the endpoints), ``streams`` (a
request's choices as they arrive), ``text`` (tokens to text, stop strings), ``chat`` (chat templates).
Nothing in the package imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["main", "script"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server (see ``process``); its exit status.  Needs the ``torch`` and ``serve`` extras."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as missing:
        print(
            f"error: the server needs the 'serve' extra ({missing.name} is missing): "
            "pip install 'metrale-model-engine[torch,serve]'",
            file=sys.stderr,
        )
        return 2
    from .process import main as run

    return run(argv)


def script() -> NoReturn:
    """``metrale-serve`` and ``python -m metrale_model_engine.serve``: ``main()``, then leave at once with its status.

    Every rank has ended by then and nothing is left to clean, so the process skips the interpreter's teardown
    (torch's takes seconds on a busy machine): a stopped run's exit status is out within a second.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
