"""Decode steps replayed from CUDA graphs: [`DecodeGraphs`][metrale_model_engine.reference.DecodeGraphs].

A decode step of [`ShardedLm`][metrale_model_engine.reference.ShardedLm]
([`decode_step`][metrale_model_engine.reference.ShardedLm.decode_step]) launches a fixed sequence of kernels for a given
batch size and reads nothing back, so it can be recorded once in a CUDA graph and replayed with one launch.  The graph
reads its inputs from a static buffer (the tokens, the positions and the block tables: a table is an input like
the others) and writes its logits to a static tensor; the KV cache is the model's own buffer, which every replay
updates in place.

One graph per batch size and attention span ([`decode_span`][metrale_model_engine.reference.decode_span]: a power
of two), recorded at the first step of that shape (continuous batching visits the
sizes ``1 ..= num_slots``, and the spans as its sequences grow); all of them share
one memory pool.
Before it records, a size runs once eagerly on a side stream (as CUDA graph capture
asks: allocator and library warm-up).  That run writes the step's keys and values,
which the replay then writes again, equal: the step is done once as far as the
cache is concerned.

One rank only.  A replayed all-reduce is no longer a call that
[`Collectives`][metrale_model_engine.torch.Collectives] can bound: NCCL's watchdog sees no
work for it, so a dead or stalled peer would hang the replay on the device and the
host in its next read, breaking the contract for failures inside a forward; and a
gloo all-reduce (a host copy and a host wait) cannot be captured at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import ShardedLm


@dataclass
class _Recorded:
    inputs: torch.Tensor
    """``[B, 2 + n]`` int64 on the device: each row's token, position and block table (its first ``n`` blocks)."""
    logits: torch.Tensor
    replay: Callable[[], None]


class DecodeGraphs:
    """``lm``'s decode steps, each batch size recorded once in a CUDA graph and replayed after.

    Args:
        lm: a one-rank model whose weights and cache are on a CUDA device.

    Raises:
        ValueError: ``lm`` is not on a CUDA device, or is one of several ranks (see the module).
    """

    def __init__(self, lm: ShardedLm) -> None:
        device = lm.embed.device
        if lm.world_size > 1:
            raise ValueError(
                f"CUDA graphs are for one rank, this model is rank {lm.rank} of {lm.world_size}: a replayed "
                "all-reduce could not be bounded by the collective timeout"
            )
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        self._lm = lm
        self._device = device
        self._recorded: dict[tuple[int, int], _Recorded] = {}
        with torch.cuda.device(device):
            self._pool = torch.cuda.graph_pool_handle()

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The ``(batch size, span)`` pairs recorded so far, ascending."""
        return sorted(self._recorded)

    def __call__(self, inputs: torch.Tensor, span: int) -> torch.Tensor:
        """One decode step of ``inputs`` ``[B, 2 + n]`` (int64: each row's token, position, then the first
        ``n = ceil(span / block_size)`` blocks of its table; checked by the caller), attending over the first
        ``span`` positions (more than every position).

        Returns:
            The logits ``[B, vocab]``, a tensor of the caller's own (the graph's output is copied).
        """
        shape = (inputs.shape[0], span)
        with torch.cuda.device(self._device):
            recorded = self._recorded.get(shape)
            if recorded is None:
                recorded = self._recorded[shape] = self._record(inputs, span)
            else:
                recorded.inputs.copy_(inputs, non_blocking=True)
                recorded.replay()
            return recorded.logits.clone()

    def _record(self, inputs: torch.Tensor, span: int) -> _Recorded:
        """Record the step for ``inputs``' batch size and ``span``; the step itself runs (eagerly, then replayed)."""
        static = torch.empty_like(inputs, device=self._device)  # the graph's own input buffer
        static.copy_(inputs, non_blocking=True)
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._lm.decode_step(static[:, 2:], static[:, 0], static[:, 1], span=span)
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        with torch.cuda.graph(graph, pool=self._pool, stream=capture):
            logits = self._lm.decode_step(static[:, 2:], static[:, 0], static[:, 1], span=span)
        graph.replay()
        return _Recorded(static, logits, graph.replay)
