"""What the serving benchmark measures and what each round gives back, shared by ``bench_serving.py`` (which
measures) and ``serving_report.py`` (which reads what it measured)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypedDict

from metrale_model_engine.reference import Request

SOURCE: Final = (Path(__file__).resolve().parents[1] / "LICENSE-APACHE").read_text()
"""The text the prompts are cut from."""


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int
    new_tokens: int
    slots: int
    prefill_chunk: int

    def build(self) -> list[Request]:
        """Prompts cut from the Apache license at spread offsets (real text, so the model stays on it)."""
        step = (len(SOURCE) - self.prompt_tokens) // self.requests
        return [
            Request(i, tuple(SOURCE[i * step : i * step + self.prompt_tokens].encode())[: self.prompt_tokens],
                    self.new_tokens)
            for i in range(self.requests)
        ]  # fmt: skip


class RoundResult(TypedDict):
    tokens: int
    wall_s: float
    tokens_per_s: float
    outputs: list[list[int]]
    steps: list[tuple[int, float, float, float]]
    """Each decode step: batch, total, protocol and collectives seconds."""
