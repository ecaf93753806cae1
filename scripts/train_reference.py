"""Train the reference model's shipped checkpoint on this project's two license texts, deterministically.

    python scripts/train_reference.py                 # writes src/metrale_model_engine/reference/tiny_moe/
    python scripts/train_reference.py --steps 50 --out /tmp/try

The corpus never changes: ``LICENSE-APACHE``, a newline, then ``LICENSE-MIT``
(12,451 bytes), read from the repository root beside this script.  The one-rank
model (:meth:`ShardedLm.forward`) trains on random windows drawn from a seeded
generator, with AdamW, a linear warm-up then a cosine decay, and gradient
clipping; one CPU thread and torch's deterministic algorithms.  The weights are
rounded to bfloat16 (the precision they were trained to keep) and written as a
``MixtralForCausalLM`` checkpoint in float32 (``config.json``, ``model.safetensors``,
``generation_config.json`` and the byte tokenizer's ``tokenizer.json``), which
``transformers`` loads as it is.  The same arguments on the same machine and torch
build give byte-identical files (another CPU instruction set may round differently).

Measured on this project's machine (2 cores shared with other work; the
training uses one), torch 2.13.0 CPU, default settings (1200 steps of 16 windows
of 128 bytes, about 200 passes over the corpus): 152 s of training; mean loss of
the last 100 steps 0.082, loss over the whole corpus with the saved bfloat16
weights 0.080 (the model all but memorizes the 12 KB); greedy after "Licensed
under the": ' Apache License, Version 2.0 (the "License"); you may not use this
file except in compliance with the License.'  Those are the shipped weights, made
when the model computed its rotary angles in float64; a run now rounds them as
``transformers`` does (float32), so it gives weights of the same quality that
differ in their last bits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from metrale_model_engine.reference import SHIPPED_MODEL, Checkpoint, LmConfig, ShardedLm
from metrale_model_engine.reference.checkpoint import byte_tokenizer, load_shard, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILES = ("LICENSE-APACHE", "LICENSE-MIT")
SAMPLE_PROMPT = "Licensed under the"


@dataclass(frozen=True)
class TrainSettings:
    """How to train; the defaults made the shipped weights."""

    steps: int = 1200
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128
    peak_lr: float = 3e-3
    final_lr_fraction: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    log_every: int = 100


def read_corpus(root: Path = ROOT) -> torch.Tensor:
    """The training text as byte tokens, 1-D int64: the license files joined by a newline."""
    text = "\n".join((root / name).read_text(encoding="utf-8") for name in CORPUS_FILES)
    return torch.tensor(list(text.encode()), dtype=torch.int64)


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """One CPU thread and deterministic algorithms inside; torch's previous settings restored after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warm-up to ``peak_lr``, then a cosine decay to ``final_lr_fraction * peak_lr`` at the last step."""
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - 1 - settings.warmup_steps)
    floor = settings.final_lr_fraction
    return settings.peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def sample_batch(
    corpus: torch.Tensor, settings: TrainSettings, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of the corpus: inputs and next-token targets, both ``[B, seq_len]``."""
    starts = torch.randint(0, corpus.numel() - settings.seq_len, (settings.batch_size, 1), generator=generator)
    windows = corpus[starts + torch.arange(settings.seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


def init_weights(model: ShardedLm, generator: torch.Generator) -> None:
    """A random start drawn from ``generator`` only: norm gains 1, every matrix normal with standard deviation
    ``0.02``, the projections into the residual stream (``wo``, ``w_out``) scaled by ``1 / sqrt(2 * n_layers)``
    (GPT-2's scheme)."""
    residual_scale = (2 * model.config.n_layers) ** -0.5
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                parameter.fill_(1.0)
            else:
                std = 0.02 * (residual_scale if name.endswith(("wo", "w_out")) else 1.0)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def _optimizer(model: ShardedLm, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not the norm gains)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    gains = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": settings.weight_decay}, {"params": gains, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.peak_lr, betas=(0.9, 0.95), foreach=False)


def train(
    config: LmConfig, corpus: torch.Tensor, settings: TrainSettings, log: Callable[[str], None] = print
) -> tuple[ShardedLm, list[float]]:
    """Train a one-rank model from a seeded random start; deterministic (see :func:`deterministic_torch`).

    Returns:
        The trained model (float32, CPU) and the loss of every step.
    """
    with deterministic_torch():
        generator = torch.Generator().manual_seed(settings.seed)
        model = ShardedLm(config, num_blocks=1)
        init_weights(model, generator)
        optimizer = _optimizer(model, settings)
        losses: list[float] = []
        started = time.perf_counter()
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            inputs, targets = sample_batch(corpus, settings, generator)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_norm)
            optimizer.step()
            losses.append(loss.item())
            if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
                recent = losses[-settings.log_every :]
                log(
                    f"step {step + 1:5d}  loss {sum(recent) / len(recent):.4f}  "
                    f"lr {learning_rate(step, settings):.2e}  {time.perf_counter() - started:6.1f} s"
                )
        return model, losses


def corpus_loss(model: ShardedLm, corpus: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss of ``model`` over the corpus cut into consecutive windows of ``seq_len + 1`` bytes."""
    windows = corpus[: (corpus.numel() - 1) // seq_len * seq_len + 1]
    inputs = windows[:-1].view(-1, seq_len)
    targets = windows[1:].view(-1, seq_len)
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def greedy_continuation(model: ShardedLm, prompt: str, steps: int) -> str:
    """``steps`` greedy bytes after ``prompt``, decoded (the sequence's positions in ``model``'s first blocks)."""
    prompt_tokens = list(prompt.encode())
    table = torch.arange(model.blocks_per_sequence)
    logits = model.prefill(table, torch.tensor(prompt_tokens), 0)
    generated: list[int] = []
    for position in range(len(prompt_tokens), len(prompt_tokens) + steps):
        generated.append(int(logits.argmax()))
        logits = model.decode(table[None], torch.tensor(generated[-1:]), torch.tensor([position]))[0]
    return bytes(generated).decode(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="of the start and the batches")
    parser.add_argument("--out", type=Path, default=SHIPPED_MODEL, help="the checkpoint (default: the shipped)")
    args = parser.parse_args(argv)
    settings = dataclasses.replace(defaults, steps=args.steps, seed=args.seed)
    config = LmConfig()
    corpus = read_corpus()
    print(f"corpus: {corpus.numel()} bytes; {settings}")
    started = time.perf_counter()
    trained, losses = train(config, corpus, settings)
    elapsed = time.perf_counter() - started
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    save_checkpoint(args.out, trained, tokenizer=byte_tokenizer())
    tail = losses[-settings.log_every :]
    print(f"trained in {elapsed:.1f} s; mean loss of the last {len(tail)} steps {sum(tail) / len(tail):.4f}")

    with deterministic_torch():
        saved = Checkpoint.open(args.out)
        model = ShardedLm(saved.config, num_blocks=-(-saved.config.max_seq_len // 16))
        load_shard(model, saved)
        print(f"wrote {args.out} ({(args.out / 'model.safetensors').stat().st_size} bytes of weights)")
        print(f"loss over the whole corpus with the saved weights: {corpus_loss(model, corpus, settings.seq_len):.4f}")
        print(f"greedy: {SAMPLE_PROMPT!r} -> {greedy_continuation(model, SAMPLE_PROMPT, 120)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
