"""One side of the paged cache's benchmark (``paged_cache.py``), alone in a fresh process: ``python paged_side.py
SPEC OUT`` serves the requests of the JSON ``SPEC`` one way and writes its figures to the JSON ``OUT``.

Two ways, both at one rank:

* ``ours``: :class:`~metrale_model_engine.reference.Server` over ``slots`` slots, its KV
  cache ``kv_memory`` bytes (``None``: every slot's whole context), prefix caching as
  ``prefix_caching`` says (``None``: neither argument passed, for the build before the paged
  cache, which ``paged_cache.py`` runs with its ``src`` first on ``PYTHONPATH``: this file
  uses only what both builds have);
* ``transformers``: ``transformers``' own continuous batching over its paged cache (its
  ``ContinuousBatchingManager``, what ``generate_batch`` drives), each request with its own
  ``max_new_tokens``, the cache ``kv_memory`` bytes (its blocks of ``page_size`` positions),
  at most ``slots`` requests and ``max_batch_tokens`` tokens a forward.

Before the clock starts each way serves ``warm`` (prompts of one new token each: the
kernels warmed, and for ours the prefix cache holding what they fed).  Then every
request arrives at once.  The figures: generated tokens per second, the median time
to a request's first token from that arrival, the largest batch (ours: the most
sequences decoded at once; transformers': the most sequences in one forward), the
steps (ours: scheduling steps; transformers': forwards of the model) and the median
time of a decode step (transformers': of a forward, prefill chunks included), the
bytes of the KV cache, the process's peak resident set (``VmHWM``), every request's
tokens, and for ours the prompt tokens found cached and the preemptions.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

import torch


class SideSpec(TypedDict):
    way: str
    """``"ours"`` or ``"transformers"``."""
    checkpoint: str
    max_seq_len: int
    slots: int
    kv_memory: int | None
    prefix_caching: bool | None
    prefill_chunk: int
    page_size: int
    max_batch_tokens: int | None
    """transformers' most tokens a forward (``None``: its default, 8,192)."""
    threads: int
    warm: list[list[int]]
    requests: list[tuple[list[int], int]]


def peak_bytes() -> int:
    """This process's peak resident set (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def kv_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's KV cache buffers (``kv_cache`` of every layer, paged or contiguous)."""
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith("kv_cache"))


def ours(spec: SideSpec) -> dict[str, Any]:
    from metrale_model_engine import EpLink
    from metrale_model_engine.reference import ReferenceLm, Request, Server
    from metrale_model_engine.transport import SoloTransport

    link = EpLink(SoloTransport(), num_slots=spec["slots"])
    paged: dict[str, Any] = {} if spec["prefix_caching"] is None else {"kv_memory": spec["kv_memory"]}
    caching: dict[str, Any] = {} if spec["prefix_caching"] is None else {"prefix_caching": spec["prefix_caching"]}
    model = ReferenceLm(link, checkpoint=spec["checkpoint"], max_seq_len=spec["max_seq_len"], **paged)
    warm = [Request(10_000 + i, tuple(prompt), 1) for i, prompt in enumerate(spec["warm"])]
    Server(model, eos_token_ids=(), prefill_chunk=spec["prefill_chunk"], **caching).run(warm)
    requests = [Request(i, tuple(prompt), new) for i, (prompt, new) in enumerate(spec["requests"])]
    first: dict[int, float] = {}

    def note(request: Request, _: int) -> None:
        first.setdefault(request.id, time.perf_counter())

    server = Server(model, eos_token_ids=(), prefill_chunk=spec["prefill_chunk"], on_token=note, **caching)
    blocks = getattr(model, "kv_blocks", None)
    hits_before = blocks.hit_tokens if blocks is not None else 0
    started = time.perf_counter()
    done = server.run(requests)
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": sum(len(c.tokens) for c in done.values()) / wall,
        "wall_s": wall,
        "ttft_s": statistics.median(first[i] - started for i in range(len(requests))),
        "most_concurrent": max((step.batch for step in server.decode_steps), default=0),
        "steps": server.steps,
        "step_s": statistics.median(step.total_s for step in server.decode_steps),
        "kv_bytes": kv_bytes(model),
        "hit_tokens": blocks.hit_tokens - hits_before if blocks is not None else 0,
        "preemptions": getattr(server, "preemptions", 0),
        "outputs": [done[i].tokens for i in range(len(requests))],
    }


def transformers_cb(spec: SideSpec) -> dict[str, Any]:
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    config = model.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) * 4  # fmt: skip
    assert spec["kv_memory"] is not None, "transformers' cache is given in bytes"
    settings = ContinuousBatchingConfig(
        page_size=spec["page_size"],
        num_blocks=spec["kv_memory"] // (spec["page_size"] * per_position),
        max_requests_per_batch=spec["slots"],
        max_batch_tokens=spec["max_batch_tokens"],
    )
    generation = GenerationConfig(  # type: ignore[no-untyped-call]  # (its **kwargs are untyped)
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1
    )
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    forwards: list[float] = []  # each forward's start, then its time
    sequences: list[int] = []  # each forward's sequences

    def started_forward(_: object, __: object, kwargs: dict[str, Any]) -> None:  # (its batch's ``cu_seq_lens_q``)
        forwards.append(time.perf_counter())
        sequences.append(len(kwargs["cu_seq_lens_q"]) - 1)

    def ended_forward(*_: object) -> None:
        forwards[-1] = time.perf_counter() - forwards[-1]

    model.register_forward_pre_hook(started_forward, with_kwargs=True)
    model.register_forward_hook(ended_forward)
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=settings, block=True, timeout=30
    ) as manager:
        for index, prompt in enumerate(spec["warm"]):
            manager.add_request(prompt, request_id=f"warm{index}", max_new_tokens=1)
        for _ in spec["warm"]:
            manager.get_result(timeout=600)
        forwards.clear()
        sequences.clear()
        started = time.perf_counter()
        for index, (prompt, new) in enumerate(spec["requests"]):
            manager.add_request(prompt, request_id=str(index), max_new_tokens=new, record_timestamps=True)
        while len(outputs) < len(spec["requests"]):
            result = manager.get_result(timeout=600)
            if result is None:
                raise SystemExit("transformers' continuous batching gave no result in 600 s")
            if result.error is not None:
                raise SystemExit(f"transformers' continuous batching failed {result.request_id}: {result.error}")
            if result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
                first[result.request_id] = (result.timestamps or [time.perf_counter()])[0]
        wall = time.perf_counter() - started
        cache = manager.batch_processor.cache if manager.batch_processor is not None else None
        held = int(cache.cache_tensor.numel()) if cache is not None and hasattr(cache, "cache_tensor") else -1
    return {
        "tokens_per_s": sum(len(tokens) for tokens in outputs.values()) / wall,
        "wall_s": wall,
        "ttft_s": statistics.median(first[key] - started for key in first),
        "most_concurrent": max(sequences),
        "steps": len(forwards),
        "step_s": statistics.median(forwards),
        "kv_bytes": held,
        "hit_tokens": 0,
        "preemptions": 0,
        "outputs": [outputs[str(i)] for i in range(len(spec["requests"]))],
    }


def main() -> None:
    spec: SideSpec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec["threads"])
    figures = ours(spec) if spec["way"] == "ours" else transformers_cb(spec)
    figures["peak_bytes"] = peak_bytes()
    Path(sys.argv[2]).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
