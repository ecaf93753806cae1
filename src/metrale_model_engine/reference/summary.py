"""What a served run did, as a JSON-ready summary and the head's closing lines (the demo prints both)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .checkpoint import Tokenizer
from .scheduler import Server
from .serving import ReferenceLm


def run_summary(
    model: ReferenceLm, server: Server, wall_s: float, tokenizer: Tokenizer | None = None
) -> dict[str, object]:
    """The run of ``server`` over ``model`` that took ``wall_s`` seconds: its link, its steps, every request.

    ``recoveries`` lists the run's recoveries from lost worker ranks (``Server.recoveries``): the ranks before and
    after, the ranks lost and how, each part's milliseconds, the requests carried on and failed.  ``decode_step``
    splits the head's decode steps into compute, collectives and
    protocol (shares of their total time); it counts none when every request ended
    with its prefill.  ``kv_cache`` gives the pool (its blocks, their size), the most
    blocks held at once, the prompt tokens looked up in the prefix cache and found
    there, and the requests preempted.  ``requests`` holds every request in the order submitted: its
    prompt's ids and generated ``tokens`` (an end-of-sequence id included when
    generated), why it finished, the seed it was sampled with (``null`` when
    greedy), and with a ``tokenizer`` their text (``null`` without).  Call it on the
    head, before ``server.shutdown()``.
    """

    def text(tokens: Sequence[int]) -> str | None:
        return None if tokenizer is None else tokenizer.decode(tokens)

    link = model.ep_link
    generated = sum(len(c.tokens) for c in server.completions.values())
    steps = server.decode_steps
    total = sum(step.total_s for step in steps)

    def share(part: float) -> float:
        return round(part / total, 4) if total else 0.0

    blocks = model.kv_blocks
    backend = "none"
    if model.is_ep():
        import torch.distributed as dist

        backend = str(dist.get_backend())
    return {
        "ranks": link.world_size,
        "protocol": link.protocol.value,
        "transport": type(link.transport).__name__,
        "backend": backend,
        "slots": link.num_slots,
        "steps": server.steps,
        "tokens": generated,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(generated / wall_s, 1) if wall_s > 0 else 0.0,
        "decode_step": {
            "count": len(steps),
            "median_ms": round(statistics.median(s.total_s for s in steps) * 1e3, 3) if steps else 0.0,
            "largest_batch": max((step.batch for step in steps), default=0),
            "protocol_share": share(sum(step.protocol_s for step in steps)),
            "collectives_share": share(sum(step.collectives_s for step in steps)),
            "compute_share": share(sum(step.compute_s for step in steps)),
            "protocol_us_median": round(statistics.median(s.protocol_s for s in steps) * 1e6, 1) if steps else 0.0,
        },
        "kv_cache": {
            "blocks": blocks.num_blocks,
            "block_size": blocks.block_size,
            "peak_blocks_used": blocks.peak_used,
            "prefix_caching": server.prefix_caching,
            "prefix_query_tokens": blocks.query_tokens,
            "prefix_hit_tokens": blocks.hit_tokens,
            "preemptions": server.preemptions,
        },
        "recoveries": [
            {
                "ranks_before": r.ranks_before,
                "ranks": r.world_size,
                "lost": [{"rank": lost.rank, "how": lost.how} for lost in r.lost],
                "detect_ms": round(r.detect_s * 1e3, 1),
                "reform_ms": round(r.reform_s * 1e3, 1),
                "reload_ms": round(r.reload_s * 1e3, 1),
                "recompute_ms": None if r.recompute_s is None else round(r.recompute_s * 1e3, 1),
                "carried_on": list(r.requeued),
                "failed": list(r.failed),
            }
            for r in server.recoveries
        ],
        "requests": [
            {
                "id": c.request.id,
                "prompt": text(c.request.prompt),
                "prompt_ids": list(c.request.prompt),
                "tokens": c.tokens,
                "text": text(c.tokens),
                "finish_reason": c.finish_reason,
                "seed": c.seed,
                "submitted_step": c.submitted_step,
                "admitted_step": c.admitted_step,
                "finished_step": c.finished_step,
                "preemptions": c.preemptions,
            }
            for c in server.completions.values()
        ],
    }


def summary_lines(summary: dict[str, object]) -> list[str]:
    """The head's lines for a ``run_summary``: the throughput, how a decode step splits, the KV cache."""
    step = summary["decode_step"]
    requests = summary["requests"]
    kv = summary["kv_cache"]
    assert isinstance(step, dict) and isinstance(requests, list) and isinstance(kv, dict)
    lines = [
        f"[head] {len(requests)} requests, {summary['tokens']} tokens in {summary['wall_s']:.2f} s: "
        f"{summary['tokens_per_s']:.0f} tokens/s"
    ]
    recoveries = summary.get("recoveries") or []
    assert isinstance(recoveries, list)
    if recoveries:
        sizes = " -> ".join(str(size) for size in [recoveries[0]["ranks_before"], *(r["ranks"] for r in recoveries)])
        carried = sum(len(r["carried_on"]) for r in recoveries)
        failed = sum(len(r["failed"]) for r in recoveries)
        lines.append(
            f"[head] {len(recoveries)} recover{'y' if len(recoveries) == 1 else 'ies'} from lost workers "
            f"({sizes} ranks): {carried} request(s) carried on, {failed} failed"
        )
    if not step["count"]:
        lines.append("[head] no decode step: every request ended with its prefill")
    else:
        lines.append(
            f"[head] a decode step (median {step['median_ms']:.2f} ms, batches up to {step['largest_batch']}): "
            f"compute {step['compute_share']:.1%}, collectives {step['collectives_share']:.1%}, "
            f"protocol {step['protocol_share']:.2%} (median {step['protocol_us_median']:.0f} us)"
        )
    queried, hits = kv["prefix_query_tokens"], kv["prefix_hit_tokens"]
    found = (
        f"{hits:,} of {queried:,} prompt tokens found cached ({hits / queried:.1%})" if queried else "none looked up"
    )
    lines.append(
        f"[head] KV cache: {kv['blocks']:,} blocks of {kv['block_size']}, at most {kv['peak_blocks_used']:,} in use; "
        f"prefix cache {'on' if kv['prefix_caching'] else 'off'}: {found}; {kv['preemptions']} preemption(s)"
    )
    return lines
