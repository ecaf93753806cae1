"""The blocks of the reference model, each holding one rank's shard of its weights.

A block's ``forward`` returns this rank's *partial* output; the model sums the
partials over the ranks with one all-reduce per block and adds the sum to the
replicated residual stream.  With one rank the partial is the whole output.

Every op here has a shape fixed by the call's shape alone and reads no value back
to the host, so a decode step launches the same kernels every time, never waits
for the device, and a CUDA graph can hold it (see :mod:`.graphs`).  Hence the
fused weights: one matrix for the queries, keys and values, one for every local
expert's gate and up projections, one for their down projections; the experts run
on every token, weighted by a gate that is zero where the router did not pick them.

Shapes: ``N`` tokens (the leading dims of the input, ``B`` rows or ``B x T``),
``D`` the model width, ``h`` this rank's heads, ``d`` the head width, ``E`` this
rank's experts, ``F`` an expert's hidden width, ``S`` ``max_seq_len``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._core.namespace import PublicDir, public_dir
from .config import LmConfig

__all__ = [
    "AllReduce",
    "Attend",
    "RotaryTables",
    "ShardedAttention",
    "ShardedBlock",
    "ShardedMoe",
    "attend_causal",
    "attend_decode",
    "attend_prefill",
    "compute_dtype",
    "rms_norm",
]


__dir__: PublicDir = public_dir(globals(), __all__)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for norms, rotations and routing weights: ``dtype``, at least float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in :func:`compute_dtype`, returned in ``x``'s dtype."""
    work = x.to(compute_dtype(x.dtype))
    normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


class RotaryTables(nn.Module):
    """Rotary position embedding (RoPE) for positions ``0 .. max_seq_len - 1``, as one lookup table.

    The head's dimensions are rotated in pairs ``(i, i + d/2)`` by the angle
    ``position * base ** (-2i / d)``.  ``table[p]`` (``[2, 3, 1, d]``, a
    non-persistent buffer in :func:`compute_dtype` of ``dtype``) holds position
    ``p``'s factors for the fused ``[q, k, v]`` of :func:`rotate`: ``table[p, 0]``
    multiplies a head, ``table[p, 1]`` its halves swapped.  For ``q`` and ``k`` they
    are ``[cos, cos]`` and ``[-sin, sin]``; for ``v``, which is not rotated, ``1``
    and ``0``, so one rotation of the fused tensor leaves ``v`` as it was.
    """

    table: torch.Tensor

    def __init__(
        self, head_dim: int, max_seq_len: int, base: float, *, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        half = head_dim // 2
        inverse_frequencies = base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inverse_frequencies)
        cos, sin = angles.cos(), angles.sin()
        table = torch.zeros(max_seq_len, 2, 3, 1, head_dim, dtype=torch.float64)
        table[:, 0, :2, 0] = torch.cat((cos, cos), dim=-1)[:, None]
        table[:, 1, :2, 0] = torch.cat((-sin, sin), dim=-1)[:, None]
        table[:, 0, 2] = 1.0
        self.register_buffer("table", table.to(device=device, dtype=compute_dtype(dtype)), persistent=False)


def rotate(qkv: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``qkv`` ``[*N, 3, h, d]`` with ``q`` and ``k`` rotated by ``factors`` (rows of :class:`RotaryTables`).

    Each half of a head is ``x * cos - other_half * sin`` resp. ``x * cos + other_half
    * sin``, as :class:`RotaryTables` says; ``v`` comes back unchanged.
    """
    work = qkv.to(factors.dtype)
    swapped = torch.cat(work.chunk(2, dim=-1)[::-1], dim=-1)
    return (work * factors.select(-4, 0) + swapped * factors.select(-4, 1)).to(qkv.dtype)


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the ranks of the group (e.g. ``torch.distributed.all_reduce``)."""

Attend = Callable[["ShardedAttention", torch.Tensor], torch.Tensor]
"""How a layer's queries meet keys: ``attend(layer, qkv) -> out``, ``qkv`` ``[*N, 3, h, d]``, out ``[*N, h, d]``.

The model passes one per call path: causal attention within the call (training),
or writes into the layer's KV cache and attends to it (prefill, decode).
"""


Split = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
Join = Callable[..., torch.Tensor]


def _show_parts(
    fused: str, parts: tuple[str, ...], split: Split, _: nn.Module, state: dict[str, Any], prefix: str, __: object
) -> None:
    """State-dict hook: ``prefix + fused`` becomes its ``parts`` (views, detached), in its place in the order."""
    entries = list(state.items())
    state.clear()
    for name, tensor in entries:
        if name == prefix + fused:
            with torch.no_grad():
                state.update((prefix + part, piece) for part, piece in zip(parts, split(tensor), strict=True))
        else:
            state[name] = tensor


def _take_parts(
    fused: str, parts: tuple[str, ...], join: Join, _: nn.Module, state: dict[str, Any], prefix: str, *__: object
) -> None:
    """Load pre-hook: a state with every one of ``parts`` loads them as ``prefix + fused``; any other as it is."""
    if all(prefix + name in state for name in parts):
        state[prefix + fused] = join(*(state.pop(prefix + name) for name in parts))


def _store_fused(module: nn.Module, fused: str, parts: tuple[str, ...], split: Split, join: Join) -> None:
    """Let ``module``'s parameter ``fused`` appear in state dicts as its ``parts``, the weights file's names.

    ``state_dict()`` gives ``split(fused)`` (views) under the parts' names, and
    ``load_state_dict()`` takes the parts and loads ``join(*parts)``.  A state
    that lacks a part is passed on as it is, for ``load_state_dict`` to report (as
    the fused name missing and the other parts unexpected).  The hooks are partials of
    module-level functions, so the module still pickles (``torch.save(model)``).
    """
    show = functools.partial(_show_parts, fused, parts, split)
    take = functools.partial(_take_parts, fused, parts, join)
    module.register_state_dict_post_hook(show)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(take)  # type: ignore[no-untyped-call]


def _stack(*parts: torch.Tensor) -> torch.Tensor:
    return torch.stack(parts)


def _unbind_1(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return fused.unbind(1)


def _stack_1(*parts: torch.Tensor) -> torch.Tensor:
    return torch.stack(parts, 1)


def _swap_01(fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (fused.transpose(0, 1),)


def _swap_01_back(part: torch.Tensor) -> torch.Tensor:
    return part.transpose(0, 1).contiguous()


class ShardedAttention(nn.Module):
    """Heads ``first_head .. first_head + local_heads - 1`` of a causal multi-head self-attention.

    Column-parallel projections of this rank's heads (``wq``, ``wk``, ``wv`` in the
    state dict, ``[h*d, D]`` each; held as one parameter ``wqkv`` ``[3, h*d, D]``)
    and a row-parallel output projection ``wo`` (the matching columns, ``[D, h*d]``).
    No biases.  The KV cache of these heads is ``kv_cache`` ``[num_slots, S, 2, h, d]``
    (keys at ``[:, :, 0]``, values at ``[:, :, 1]``), non-persistent.
    """

    kv_cache: torch.Tensor

    def __init__(
        self,
        d_model: int,
        local_heads: int,
        head_dim: int,
        *,
        num_slots: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.local_heads = local_heads
        self.head_dim = head_dim
        width = local_heads * head_dim
        self.wqkv: nn.Parameter = nn.Parameter(torch.zeros(3, width, d_model, dtype=dtype, device=device))
        self.wo: nn.Parameter = nn.Parameter(torch.zeros(d_model, width, dtype=dtype, device=device))
        cache_shape = (num_slots, max_seq_len, 2, local_heads, head_dim)
        self.register_buffer("kv_cache", torch.zeros(cache_shape, dtype=dtype, device=device), persistent=False)
        _store_fused(self, "wqkv", ("wq", "wk", "wv"), torch.unbind, _stack)

    @property
    def k_cache(self) -> torch.Tensor:
        """The keys of the cache, ``[num_slots, S, h, d]`` (a view)."""
        return self.kv_cache[:, :, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        """The values of the cache, ``[num_slots, S, h, d]`` (a view)."""
        return self.kv_cache[:, :, 1]

    def forward(self, x: torch.Tensor, factors: torch.Tensor, attend: Attend) -> torch.Tensor:
        """This rank's partial attention output ``[*N, D]`` for normed input ``x`` ``[*N, D]``.

        ``factors``: the rows of :class:`RotaryTables` at the tokens' positions (``[*N, 2, 3, 1, d]``,
        broadcast over leading dims).
        """
        lead = x.shape[:-1]
        qkv = F.linear(x, self.wqkv.flatten(0, 1)).view(*lead, 3, self.local_heads, self.head_dim)
        out = attend(self, rotate(qkv, factors))
        return F.linear(out.flatten(-2), self.wo)


class ShardedMoe(nn.Module):
    """Experts ``first_expert .. first_expert + local_experts - 1`` of a top-k mixture of SwiGLU experts.

    The router ``[n_experts, D]`` is replicated, so every rank routes every token
    the same way: the ``top_k`` largest router logits pick the experts and a
    softmax over those ``top_k`` logits weighs them.  Each rank adds the weighted
    outputs of the experts it holds.  Expert ``e`` computes
    ``w_down[e] @ (silu(w_gate[e] @ x) * (w_up[e] @ x))``.

    In the state dict the weights are stacked by expert: ``w_gate``, ``w_up``
    ``[E, F, D]``, ``w_down`` ``[E, D, F]``.  They are held fused for two matrix
    products over every local expert at once: ``w_in`` ``[E, 2, F, D]`` (gate and
    up) and ``w_out`` ``[D, E, F]`` (the down projections side by side, so that one
    product of the gated hidden states also sums the experts).
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        n_experts: int,
        top_k: int,
        *,
        first_expert: int,
        local_experts: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.first_expert = first_expert
        self.local_experts = local_experts
        self.router: nn.Parameter = nn.Parameter(torch.zeros(n_experts, d_model, dtype=dtype, device=device))
        self.w_in: nn.Parameter = nn.Parameter(
            torch.zeros(local_experts, 2, d_expert, d_model, dtype=dtype, device=device)
        )
        self.w_out: nn.Parameter = nn.Parameter(
            torch.zeros(d_model, local_experts, d_expert, dtype=dtype, device=device)
        )
        _store_fused(self, "w_in", ("w_gate", "w_up"), _unbind_1, _stack_1)
        _store_fused(self, "w_out", ("w_down",), _swap_01, _swap_01_back)

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts picked for each token of ``x`` ``[N, D]`` and their weights, both ``[N, top_k]``.

        The weights are in :func:`compute_dtype` and sum to 1 per token.
        """
        logits = F.linear(x, self.router).to(compute_dtype(x.dtype))
        top_logits, experts = logits.topk(self.top_k, dim=-1)
        return experts, top_logits.softmax(dim=-1)

    def local_gates(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]``: the weight of each of this rank's experts for each token (0 where it was not picked)."""
        experts, weights = self.routing(x)
        gates = weights.new_zeros(x.shape[0], self.router.shape[0]).scatter_(1, experts, weights)
        return gates[:, self.first_expert : self.first_expert + self.local_experts].to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, ``x``'s shape ``[*N, D]``.

        Every local expert runs on every token, and its output is weighed by its gate:
        a fixed shape, no host sync.  At ``top_k / n_experts`` of the experts picked
        per token this computes ``n_experts / top_k`` times the products that routing
        token by token would, and saves the gather, one kernel per expert and the sync.
        An expert that was not picked still runs: in float16 an overflow there (inf)
        times its zero gate would make the token's output NaN, where routing token by
        token never ran it (not seen with the shipped weights, which are bfloat16).
        """
        flat = x.reshape(-1, x.shape[-1])
        gates = self.local_gates(flat)
        hidden = F.linear(flat, self.w_in.flatten(0, 2)).view(flat.shape[0], self.local_experts, 2, -1)
        gated = F.silu(hidden[:, :, 0]) * hidden[:, :, 1] * gates[..., None]  # [N, E, F]
        return F.linear(gated.flatten(1), self.w_out.flatten(1)).view_as(x)


class ShardedBlock(nn.Module):
    """One layer: pre-norm attention, then a pre-norm mixture of experts, each summed over the ranks.

    ``attn_norm`` and ``moe_norm`` are the RMSNorm gains, replicated, initially ones.
    """

    def __init__(self, attn: ShardedAttention, moe: ShardedMoe, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        width = attn.wo.shape[0]
        self.attn_norm: nn.Parameter = nn.Parameter(torch.ones(width, dtype=attn.wo.dtype, device=attn.wo.device))
        self.attn = attn
        self.moe_norm: nn.Parameter = nn.Parameter(torch.ones(width, dtype=attn.wo.dtype, device=attn.wo.device))
        self.moe = moe

    @classmethod
    def build(
        cls,
        config: LmConfig,
        rank: int,
        world_size: int,
        *,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> ShardedBlock:
        """Rank ``rank``'s shard of a layer of ``config`` (a checked ``world_size``), weights zero, gains one."""
        heads, experts, _ = config.per_rank(world_size)
        attn = ShardedAttention(
            config.d_model,
            heads,
            config.head_dim,
            num_slots=num_slots,
            max_seq_len=config.max_seq_len,
            dtype=dtype,
            device=device,
        )
        moe = ShardedMoe(
            config.d_model,
            config.d_expert,
            config.n_experts,
            config.top_k,
            first_expert=rank * experts,
            local_experts=experts,
            dtype=dtype,
            device=device,
        )
        return cls(attn, moe, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, factors: torch.Tensor, attend: Attend, all_reduce: AllReduce) -> torch.Tensor:
        """The residual stream ``x`` ``[*N, D]`` after this layer; calls ``all_reduce`` twice.

        ``factors``: the rows of :class:`RotaryTables` at the tokens' positions.
        """
        partial: torch.Tensor = self.attn(rms_norm(x, self.attn_norm, self.eps), factors, attend)
        all_reduce(partial)
        x = x + partial
        partial = self.moe(rms_norm(x, self.moe_norm, self.eps))
        all_reduce(partial)
        return x + partial


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[..., T, h, d]`` as ``[..., h, T, d]``, the layout of ``scaled_dot_product_attention``."""
    return x.transpose(-3, -2)


def attend_causal(_: ShardedAttention, qkv: torch.Tensor) -> torch.Tensor:
    """The training path's :data:`Attend` (``qkv`` ``[B, T, 3, h, d]``): causal attention within the call, no cache."""
    q, k, v = (_heads_first(part) for part in qkv.unbind(-3))
    return _heads_first(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def attend_prefill(
    slot: int, start: int, causal_bias: torch.Tensor, layer: ShardedAttention, qkv: torch.Tensor
) -> torch.Tensor:
    """Prefill's :data:`Attend` (bind ``slot``, ``start``, ``causal_bias``): a chunk of ``L`` tokens, ``[L, 3, h, d]``.

    Writes the chunk's keys and values at positions ``start .. start + L - 1`` of
    ``slot``'s cache, then lets position ``p`` attend to the slot's positions
    ``0 ..= p``.  ``causal_bias`` is the model's ``[S, S]`` additive causal mask.
    """
    end = start + qkv.shape[0]
    layer.kv_cache[slot, start:end] = qkv[:, 1:]
    keys, values = (_heads_first(part)[None] for part in layer.kv_cache[slot, :end].unbind(1))
    query = _heads_first(qkv[:, 0])[None]  # a batch of one: the fused attention kernels want 4-D inputs
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_bias[start:end, :end])
    return _heads_first(out[0])


def attend_decode(
    slots: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, layer: ShardedAttention, qkv: torch.Tensor
) -> torch.Tensor:
    """Decode's :data:`Attend` (bind ``slots``, ``positions``, ``bias``): ``B`` rows of one token, ``[B, 3, h, d]``.

    Row ``i`` writes its key and value at ``positions[i]`` of ``slots[i]`` and
    attends to that slot's positions ``0 ..= positions[i]``: over the slot's whole
    cache, the positions past its own masked out by ``bias`` (``[B, 1, 1, S]``, 0 or ``-inf``),
    so every batch has one shape.
    """
    layer.kv_cache[slots, positions] = qkv[:, 1:]
    keys, values = (_heads_first(part) for part in layer.kv_cache[slots].unbind(2))  # [B, h, S, d]
    out = F.scaled_dot_product_attention(qkv[:, 0, :, None], keys, values, attn_mask=bias)  # [B, h, 1, d]
    return out[:, :, 0]
