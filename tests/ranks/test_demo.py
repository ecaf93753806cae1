"""The demo served by 1, 2 and 4 ranks started from this process (``demo.main``; its ranks fork from the
start server), compared by their JSON summaries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

import torch

from metrale_model_engine.demo import main

from helpers.demo_env import leave_torchrun

pytestmark = pytest.mark.torch

SHORT = ("--max-new-tokens", "12")


@pytest.fixture(autouse=True)
def as_started_by_hand(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Not under torchrun; this process's torch threads as they were (a one-rank demo sets them)."""
    leave_torchrun(monkeypatch)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


STEPS = ("submitted_step", "admitted_step", "finished_step", "preemptions")
"""When a request came, was admitted and ended, and how often it was preempted: one rank fuses prefills into decode
steps, so its steps differ, and a smaller cache preempts."""


def generated(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """What each request was asked and generated, without the steps at which it happened."""
    return [{key: value for key, value in request.items() if key not in STEPS} for request in summary["requests"]]


def served(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """Run the demo with ``args``; it must exit 0; its summary."""
    path = tmp_path / f"{name}.json"
    assert main([*args, "--json", str(path)]) == 0
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default run (2 ranks over shared memory), short: what every other world size must generate."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        leave_torchrun(monkeypatch)
        return served(tmp_path_factory.mktemp("demo"), "two", *SHORT)


@pytest.mark.parametrize(
    ("args", "transport"),
    [
        (("--world-size", "1"), "SoloTransport"),
        (("--world-size", "3"), "ShmTransport"),  # 4 heads and 4 experts as 2 + 1 + 1
        (("--world-size", "4", "--transport", "torch", "--protocol", "v2"), "TorchTransport"),
    ],
)
def test_every_world_size_generates_the_same_text(
    args: tuple[str, ...],
    transport: str,
    two_ranks: dict[str, Any],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert two_ranks["transport"] == "ShmTransport"
    summary = served(tmp_path, "other", *args, *SHORT)
    assert summary["transport"] == transport
    assert generated(summary) == generated(two_ranks)
    if transport == "SoloTransport":
        out = capfd.readouterr().out
        assert "[head] one rank: the single-GPU path, no command sent (is_ep() is false)" in out
        assert "1 rank," in out


def test_a_cache_too_small_for_every_request_at_once_preempts_and_generates_the_same_text(
    two_ranks: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """160 KiB at one rank: 20 blocks of 4 positions (4 KV heads), for 4 requests of 30 to 45 at first."""
    summary = served(tmp_path, "tight", "--world-size", "1", "--kv-memory", "160KiB", "--block-size", "4", *SHORT)
    assert generated(summary) == generated(two_ranks)
    kv = summary["kv_cache"]
    assert (kv["blocks"], kv["block_size"], kv["peak_blocks_used"]) == (20, 4, 20) and kv["preemptions"] > 0
    assert sum(request["preemptions"] for request in summary["requests"]) == kv["preemptions"]
    start = "[head] KV cache: 20 blocks of 4, at most 20 in use; prefix cache on: "
    end = f"; {kv['preemptions']} preemption(s)"
    assert any(line.startswith(start) and line.endswith(end) for line in capfd.readouterr().out.splitlines())
    assert kv["prefix_caching"] is True


def test_a_prompt_served_again_finds_its_blocks_cached_and_generates_the_same_text(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """One slot: the second request is admitted when the first has ended, its first 2 blocks of 16 (of a 46-token
    prompt, one token left to compute) cached on every rank.  The head's lines are read at one rank (in this
    process)."""
    text = "Licensed under the Apache License, Version 2.0"
    args = ("--slots", "1", "--prompt", text, "--prompt", text, *SHORT)
    cached = served(tmp_path, "cached", *args)
    kv = cached["kv_cache"]
    assert (kv["prefix_caching"], kv["prefix_query_tokens"], kv["prefix_hit_tokens"]) == (True, 92, 32)
    first, second = generated(cached)
    assert first["text"] == second["text"]
    capfd.readouterr()
    assert generated(served(tmp_path, "cached1", *args, "--world-size", "1")) == [first, second]
    assert "; prefix cache on: 32 of 92 prompt tokens found cached (34.8%); " in capfd.readouterr().out
    whole = served(tmp_path, "whole", *args, "--world-size", "1", "--no-prefix-caching")
    kv = whole["kv_cache"]
    assert (kv["prefix_caching"], kv["prefix_query_tokens"], kv["prefix_hit_tokens"]) == (False, 0, 0)
    assert "; prefix cache off: none looked up; " in capfd.readouterr().out
    assert generated(whole) == [first, second]


def test_a_request_cut_short_by_its_context_says_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A context of 40 positions (``--max-seq-len``): every prompt (18 to 33 tokens) + 24 passes it."""
    summary = served(tmp_path, "cut", "--max-new-tokens", "24", "--max-seq-len", "40", "--world-size", "1")
    cut = [line for line in capfd.readouterr().out.splitlines() if line.endswith("(cut short: its context is full)")]
    reasons = {request["id"]: request["finish_reason"] for request in summary["requests"]}
    assert set(reasons.values()) == {"context"} and len(cut) == len(reasons) == 6
    # 40 positions cached, and the token read from the last of them (never cached itself)
    assert [len(r["prompt_ids"]) + len(r["tokens"]) for r in summary["requests"]] == [41] * 6


def test_a_users_checkpoint_serves_the_tokens_of_transformers(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A Qwen3-MoE checkpoint without a tokenizer, prompts given as ids, in the order given; transformers stops at
    the checkpoint's end-of-sequence id as the demo does."""
    pytest.importorskip("transformers", reason="the test-torch extra is not installed")
    from helpers import oracle

    directory = oracle.write_checkpoint(tmp_path / "qwen", "qwen3_moe")
    free, _ = oracle.reference_tokens(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": free[1][3]}))
    prompts = [",".join(map(str, prompt)) for prompt in oracle.PROMPTS[:3]]
    expected, _ = oracle.reference_tokens(directory, oracle.PROMPTS[:3], stop_at_eos=True)
    args = ["--model", str(directory), "--max-new-tokens", str(oracle.NEW_TOKENS)]
    for prompt in prompts:
        args += ["--prompt-ids", prompt]
    requests = served(tmp_path, "qwen", *args, "--world-size", "2")["requests"]
    assert [r["tokens"] for r in requests] == expected
    assert [r["prompt_ids"] for r in requests] == [list(p) for p in oracle.PROMPTS[:3]]
    assert [r["finish_reason"] for r in requests] == ["stop" if t[-1] == free[1][3] else "length" for t in expected]
    assert requests[1]["finish_reason"] == "stop"
    assert all(r["text"] is None and r["prompt"] is None for r in requests)  # no tokenizer: ids only
    assert generated(served(tmp_path, "qwen1", *args, "--world-size", "1")) == generated({"requests": requests})
    out = capfd.readouterr().out  # the head's lines, from this process at one rank
    assert f"[head] Qwen3MoeForCausalLM from {directory} (" in out
    assert f"[request 1] {list(oracle.PROMPTS[1])} -> {expected[1]} (end of sequence)" in out


def test_prompts_and_sampling_from_the_command_line_at_every_world_size(tmp_path: Path) -> None:
    args = ("--prompt", "Permission is", "--prompt-ids", "76,105", "--temperature", "9", "--seed", "5", *SHORT)
    runs = [served(tmp_path, f"sampled{size}", *args, "--world-size", str(size)) for size in ("1", "2")]
    assert generated(runs[0]) == generated(runs[1])
    first, second = runs[0]["requests"]
    assert (first["prompt"], first["prompt_ids"], second["prompt"]) == ("Permission is", list(b"Permission is"), "Li")
    assert first["seed"] == second["seed"] == 5 and first["text"] == bytes(first["tokens"]).decode(errors="replace")
    greedy = served(tmp_path, "greedy", "--prompt", "Permission is", *SHORT)["requests"][0]
    assert greedy["tokens"] != first["tokens"] and greedy["seed"] is None
