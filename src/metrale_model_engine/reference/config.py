"""The reference model's shape (``LmConfig``) and its sharding rule (``LmConfig.shard``), stated once.

A world of ``world_size`` ranks splits the query heads and the experts as evenly
as it can, the way Metrale (and Megatron, vLLM, gpt-fast) shards a model: of ``n``
things over ``w`` ranks, the first ``n % w`` ranks hold ``n // w + 1`` and the
others ``n // w``, in order (8 heads over 3 ranks: heads 0-2, 3-5 and 6-7).  A rank
holds its query heads (their rows of the query projection and columns of the output
projection), the KV heads those query heads read (rows of the key and value
projections, and their part of the KV cache) and its experts whole; embedding,
norms, router and LM head are replicated.  Under grouped-query attention a KV head
whose query heads fall on two or more ranks is held by each of them (replicated, as
vLLM does), so any world size up to the number of query heads serves; a rank may
then hold no expert (more ranks than experts) and it adds nothing for them.

Where a rank's query heads begin or end inside a KV group (8 heads of 2 KV heads over
3 ranks: the middle rank's heads 3-5 read KV heads 0 and 1, one and two of them), its
attention pads them with zero heads to groups of one size (``Shard.pad_before``,
``Shard.pad_after``: zero rows of the query projection, zero columns of the output
projection), so that every KV head serves the same number of query heads, as the
attention kernels want: a decode step keeps its ops and shapes, and the padding
adds nothing to the sums.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, NamedTuple


class Shard(NamedTuple):
    """What one rank of a world holds ([`LmConfig.shard`][metrale_model_engine.reference.LmConfig.shard])."""

    first_head: int
    heads: int
    """Query heads ``first_head .. first_head + heads - 1``."""
    first_kv_head: int
    kv_heads: int
    """KV heads ``first_kv_head .. first_kv_head + kv_heads - 1``: the ones its query heads read."""
    first_expert: int
    experts: int
    """Experts ``first_expert .. first_expert + experts - 1`` (none when the world has more ranks than experts)."""
    pad_before: int = 0
    """Zero heads its attention computes before its query heads, so that each KV head serves as many (the module)."""
    pad_after: int = 0
    """Zero heads after its query heads."""

    @property
    def padded_heads(self) -> int:
        """The query heads its attention computes, the padding included: ``kv_heads`` groups of one size."""
        return self.pad_before + self.heads + self.pad_after


_FLOAT_FIELDS: Final = ("rope_base", "norm_eps")
_BOOL_FIELDS: Final = ("qk_norm", "norm_topk_prob", "tie_embeddings")
_DERIVED_FIELDS: Final = ("n_kv_heads", "head_dim")
"""Fields whose 0 means "derived from the others" (see [`LmConfig`][metrale_model_engine.reference.LmConfig])."""


@dataclass(frozen=True)
class LmConfig:
    """The shape of a decoder-only mixture-of-experts transformer (Mixtral's and Qwen3-MoE's arithmetic).

    The defaults are those of the shipped model (about 0.79 M parameters); a
    checkpoint's ``config.json`` gives the others
    ([`metrale_model_engine.reference.checkpoint`][metrale_model_engine.reference.checkpoint]).

    Attributes:
        vocab_size, d_model, n_layers: the vocabulary, the residual width, the layers.
        n_heads: query heads.
        n_experts, top_k, d_expert: experts per layer, experts each token picks, an expert's hidden width.
        max_seq_len: positions a slot's KV cache holds (the context).
        rope_base: RoPE's base (``rope_theta``).
        norm_eps: RMSNorm's epsilon.
        n_kv_heads: key/value heads (grouped-query attention: ``n_heads`` must be a multiple);
            0 (the default) means ``n_heads``.
        head_dim: the width of a head; 0 (the default) means ``d_model // n_heads``.
        qk_norm: an RMSNorm over each query and key head before the rotation (Qwen3).
        norm_topk_prob: the top-k routing weights renormalised to sum to 1 (Mixtral
            always; Qwen3-MoE by its config), else the softmax over every expert, as picked.
        tie_embeddings: the LM head is the embedding (``tie_word_embeddings``).

    Raises:
        TypeError: a field has the wrong type (``bool`` is not an int).
        ValueError: a field is out of range, ``n_heads`` does not divide ``d_model`` (when
            ``head_dim`` is derived), the head width is odd (rotary positions rotate
            pairs), ``n_kv_heads`` does not divide ``n_heads``, or ``top_k > n_experts``.
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
    n_kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    norm_topk_prob: bool = True
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _FLOAT_FIELDS:
                if type(value) not in (int, float):
                    raise TypeError(f"LmConfig.{field.name} must be a float, got {type(value).__name__} {value!r}")
                if not 0 < value < float("inf"):
                    raise ValueError(f"LmConfig.{field.name} must be positive and finite, got {value}")
                object.__setattr__(self, field.name, float(value))
            elif field.name in _BOOL_FIELDS:
                if type(value) is not bool:
                    raise TypeError(f"LmConfig.{field.name} must be a bool, got {type(value).__name__} {value!r}")
            else:
                if type(value) is not int:
                    raise TypeError(f"LmConfig.{field.name} must be an int, got {type(value).__name__} {value!r}")
                least = 0 if field.name in _DERIVED_FIELDS else 1
                if value < least:
                    raise ValueError(f"LmConfig.{field.name} must be at least {least}, got {value}")
        if not self.head_dim:
            if self.d_model % self.n_heads:
                raise ValueError(f"LmConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"LmConfig: the head width {self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LmConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"LmConfig.top_k={self.top_k} must not exceed n_experts={self.n_experts}")

    def world_sizes(self) -> list[int]:
        """Every world size that can split this model (``check_world``), ascending: ``1 ..= n_heads``."""
        return list(range(1, self.n_heads + 1))

    def shard(self, rank: int, world_size: int) -> Shard:
        """The sharding rule: what rank ``rank`` of ``world_size`` holds (both checked: ``check_world``).

        Query heads and experts split as evenly as they can (the first ranks one more); the
        KV heads are those the query heads read; the padding makes groups of one size (see the module).
        """
        check_world(self, rank, world_size)
        first_head, heads = _even_part(self.n_heads, world_size, rank)
        first_expert, experts = _even_part(self.n_experts, world_size, rank)
        group = self.n_heads // self.n_kv_heads  # query heads per KV head
        first_kv_head, last_kv_head = first_head // group, (first_head + heads - 1) // group
        kv_heads = last_kv_head - first_kv_head + 1
        leading = min(heads, (first_kv_head + 1) * group - first_head)  # its heads in its first KV head's group
        trailing = min(heads, first_head + heads - last_kv_head * group)  # and in its last one's
        per_kv_head = max(leading, trailing) if kv_heads <= 2 else group  # whole groups between the two ends
        return Shard(
            first_head,
            heads,
            first_kv_head,
            kv_heads,
            first_expert,
            experts,
            pad_before=per_kv_head - leading,
            pad_after=per_kv_head - trailing,
        )

    def kv_cache_bytes(self, num_slots: int, world_size: int, itemsize: int, *, rank: int = 0) -> int:
        """Bytes of rank ``rank``'s KV cache for ``num_slots`` slots: its KV heads' keys and values of ``itemsize``
        bytes (``rank`` and ``world_size`` checked: ``check_world``)."""
        kv_heads = self.shard(rank, world_size).kv_heads
        return 2 * self.n_layers * num_slots * self.max_seq_len * kv_heads * self.head_dim * itemsize


def _even_part(count: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``count`` things split over ``parts`` as evenly as they can be: ``(first, how many)``,
    the first ``count % parts`` parts holding one more than the others."""
    base, extra = divmod(count, parts)
    return index * base + min(index, extra), base + (index < extra)


def check_world(config: LmConfig, rank: int, world_size: int) -> None:
    """Check that ``world_size`` ranks can split ``config`` and that ``rank`` is one of them.

    Any world size from 1 to the number of query heads splits a model: each rank
    holds one query head at least (see the module).

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int.
        ValueError: ``world_size < 1``, more ranks than ``n_heads`` (the message gives
            the world sizes that can), or ``rank`` is not in ``0 ..= world_size - 1``.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size > config.n_heads:
        raise ValueError(
            f"world_size={world_size} cannot split the model: each rank holds one of its n_heads={config.n_heads} "
            f"query heads at least (world sizes that can: 1 ..= {config.n_heads})"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range for world_size={world_size} (0 ..= {world_size - 1})")
