"""The experts of the reference model: ``ShardedMoe``, one rank's experts of a top-k mixture of SwiGLU experts.

Routing is replicated: every rank computes the router's softmax over every expert
(in float32) and picks the same ``top_k`` per token; with ``norm_topk_prob`` the
picked weights are renormalised to sum to 1 (Mixtral, and Qwen3-MoE by its
config), else they are the softmax's own.  A rank adds the weighted outputs of
the picked experts it holds.

Three ways to run the picked experts, the same sums to rounding
(``ShardedMoe.routing``, ``"auto"`` by default):

* **on the host** (``"host"``; ``"auto"`` on the CPU, where reading the routing
  costs no device wait): each picked expert runs on its own tokens, as
  ``transformers`` does, so a step reads only the weights of the experts it picked;
* **gathered** (``"device"``, when a batch picks fewer experts than the rank holds:
  ``tokens * top_k < experts``): each token's picked experts' weights are gathered
  by index and applied as batched products (gpt-fast's Mixtral), reading those
  experts alone and nothing back to the host;
* **dense** (``"device"``, larger batches): every local expert runs on every token,
  weighed by a gate that is zero where the router did not pick it: a fixed shape
  and no host sync, ``experts / top_k`` times the products of the routed way.

On a device other than the CPU, ``"auto"`` is ``"device"``: a decode step then
reads nothing back and a CUDA graph can hold it (``graphs``).
"""

from __future__ import annotations

from typing import Final, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LmConfig, Shard
from .layers import compute_dtype

ExpertRouting = Literal["auto", "host", "device"]
"""How ``ShardedMoe`` runs the picked experts (see the module)."""
ROUTINGS: Final[tuple[ExpertRouting, ...]] = ("auto", "host", "device")


class ShardedMoe(nn.Module):
    """Experts ``shard.first_expert ..`` of a top-k mixture of SwiGLU experts (see the module).

    The router ``[n_experts, D]`` is replicated.  Expert ``e`` computes
    ``down[e] @ (silu(gate[e] @ x) * (up[e] @ x))``; this rank's ``E`` experts are held
    transposed, as the right-hand side of ``x @ w`` (which the CPU's BLAS runs 15-25%
    faster than ``x @ w.T`` for a few rows, measured): ``w_in`` ``[E, D, 2F]`` (the gate's
    columns, then the up projection's) and ``w_out`` ``[E, F, D]``, so that
    ``w_out.flatten(0, 1)`` is every expert's down projection stacked, and one matrix
    product of every expert's gated hidden state also sums the experts.

    Raises:
        ValueError: ``routing`` is not one of ``"auto"``, ``"host"``, ``"device"``.
    """

    def __init__(
        self,
        config: LmConfig,
        shard: Shard,
        *,
        routing: ExpertRouting = "auto",
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"expert routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing: ExpertRouting = routing
        self.top_k: int = config.top_k
        self.norm_topk_prob: bool = config.norm_topk_prob
        self.first_expert: int = shard.first_expert
        self.local_experts: int = shard.experts
        d_model, d_expert = config.d_model, config.d_expert
        self.router: nn.Parameter = nn.Parameter(torch.zeros(config.n_experts, d_model, dtype=dtype, device=device))
        self.w_in: nn.Parameter = nn.Parameter(
            torch.zeros(shard.experts, d_model, 2 * d_expert, dtype=dtype, device=device)
        )
        self.w_out: nn.Parameter = nn.Parameter(
            torch.zeros(shard.experts, d_expert, d_model, dtype=dtype, device=device)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts picked for each token of ``x`` ``[N, D]`` and their weights, both ``[N, top_k]``.

        The weights are in ``compute_dtype``; with ``norm_topk_prob`` they sum to 1 per token
        (the softmax over the picked experts' logits: the same as the whole softmax, picked and renormalised).
        """
        logits = F.linear(x, self.router).to(compute_dtype(x.dtype))
        if self.norm_topk_prob:
            top, experts = logits.topk(self.top_k, dim=-1)
            return experts, top.softmax(dim=-1)
        weights, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, ``x``'s shape ``[*N, D]`` (the way chosen as the module says)."""
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.route(flat)
        if self.routing == "host" or (self.routing == "auto" and flat.device.type == "cpu"):
            out = self._by_expert(flat, experts, weights)
        elif flat.shape[0] * self.top_k < self.local_experts:
            out = self._gathered(flat, experts, weights)
        else:
            out = self._dense(flat, experts, weights)
        return out.view_as(x)

    def _by_expert(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each picked local expert on its own tokens (reads the routing on the host): the picks sorted by
        expert, each expert's products over its run of them (written into one buffer each, not concatenated),
        then each token's weighted sum, its experts added in their order, as ``transformers`` adds
        them."""
        local = (experts - self.first_expert).flatten()  # [N * k]: each token's picks side by side
        order = torch.argsort(local, stable=True)  # by expert; another rank's picks first (below 0) or last
        counts = torch.bincount(local.clamp(-1, self.local_experts) + 1, minlength=self.local_experts + 2).tolist()
        picks = order[counts[0] : len(order) - counts[-1]]  # the picks of this rank's experts, by expert
        runs, first = [], 0  # (expert, first pick, end) of each expert picked
        for expert, count in enumerate(counts[1:-1]):
            if count:
                runs.append((expert, first, first + count))
                first += count
        if not runs:  # every pick is another rank's
            return torch.zeros_like(flat)
        token = torch.div(picks, self.top_k, rounding_mode="floor")
        rows = flat[token]
        hidden = rows.new_empty(rows.shape[0], self.w_in.shape[-1])
        for expert, start, end in runs:
            _product(rows[start:end], self.w_in[expert], hidden[start:end])
        gate, up = hidden.chunk(2, dim=-1)
        gated = F.silu(gate) * up
        out = rows.new_empty(rows.shape)
        for expert, start, end in runs:
            _product(gated[start:end], self.w_out[expert], out[start:end])
        weighed = (out * weights.flatten()[picks, None]).to(flat.dtype)
        return torch.zeros_like(flat).index_add_(0, token, weighed)

    def _gathered(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's picked experts' weights, gathered by index (a pick held by another rank weighs 0)."""
        if self.local_experts < self.router.shape[0]:  # some picks are other ranks': read one of ours, weigh 0
            local = experts - self.first_expert
            owned = (local >= 0) & (local < self.local_experts)
            experts, weights = local.clamp(0, self.local_experts - 1), weights * owned
        hidden = torch.matmul(flat[:, None, None, :], self.w_in[experts])  # [N, k, 1, 2F]
        gate, up = hidden.chunk(2, dim=-1)
        outputs = torch.matmul(F.silu(gate) * up, self.w_out[experts]).squeeze(2)  # [N, k, D]
        return torch.matmul(weights.to(flat.dtype)[:, None, :], outputs).squeeze(1)  # the weighted sum over k

    def _dense(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighed by its gate (zero where it was not picked)."""
        gates = weights.new_zeros(flat.shape[0], self.router.shape[0]).scatter_(1, experts, weights)
        local = gates[:, self.first_expert : self.first_expert + self.local_experts].to(flat.dtype)  # [N, E]
        hidden = torch.matmul(flat, self.w_in)  # [E, N, 2F]
        gate, up = hidden.chunk(2, dim=-1)
        gated = F.silu(gate) * up * local.t()[..., None]  # [E, N, F]
        return torch.mm(gated.transpose(0, 1).flatten(1), self.w_out.flatten(0, 1))


def _product(a: torch.Tensor, b: torch.Tensor, into: torch.Tensor) -> None:
    """``into`` becomes ``a @ b``: written in place, or, where autograd records (the training path: ``mm``'s ``out=``
    is not differentiable), computed and copied."""
    if torch.is_grad_enabled():
        into.copy_(torch.mm(a, b))
    else:
        torch.mm(a, b, out=into)
