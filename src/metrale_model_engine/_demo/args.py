"""The demo's command line: every option, its type and range, each refusal one ``error:`` line (exit 2).

What needs the model to check (the world size, the prompts against its vocabulary
and context, the memory its shards take) is checked by ``demo.main`` once the
checkpoint is open, still before any rank starts.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn

from .._core.protocol import ProtocolVersion
from .._core.words import U32_MAX
from ..shm import MAX_WORLD_SIZE

PROMPT_TEXT = "text"
PROMPT_IDS = "ids"


def whole(text: str, least: int, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
    return value


def number(text: str, least: float, most: float, *, open_below: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    below = value <= least if open_below else value < least
    if math.isnan(value) or below or value > most:
        low = "(" if open_below else "["
        raise argparse.ArgumentTypeError(f"must be in {low}{least:g}, {most:g}], got {text}")
    return value


_UNITS: Final = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def kv_memory(text: str) -> int | float:
    """``--kv-memory``: bytes (``67108864``, ``64MiB``, ``1.5GiB``: KiB, MiB, GiB, TiB) as an int, or a fraction in
    ``(0, 1]`` of the memory free after the weights (``0.8``, ``1.0``) as a float."""
    accepted = "bytes (67108864, 64MiB, 2GiB) or a fraction of the free memory in (0, 1] (0.8)"
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"must be {accepted}, got {text!r}")
    number = match.group(1)
    if "." in number and not unit:
        fraction = float(number)
        if not 0 < fraction <= 1:
            raise argparse.ArgumentTypeError(
                f"a fraction of the free memory must be in (0, 1], got {text!r} (or bytes: 67108864, 64MiB, 2GiB)"
            )
        return fraction
    size = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if size < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least 1 byte, got {text!r} (or a fraction of the free memory in (0, 1]: 0.8)"
        )
    return size


def _world_size(text: str) -> int:
    value = whole(text, 1)
    if value > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WORLD_SIZE} (the most ranks one ring serves)")
    return value


def _ids(text: str) -> tuple[int, ...]:
    """``1,2,3`` as token ids (the empty prompt is refused later, with the prompt's number)."""
    try:
        return tuple(whole(item.strip(), 0, U32_MAX) for item in text.split(",")) if text.strip() else ()
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"a comma-separated list of token ids; an id {error}") from None


class _Prompts(argparse.Action):
    """``--prompt`` and ``--prompt-ids`` append to one list, in the order given: ``(kind, value)``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        prompts = list(getattr(namespace, self.dest) or [])
        prompts.append((PROMPT_IDS if option_string == "--prompt-ids" else PROMPT_TEXT, values))
        setattr(namespace, self.dest, prompts)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is one ``error: ...`` line, as every other refusal of the program."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (--help lists the options)\n")


def model_options(parser: argparse.ArgumentParser, *, slots: int, world_size: int) -> None:
    """The options of a model served on N ranks, which the demo and the HTTP server share (``--slots``'s
    default is ``slots``, ``--world-size``'s ``world_size``)."""
    add = parser.add_argument
    add("--model", type=Path, default=None, metavar="DIR",
        help="a checkpoint directory in the Hugging Face layout, MixtralForCausalLM or Qwen3MoeForCausalLM "
             "(default: the shipped model)")  # fmt: skip
    add("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="what the model runs in (default: the checkpoint's own dtype)")  # fmt: skip
    add("--max-seq-len", type=lambda t: whole(t, 1), default=None, metavar="N",
        help="the context each slot holds (default: the model's max_position_embeddings)")  # fmt: skip
    add("--world-size", type=_world_size, default=world_size,
        help=f"local ranks, at most the model's attention heads, which they split as evenly as they can with its "
             f"experts (default {world_size}; torchrun sets it)")  # fmt: skip
    versions = [p.value for p in ProtocolVersion]
    add("--protocol", choices=versions, default=None, help="default: METRALE_EP_PROTOCOL, else v1")
    add("--slots", type=lambda t: whole(t, 1, U32_MAX), default=slots,
        help=f"sequences served at once (default {slots}; at most {U32_MAX}, a u32, and what the memory "
             "holds)")  # fmt: skip
    add("--prefill-chunk", type=lambda t: whole(t, 1), default=16, help="most prompt tokens per prefill (default 16)")
    add("--sync-every", type=lambda t: whole(t, 1), default=16, help="steps between sync points (default 16)")
    add("--device", choices=["cpu", "cuda"], default=None,
        help="where each rank keeps its shard (default: cuda with a CUDA device per local rank, else cpu)")  # fmt: skip
    add("--backend", choices=["gloo", "nccl"], default=None,
        help="what carries the all-reduces (default: nccl on --device cuda, else gloo)")  # fmt: skip
    add("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (one rank, --device cuda)")
    add("--threads", type=lambda t: whole(t, 1), default=None,
        help="torch threads per rank (default: 1 per rank with several ranks, 2 with one; "
        "see docs/reference.md, 'The demo')")  # fmt: skip
    add("--transport", choices=["auto", "shm", "torch"], default="auto",
        help="what carries the commands: shared memory (shm), the backend (torch), or shm when all ranks share "
             "a host (auto, the default)")  # fmt: skip
    add("--kv-memory", type=kv_memory, default=None, metavar="SIZE",
        help="each rank's KV cache, a pool of blocks every request draws on: bytes (67108864, 64MiB, 2GiB) or a "
             "fraction of the memory free after the weights (0.8) (default: 0.9 on cuda; on cpu, every slot's "
             "whole context)")  # fmt: skip
    add("--block-size", type=lambda t: whole(t, 1), default=16, metavar="N",
        help="positions of a block of the KV cache (default 16)")  # fmt: skip
    add("--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="compute every prompt whole, even where its first blocks are cached (prefix caching is on by "
             "default)")  # fmt: skip
    add("--on-lost-rank", choices=["recover", "stop"], default="recover",
        help="a worker rank lost (killed, exited, its host silent): the ranks left re-form and carry every request "
             "on (recover, the default), or the run stops (stop)")  # fmt: skip
    add("--check-kv", action="store_true",
        help="deeper sync points: every rank also checks that its KV cache holds what its forwards wrote")  # fmt: skip


def parse_args(argv: Sequence[str] | None = None, *, description: str = "") -> argparse.Namespace:
    """The demo's command line (``sys.argv[1:]`` by default); a bad argument exits 2 with one ``error:`` line.

    ``--json PATH`` is refused here when ``PATH``'s directory does not exist or ``PATH`` is a
    directory, not after the run.  ``prompts`` is ``None`` (the built-in prompts) or the
    ``(kind, value)`` pairs of ``--prompt`` and ``--prompt-ids`` in the order given.
    """
    parser = OneLineParser(prog="python -m metrale_model_engine.demo", description=description)
    model_options(parser, slots=4, world_size=2)
    add = parser.add_argument
    add("--prompt", dest="prompts", action=_Prompts, metavar="TEXT", default=None,
        help="a prompt, encoded by the model's tokenizer.json (repeatable; replaces the built-in prompts)")  # fmt: skip
    add("--prompt-ids", dest="prompts", action=_Prompts, type=_ids, metavar="1,2,3",
        help="a prompt as token ids (repeatable; with --prompt, in the order given)")  # fmt: skip
    add("--temperature", type=lambda t: number(t, 0.0, 1e6), default=0.0,
        help="sample at this temperature (default 0: greedy)")  # fmt: skip
    add("--top-k", type=lambda t: whole(t, 0), default=0, help="sample among the K likeliest tokens (default 0: all)")
    add("--top-p", type=lambda t: number(t, 0.0, 1.0, open_below=True), default=1.0,
        help="sample among the likeliest tokens that reach this probability (default 1: all)")  # fmt: skip
    add("--seed", type=lambda t: whole(t, 0, 2**63 - 1), default=None,
        help="each request's generator seed when sampling (default: a random one, written to --json)")  # fmt: skip
    add("--max-new-tokens", type=lambda t: whole(t, 1), default=48, help="tokens generated per prompt (default 48)")
    add("--json", type=Path, default=None, metavar="PATH", help="also write the head's summary to PATH as JSON")
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.resolve().parent.is_dir():
        parser.error(f"argument --json: {str(args.json)!r} is in a directory that does not exist")
    if args.json is not None and args.json.is_dir():
        parser.error(f"argument --json: {str(args.json)!r} is a directory; name a file to write")
    return args
