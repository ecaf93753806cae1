"""The server's command line: the demo's model options (``--model``, ``--world-size``, ``--transport``,
``--dtype``, ``--slots``, ``--max-seq-len``, ...) and its own; a bad argument exits 2 with one ``error:`` line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .._demo.args import OneLineParser, model_options, number, whole

PROG = "python -m metrale_model_engine.serve"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The server's command line (``sys.argv[1:]`` by default)."""
    parser = OneLineParser(
        prog=PROG,
        description="An OpenAI-compatible HTTP server over the reference model served by N ranks "
        "(rank 0 serves HTTP; the others run its commands).",
    )
    model_options(parser, slots=16, world_size=1)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    add("--port", type=lambda t: whole(t, 0, 65535), default=8000,
        help="the port to listen on (default 8000; 0: a free one, said in the first lines)")  # fmt: skip
    add("--served-model-name", default=None, metavar="NAME",
        help="the model's name in the API (default: the checkpoint directory's name)")  # fmt: skip
    add("--max-waiting", type=lambda t: whole(t, 0), default=256, metavar="N",
        help="requests that may wait for a slot; past them a request is answered 503 (default 256)")  # fmt: skip
    add("--chat-template", type=Path, default=None, metavar="FILE",
        help="a jinja2 chat template (default: the checkpoint's chat_template.jinja, else "
             "tokenizer_config.json's)")  # fmt: skip
    add("--drain-timeout", type=lambda t: number(t, 0.0, 86400.0), default=30.0, metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish (default 30)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.chat_template is not None and not args.chat_template.is_file():
        parser.error(f"argument --chat-template: {str(args.chat_template)!r} is not a file")
    return args
