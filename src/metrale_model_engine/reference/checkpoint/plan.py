"""Which part of which checkpoint tensor goes where in a rank's parameters: the sharding rule of
[`shard`][metrale_model_engine.reference.LmConfig.shard], written as
[`Piece`][metrale_model_engine.reference.checkpoint.Piece] objects.

One list serves every direction: a rank reads its pieces from the files
([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard]) or from tensors in memory
([`load_state`][metrale_model_engine.reference.checkpoint.load_state]), and a one-rank model writes its parameters back
under the Hub's names ([`export_state`][metrale_model_engine.reference.checkpoint.export_state]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..config import LmConfig, Shard
from ..model import ShardedLm
from .family import Family

Index = tuple[int | slice, ...]
"""An index into a tensor: ``tensor[index]``; ``()`` is the whole tensor."""


@dataclass(frozen=True)
class Piece:
    """A tensor of the checkpoint, or the part of it that a rank holds, and its place in the rank's parameters."""

    name: str
    """The tensor's name in the checkpoint."""
    shape: tuple[int, ...]
    """The tensor's whole shape in the checkpoint, as the config says."""
    part: Index
    """The part of the tensor this rank reads."""
    target: str
    """The parameter it goes into (a name of ``ShardedLm.named_parameters()``)."""
    into: Index
    """Where in that parameter."""
    transposed: bool = False
    """Whether the parameter holds it transposed (an expert's matrices)."""


def pieces(config: LmConfig, family: Family, shard: Shard) -> list[Piece]:
    """Every piece rank ``shard`` of a model of ``config`` reads from a checkpoint of ``family``.

    Query heads are rows of ``q_proj`` and columns of ``o_proj`` (between the zero
    heads of the shard's padding, which no piece fills); KV heads rows of
    ``k_proj`` and ``v_proj`` (all three stacked into ``wqkv``); an expert's gate and
    up projections are the two halves of its ``w_in``, its down projection its ``w_out``, each
    transposed; everything else is read whole.
    """
    width, head, expert = config.d_model, config.head_dim, config.d_expert
    h, g = shard.padded_heads, shard.kv_heads
    q_rows = slice(shard.first_head * head, (shard.first_head + shard.heads) * head)
    kv_rows = slice(shard.first_kv_head * head, (shard.first_kv_head + g) * head)
    own = slice(shard.pad_before * head, (shard.pad_before + shard.heads) * head)  # its query heads between the pads
    found = [Piece("model.embed_tokens.weight", (config.vocab_size, width), (), "embed", ())]
    for layer in range(config.n_layers):
        name, target = family.layer(layer), f"layers.{layer}."
        attention = f"{name}self_attn."
        found += [
            Piece(f"{name}input_layernorm.weight", (width,), (), f"{target}attn_norm", ()),
            Piece(f"{attention}q_proj.weight", (config.n_heads * head, width), (q_rows,), f"{target}attn.wqkv",
                  (own,)),
            Piece(f"{attention}k_proj.weight", (config.n_kv_heads * head, width), (kv_rows,), f"{target}attn.wqkv",
                  (slice(h * head, (h + g) * head),)),
            Piece(f"{attention}v_proj.weight", (config.n_kv_heads * head, width), (kv_rows,), f"{target}attn.wqkv",
                  (slice((h + g) * head, (h + 2 * g) * head),)),
            Piece(f"{attention}o_proj.weight", (width, config.n_heads * head), (slice(None), q_rows),
                  f"{target}attn.wo", (slice(None), own)),
        ]  # fmt: skip
        if config.qk_norm:
            found += [Piece(f"{attention}{norm}.weight", (head,), (), f"{target}attn.{norm}", ()) for norm in
                      ("q_norm", "k_norm")]  # fmt: skip
        found += [
            Piece(f"{name}post_attention_layernorm.weight", (width,), (), f"{target}moe_norm", ()),
            Piece(family.router(layer), (config.n_experts, width), (), f"{target}moe.router", ()),
        ]
        for local in range(shard.experts):
            gate, up, down = family.expert(layer, shard.first_expert + local)
            found += [
                Piece(gate, (expert, width), (), f"{target}moe.w_in", (local, slice(None), slice(0, expert)), True),
                Piece(up, (expert, width), (), f"{target}moe.w_in", (local, slice(None), slice(expert, None)), True),
                Piece(down, (width, expert), (), f"{target}moe.w_out", (local,), True),
            ]
    found.append(Piece("model.norm.weight", (width,), (), "final_norm", ()))
    if not config.tie_embeddings:
        found.append(Piece("lm_head.weight", (config.vocab_size, width), (), "lm_head", ()))
    return found


Read = Callable[[Piece], torch.Tensor]
"""Reads a piece's part of its tensor."""


def fill(model: ShardedLm, family: Family, read: Read) -> None:
    """Copy into ``model``'s parameters every piece of its shard, as ``read`` gives it (converted to their dtype)."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for piece in pieces(model.config, family, model.shard):
            place = parameters[piece.target][piece.into]
            part = read(piece).t() if piece.transposed else read(piece)
            if tuple(part.shape) != tuple(place.shape):  # the tensor's whole shape was checked: a bug if not
                raise AssertionError(f"{piece.name}{list(piece.part)} has shape {tuple(part.shape)}, not {place.shape}")
            place.copy_(part)


def load_state(model: ShardedLm, family: Family, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``model``'s shard from ``state``, tensors in memory under the checkpoint's names (e.g. ``transformers``'
    files read whole, or [`export_state`][metrale_model_engine.reference.checkpoint.export_state]'s).

    Raises:
        ValueError: a tensor of the shard is missing from ``state`` or has another shape.
    """
    for piece in pieces(model.config, family, model.shard):
        if piece.name not in state:
            raise ValueError(f"the state has no tensor {piece.name!r}")
        if tuple(state[piece.name].shape) != piece.shape:
            raise ValueError(f"tensor {piece.name!r} has shape {tuple(state[piece.name].shape)}, not {piece.shape}")
    fill(model, family, lambda piece: state[piece.name][piece.part])


def export_state(model: ShardedLm, family: Family) -> dict[str, torch.Tensor]:
    """A one-rank model's parameters under the checkpoint's names, as new CPU tensors in their dtype.

    Raises:
        ValueError: ``model`` is one of several ranks (it holds a part of the model).
    """
    if model.world_size != 1:
        raise ValueError(f"only a one-rank model holds every weight; this is rank {model.rank} of {model.world_size}")
    parameters = dict(model.named_parameters())
    found = {}
    for piece in pieces(model.config, family, model.shard):
        held = parameters[piece.target][piece.into].detach()
        found[piece.name] = (held.t() if piece.transposed else held).to("cpu", copy=True).contiguous()
    return found
