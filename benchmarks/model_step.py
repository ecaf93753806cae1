"""The reference model's own decode step at one rank, on a device: what it launches, whether it waits, how long.

Used by ``bench_serving.py``: the protocol's share of a step is only meaningful
against a step that is not inflated by host waits, so the benchmark reports the step
itself beside the paths.  On the CPU the counts are the gate (every op that is not a
view is a kernel launch on a GPU); on CUDA the times are measured too: the eager step,
the step replayed from a CUDA graph, and the GPU's busy time in one step (the sum of
its kernels' durations, from the profiler).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from metrale_model_engine import EpLink
from metrale_model_engine.reference import LmState, ReferenceLm, count_ops
from metrale_model_engine.transport import SoloTransport

MAX_LAUNCHES: Final = 91
"""Ops that are not views per decode step, on the CPU counter: at most this (as ``tests/in_process/
test_reference_device.py`` holds it)."""
CUDA_TARGETS_MS: Final = {"eager step ms": 0.6, "graphed step ms": 0.2, "GPU busy ms per step": 0.15}
"""On an H200-class GPU at world size 1, batch 16: each at most this many milliseconds."""
PROMPT: Final = [76, 105, 99, 101, 110, 115, 101, 100]  # "Licensed"


def filled(
    batch: int, prompt: Sequence[int], build: Callable[[EpLink], ReferenceLm]
) -> tuple[ReferenceLm, list[LmState | None]]:
    """The model ``build`` makes on a one-rank link of ``batch`` slots, each slot holding ``prompt``."""
    model = build(EpLink(SoloTransport(), num_slots=batch))
    slots: list[LmState | None] = [None] * batch
    for seq_id in range(batch):
        model.alloc(slots, seq_id)
        model.prefill(slots, seq_id, prompt, 0, len(prompt))
    return model, slots


def _filled(device: torch.device, batch: int, graphs: bool) -> tuple[ReferenceLm, list[LmState | None]]:
    """A one-rank model on ``device`` with ``batch`` slots, each holding the prompt."""
    # its experts run as on a GPU, reading nothing back, on the CPU too: what is counted
    return filled(
        batch, PROMPT, lambda link: ReferenceLm(link, device=device, cuda_graphs=graphs, expert_routing="device")
    )


def _step(model: ReferenceLm, slots: list[LmState | None], batch: int) -> Callable[[], None]:
    """One served decode step of every slot and its greedy token on the host (what a server does)."""
    ids = list(range(batch))
    tokens = [PROMPT[-1]] * batch

    def step() -> None:
        nonlocal tokens
        if any(state is not None and state.length >= model.config.max_seq_len - 1 for state in slots):
            for seq_id in ids:  # start over before the cache fills
                model.alloc(slots, seq_id)
                model.prefill(slots, seq_id, PROMPT, 0, len(PROMPT))
        tokens = model.decode(slots, ids, tokens).argmax(dim=-1).tolist()

    return step


def _median_ms(step: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _gpu_busy_ms(step: Callable[[], None]) -> float:
    """The sum of the durations of the kernels one step ran, from the profiler, in milliseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [event for event in prof.key_averages() if event.device_type.name == "CUDA"]  # not the CPU ops
    return float(sum(event.self_device_time_total for event in kernels)) / 1e3


def measure(device_name: str, batch: int, steps: int) -> dict[str, float]:
    """Counts per step, and times on CUDA, of the decode at ``batch`` on ``device_name``."""
    device = torch.device(device_name)
    model, slots = _filled(device, batch, graphs=False)
    step = _step(model, slots, batch)
    step()
    _, count = count_ops(lambda: model.decode(slots, list(range(batch)), [PROMPT[-1]] * batch))
    found = {"launches per step": float(count.launched), "host waits per step": float(count.waited)}
    found["eager step ms"] = _median_ms(step, steps)
    if device.type == "cuda":
        found["GPU busy ms per step"] = _gpu_busy_ms(step)
        graphed, graphed_slots = _filled(device, batch, graphs=True)
        graphed_step = _step(graphed, graphed_slots, batch)
        graphed_step()
        found["graphed step ms"] = _median_ms(graphed_step, steps)
    return found


def targets(found: dict[str, float]) -> dict[str, tuple[float, bool]]:
    """Each target with its value and whether it was met (the CUDA ones only on CUDA)."""
    verdicts = {
        f"model step: launches per step at most {MAX_LAUNCHES}": (
            found["launches per step"],
            found["launches per step"] <= MAX_LAUNCHES,
        ),
        "model step: host waits per step, none": (found["host waits per step"], found["host waits per step"] == 0),
    }
    if "GPU busy ms per step" in found:  # measured on CUDA
        for name, most in CUDA_TARGETS_MS.items():
            verdicts[f"model step on CUDA: {name}, at most {most}"] = (found[name], found[name] <= most)
    return verdicts
