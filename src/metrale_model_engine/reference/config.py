"""The reference model's shape (:class:`LmConfig`) and its sharding rule, stated once.

A world of ``world_size`` ranks splits the attention heads and the experts evenly
(:meth:`LmConfig.per_rank`): rank ``r`` holds heads ``r * h .. (r + 1) * h - 1``
(their rows of ``wq``, ``wk``, ``wv``, their columns of ``wo``, their part of the KV
cache) and experts ``r * e .. (r + 1) * e - 1``; everything else is replicated.
The weights of the whole model (the *full state*) are named as in
:func:`state_shapes`; :func:`shard_state` cuts out one rank's part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

import torch

from .._core.namespace import PublicDir, public_dir

__all__ = ["LmConfig", "Shard", "check_state", "check_world", "init_full_state", "shard_state", "state_shapes"]


__dir__: PublicDir = public_dir(globals(), __all__)


class Shard(NamedTuple):
    """What one rank of a world holds: its attention heads, its experts, and its heads' width."""

    heads: int
    experts: int
    width: int
    """``heads * head_dim``: the rank's part of the model width in attention."""


_FLOAT_FIELDS: Final = ("rope_base", "norm_eps")


@dataclass(frozen=True)
class LmConfig:
    """The shape of the model; the defaults are those of the shipped weights (about 0.79 M parameters).

    Raises:
        TypeError: a field has the wrong type (``bool`` is not an int).
        ValueError: a field is out of range, ``n_heads`` does not divide ``d_model``, the
            head width is odd (rotary positions rotate pairs), or ``top_k > n_experts``.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 192
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in _FLOAT_FIELDS:
                if type(value) is not int:
                    raise TypeError(f"LmConfig.{field.name} must be an int, got {type(value).__name__} {value!r}")
                if value < 1:
                    raise ValueError(f"LmConfig.{field.name} must be at least 1, got {value}")
            else:
                if type(value) not in (int, float):
                    raise TypeError(f"LmConfig.{field.name} must be a float, got {type(value).__name__} {value!r}")
                if not 0 < value < float("inf"):
                    raise ValueError(f"LmConfig.{field.name} must be positive and finite, got {value}")
                object.__setattr__(self, field.name, float(value))
        if self.d_model % self.n_heads:
            raise ValueError(f"LmConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.head_dim % 2:
            raise ValueError(f"LmConfig: the head width d_model / n_heads = {self.head_dim} must be even (RoPE)")
        if self.top_k > self.n_experts:
            raise ValueError(f"LmConfig.top_k={self.top_k} must not exceed n_experts={self.n_experts}")

    @property
    def head_dim(self) -> int:
        """The width of one attention head, ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    def per_rank(self, world_size: int) -> Shard:
        """The sharding rule: what each of ``world_size`` ranks holds (``world_size`` checked: :func:`check_world`)."""
        check_world(self, 0, world_size)
        heads = self.n_heads // world_size
        return Shard(heads, self.n_experts // world_size, heads * self.head_dim)

    def kv_cache_bytes(self, num_slots: int, world_size: int, itemsize: int) -> int:
        """Bytes of one rank's KV cache for ``num_slots`` slots, its heads' keys and values of ``itemsize`` bytes."""
        return 2 * self.n_layers * num_slots * self.max_seq_len * self.per_rank(world_size).width * itemsize


def check_world(config: LmConfig, rank: int, world_size: int) -> None:
    """Check that ``world_size`` ranks can share ``config``'s heads and experts and that ``rank`` is one of them.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int.
        ValueError: ``world_size < 1``, it does not divide ``n_heads`` and ``n_experts``, or
            ``rank`` is not in ``0 ..= world_size - 1``.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if config.n_heads % world_size or config.n_experts % world_size:
        raise ValueError(
            f"world_size={world_size} must divide both n_heads={config.n_heads} and n_experts={config.n_experts}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size} (0 ..= {world_size - 1})")


def state_shapes(config: LmConfig, world_size: int = 1) -> dict[str, tuple[int, ...]]:
    """The name and shape of every weight of one rank's shard; ``world_size=1``: the full state.

    Raises:
        ValueError: as :func:`check_world`.
    """
    _, local_experts, width = config.per_rank(world_size)
    dims = (config.d_model, config.d_expert)
    shapes: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, config.d_model)}
    for layer in range(config.n_layers):
        prefix = f"layers.{layer}."
        shapes[prefix + "attn_norm"] = (config.d_model,)
        for name in ("wq", "wk", "wv"):
            shapes[f"{prefix}attn.{name}"] = (width, config.d_model)
        shapes[prefix + "attn.wo"] = (config.d_model, width)
        shapes[prefix + "moe_norm"] = (config.d_model,)
        shapes[prefix + "moe.router"] = (config.n_experts, config.d_model)
        shapes[prefix + "moe.w_gate"] = (local_experts, *dims[::-1])
        shapes[prefix + "moe.w_up"] = (local_experts, *dims[::-1])
        shapes[prefix + "moe.w_down"] = (local_experts, *dims)
    shapes["final_norm"] = (config.d_model,)
    shapes["lm_head"] = (config.vocab_size, config.d_model)
    return shapes


_SPLIT_DIMS: Final[dict[str, int]] = {
    "attn.wq": 0,
    "attn.wk": 0,
    "attn.wv": 0,
    "attn.wo": 1,
    "moe.w_gate": 0,
    "moe.w_up": 0,
    "moe.w_down": 0,
}
"""The dimension along which each sharded weight of a layer is split over the ranks; the rest is replicated."""


def check_state(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check that ``state`` holds exactly the weights of ``shapes`` with those shapes.

    Raises:
        ValueError: a weight is missing, unexpected, not a floating-point tensor, or of another shape.
    """
    missing = sorted(shapes.keys() - state.keys())
    extra = sorted(state.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"the state does not match the config: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"weight {name!r} must be a floating-point tensor, got {tensor!r:.80}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config needs {shape}")


def shard_state(
    full: Mapping[str, torch.Tensor], config: LmConfig, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of the full state: its heads' rows of ``wq``/``wk``/``wv`` and columns of
    ``wo``, its experts of ``w_gate``/``w_up``/``w_down``; every other weight whole.

    Returns views of ``full``'s tensors (copy them to keep them past ``full``'s changes).

    Raises:
        ValueError: as :func:`check_world`, or ``full`` is not a full state of ``config`` (:func:`check_state`).
    """
    check_world(config, rank, world_size)
    check_state(full, state_shapes(config))
    shard: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        dim = _SPLIT_DIMS.get(name.split(".", 2)[-1])
        if dim is None:
            shard[name] = tensor
        else:  # the rank's heads or experts: one of world_size equal parts, in rank order
            size = tensor.shape[dim] // world_size
            shard[name] = tensor.narrow(dim, rank * size, size)
    return shard


def init_full_state(config: LmConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random full state in float32 on the CPU, drawn from ``generator`` only (for training).

    Norm gains are 1; every matrix is normal with standard deviation ``0.02``, and
    the projections into the residual stream (``wo``, ``w_down``) are scaled by
    ``1 / sqrt(2 * n_layers)`` (GPT-2's scheme).
    """
    residual_scale = (2 * config.n_layers) ** -0.5
    state: dict[str, torch.Tensor] = {}
    for name, shape in state_shapes(config).items():
        if name.endswith("norm"):
            state[name] = torch.ones(shape)
        else:
            std = 0.02 * (residual_scale if name.endswith(("wo", "w_down")) else 1.0)
            state[name] = torch.randn(shape, generator=generator) * std
    return state
