"""The attention of the reference model and its layer, each holding one rank's shard of its weights.

A block's ``forward`` returns this rank's *partial* output; the model sums the
partials over the ranks with one all-reduce per block and adds the sum to the
replicated residual stream.  With one rank the partial is the whole output.

The arithmetic is Mixtral's and Qwen3-MoE's, as ``transformers`` computes them:
RMSNorm in float32, rotate-half RoPE, grouped-query attention, the top-k experts
weighed by the router's softmax (``experts``).  Every op of the attention has
a shape fixed by the call's shape alone and reads no value back to the host, so a
decode step can be held by a CUDA graph (see ``graphs``).  Hence the fused
weights: one matrix for the queries, keys and values of this rank's heads.

The KV cache is a pool of blocks of ``block_size`` positions (``ShardedAttention.kv_cache``),
and a sequence's positions live in the blocks of its block table (``blocks``): position ``p``
in cache row ``table[p // block_size] * block_size + p % block_size`` of the pool seen as
rows (``cache_rows``).  The model turns tables into rows on the device, once a call, and
each layer writes and gathers those rows with index operations.

Shapes: ``N`` tokens (the leading dims of the input, ``B`` rows or ``B x T``),
``D`` the model width, ``h`` this rank's query heads (with their padding:
``Shard.padded_heads``), ``g`` its KV heads, ``d`` the head width, ``K`` the blocks
of the pool, ``P`` the positions of a block, ``W`` the positions a decode step attends over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LmConfig, Shard


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for norms, rotations and routing weights: ``dtype``, at least float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in ``compute_dtype``, returned in ``x``'s dtype."""
    work = x.to(compute_dtype(x.dtype))
    normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


class RotaryTables(nn.Module):
    """Rotary position embedding (RoPE) for positions ``0 .. max_seq_len - 1``, as one lookup table.

    The head's dimensions are rotated in pairs ``(i, i + d/2)`` by the angle
    ``position * base ** (-2i / d)``, the angles computed in float32 as ``transformers``
    does.  ``table[p]`` (``[2, 1, d]``, a non-persistent buffer in ``compute_dtype``
    of ``dtype``) holds position ``p``'s factors for ``rotate``: ``table[p, 0]``
    (``[cos, cos]``) multiplies a head, ``table[p, 1]`` (``[-sin, sin]``) its halves swapped.
    """

    table: torch.Tensor

    def __init__(
        self, head_dim: int, max_seq_len: int, base: float, *, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        inverse_frequencies = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inverse_frequencies)
        cos, sin = angles.cos(), angles.sin()
        table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)[:, :, None]
        self.register_buffer("table", table.to(device=device, dtype=compute_dtype(dtype)), persistent=False)


def rotate(heads: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``heads`` ``[*N, H, d]`` rotated by ``factors`` (rows of ``RotaryTables``, ``[*N, 2, 1, d]``).

    Each half of a head is ``x * cos - other_half * sin`` resp. ``x * cos + other_half * sin``.
    """
    work = heads.to(factors.dtype)
    swapped = torch.cat(work.chunk(2, dim=-1)[::-1], dim=-1)
    return (work * factors.select(-3, 0) + swapped * factors.select(-3, 1)).to(heads.dtype)


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the ranks of the group (e.g. ``torch.distributed.all_reduce``)."""

Attend = Callable[["ShardedAttention", torch.Tensor, torch.Tensor], torch.Tensor]
"""How a layer's queries meet keys: ``attend(layer, q, kv) -> out``: ``q`` ``[*N, h, d]``, ``kv``
``[*N, 2, g, d]`` (keys, values), out ``[*N, h, d]``.

The model passes one per call path: causal attention within the call (training),
or writes into the layer's KV cache and attends to it (prefill, decode).
"""


class ShardedAttention(nn.Module):
    """Query heads ``shard.first_head ..`` of a causal grouped-query self-attention, with their KV heads.

    ``wqkv`` holds the rows of this rank's query heads, then of its KV heads' keys,
    then of their values (``[(h + 2g) * d, D]``, column parallel); ``wo`` the
    matching columns of the output projection (``[D, h * d]``, row parallel).  No
    biases.  The query heads are ``shard.padded_heads``: its own, between the zero
    rows (and zero columns of ``wo``) of its padding, which add nothing to the
    output.  With ``config.qk_norm``, ``q_norm`` and ``k_norm`` (``[d]``, replicated)
    are RMSNorm gains applied to each query and key head before the rotation (Qwen3).
    The KV cache of these KV heads is ``kv_cache`` ``[K, P, 2, g, d]``: ``num_blocks`` blocks
    of ``block_size`` positions (keys at ``[:, :, 0]``, values at ``[:, :, 1]``), non-persistent.
    """

    kv_cache: torch.Tensor
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None

    def __init__(
        self,
        config: LmConfig,
        shard: Shard,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.heads: int = shard.padded_heads
        self.kv_heads: int = shard.kv_heads
        self.head_dim: int = config.head_dim
        self.eps: float = config.norm_eps
        rows = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.wqkv: nn.Parameter = nn.Parameter(torch.zeros(rows, config.d_model, dtype=dtype, device=device))
        self.wo: nn.Parameter = nn.Parameter(
            torch.zeros(config.d_model, self.heads * self.head_dim, dtype=dtype, device=device)
        )
        gains = (nn.Parameter(torch.ones(self.head_dim, dtype=dtype, device=device)) for _ in range(2))
        self.q_norm, self.k_norm = gains if config.qk_norm else (None, None)
        cache_shape = (num_blocks, block_size, 2, self.kv_heads, self.head_dim)
        self.register_buffer("kv_cache", torch.zeros(cache_shape, dtype=dtype, device=device), persistent=False)

    @property
    def k_cache(self) -> torch.Tensor:
        """The keys of the cache, ``[K, P, g, d]`` (a view)."""
        return self.kv_cache[:, :, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        """The values of the cache, ``[K, P, g, d]`` (a view)."""
        return self.kv_cache[:, :, 1]

    @property
    def cache_rows(self) -> torch.Tensor:
        """The cache as rows, one per position of a block: ``[K * P, 2, g, d]`` (a view)."""
        return self.kv_cache.flatten(0, 1)

    def forward(self, x: torch.Tensor, factors: torch.Tensor, attend: Attend) -> torch.Tensor:
        """This rank's partial attention output ``[*N, D]`` for normed input ``x`` ``[*N, D]``.

        ``factors``: the rows of ``RotaryTables`` at the tokens' positions (``[*N, 2, 1, d]``).
        """
        qkv = F.linear(x, self.wqkv).view(*x.shape[:-1], -1, self.head_dim)  # [*N, h + 2g, d]
        qk, v = qkv[..., : self.heads + self.kv_heads, :], qkv[..., self.heads + self.kv_heads :, :]
        if self.q_norm is not None and self.k_norm is not None:
            gains = torch.cat((self.q_norm.expand(self.heads, -1), self.k_norm.expand(self.kv_heads, -1)))
            qk = rms_norm(qk, gains, self.eps)
        qk = rotate(qk, factors)
        q, k = qk[..., : self.heads, :], qk[..., self.heads :, :]
        out = attend(self, q, torch.stack((k, v), dim=-3))
        return F.linear(out.flatten(-2), self.wo)


def cache_rows(offsets: torch.Tensor, tables: torch.Tensor, width: int) -> torch.Tensor:
    """The cache rows of the first ``width`` positions of each block table of ``tables`` (``[B, n]``, ``n`` blocks
    of ``P`` positions, ``n * P >= width``), ``offsets`` being ``0 .. P - 1``: ``[B, width]``, contiguous, on their
    device (nothing is read back).

    Position ``p`` of row ``i`` is row ``tables[i, p // P] * P + p % P`` of every layer's
    cache seen as rows (``ShardedAttention.cache_rows``).
    """
    size = offsets.shape[0]
    rows = (tables[:, : -(-width // size), None] * size + offsets).flatten(1)  # [B, whole blocks' positions]
    return rows if rows.shape[1] == width else rows[:, :width].contiguous()


SPLIT_POSITIONS: Final = 256
"""What ``span_groups`` weighs a group against: the positions a split must spare every row after it, together."""


def span_groups(needed: Sequence[int], block_size: int, max_seq_len: int) -> list[tuple[int, int, int]]:
    """The groups of a fused step's decode rows, longest first (``needed``: the positions each row attends over,
    descending), that each gather their rows' blocks over their own span: ``(first, end, span)``, in order, together
    covering every index; ``span`` the group's first ``needed`` rounded up to whole blocks, at most ``max_seq_len``.

    A group ends before a row when what its remaining rows would gather past their own span, together, reaches
    ``SPLIT_POSITIONS`` (a gathered position costs about what its attention does, and each group launches its own
    kernels): ``[300, 290, 40, 30]`` of blocks of 16 -> ``[(0, 2, 304), (2, 4, 48)]``.
    """
    groups: list[tuple[int, int, int]] = []
    first = 0
    for index in range(1, len(needed) + 1):
        span = min(max_seq_len, -(-needed[first] // block_size) * block_size)
        if index == len(needed) or (span - needed[index]) * (len(needed) - index) >= SPLIT_POSITIONS:
            groups.append((first, index, span))
            first = index
    return groups


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[..., T, h, d]`` as ``[..., h, T, d]``, the layout of ``scaled_dot_product_attention``."""
    return x.transpose(-3, -2)


def attend_causal(_: ShardedAttention, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The training path's ``Attend`` (``q`` ``[B, T, h, d]``): causal attention within the call, no cache."""
    keys, values = (_heads_first(part) for part in kv.unbind(-3))
    out = F.scaled_dot_product_attention(_heads_first(q), keys, values, is_causal=True, enable_gqa=True)
    return _heads_first(out)


def attend_prefill(
    written: torch.Tensor, read: torch.Tensor, mask: torch.Tensor, layer: ShardedAttention, q: torch.Tensor,
    kv: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Prefill's ``Attend`` (bind ``written``, ``read``, ``mask``): a chunk of ``L`` tokens, ``q`` ``[L, h, d]``.

    Writes the chunk's keys and values into the cache rows ``written`` (``[L]``: its
    positions ``start .. start + L - 1``), then lets position ``p`` attend to the
    sequence's positions ``0 ..= p``, gathered from the rows ``read`` (``[start + L]``):
    ``mask`` (``[L, start + L]``, added to the scores: 0 where a key is visible, ``-inf``
    past it) says which.
    """
    rows = layer.cache_rows
    rows.index_copy_(0, written, kv)
    keys, values = (_heads_first(part)[None] for part in rows.index_select(0, read).unbind(1))
    query = _heads_first(q)[None]  # a batch of one: the fused attention kernels want 4-D inputs
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
    return _heads_first(out[0])


def attend_decode(
    written: torch.Tensor,
    read: torch.Tensor,
    mask: torch.Tensor,
    layer: ShardedAttention,
    q: torch.Tensor,
    kv: torch.Tensor,
) -> torch.Tensor:
    """Decode's ``Attend`` (bind ``written``, ``read``, ``mask``): ``B`` rows of one token, ``q`` ``[B, h, d]``.

    Row ``i`` writes its key and value into cache row ``written[i]`` (its position) and
    attends to its sequence's positions ``0 ..= positions[i]``: over the first ``W``
    positions of its sequence, gathered from the cache rows ``read[i]`` (``[B, W]``,
    ``W >= positions[i] + 1`` for every row), the positions past its own masked out by
    ``mask`` (``[B, 1, 1, W]``, added to the scores: 0 or ``-inf``), so every batch of one
    ``W`` has one shape.  The query heads of one KV head attend as that head's queries
    (``[B, g, h / g, d]``, the grouping ``enable_gqa`` makes): each key and value gathered
    is read once for the group, not once per query head.
    """
    rows = layer.cache_rows
    rows.index_copy_(0, written, kv)
    gathered = rows.index_select(0, read.flatten()).view(*read.shape, *rows.shape[1:])  # [B, W, 2, g, d]
    keys, values = (_heads_first(part) for part in gathered.unbind(2))  # [B, g, W, d]
    grouped = q.view(q.shape[0], layer.kv_heads, -1, q.shape[-1])  # [B, g, h / g, d]
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).flatten(1, 2)  # [B, h, d]


def attend_split(
    parts: Sequence[tuple[Attend, int]], layer: ShardedAttention, q: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    """An ``Attend`` of several (bind ``parts``): ``(attend, count)`` pairs, each over the next ``count`` tokens
    of the call (a fused step's decode rows, then each prefill chunk); their outputs in the same order."""
    outputs, first = [], 0
    for attend, count in parts:
        outputs.append(attend(layer, q[first : first + count], kv[first : first + count]))
        first += count
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
