"""Which part of which checkpoint tensor goes where in a rank's parameters: the sharding rule of
[`shard`][metrale_model_engine.reference.LmConfig.shard], written as
[`Piece`][metrale_model_engine.reference.checkpoint.Piece] objects.

One list serves every direction: a rank reads its pieces from the files
([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard]) or from tensors in memory
([`load_state`][metrale_model_engine.reference.checkpoint.load_state]), and a one-rank model writes its parameters back
under the Hub's names ([`export_state`][metrale_model_engine.reference.checkpoint.export_state]).  When a rank's shard
changes (its world shrank or grew), [`reshard`][metrale_model_engine.reference.checkpoint.reshard] compares the two
lists: the slices it holds already, and those it must read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..config import LmConfig, Shard
from ..network.model import ShardedLm
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


class Reshard(NamedTuple):
    """A rank's change of shard ([`reshard`][metrale_model_engine.reference.checkpoint.reshard]): what it holds
    already, and what it must read."""

    held: list[tuple[Piece, Piece]]
    """The slices the old shard holds that the new one needs, as ``(old, new)`` pairs: one tensor's same part,
    ``old.target[old.into]`` its place among the old shard's parameters, ``new.target[new.into]`` among the new's."""
    missing: list[Piece]
    """The new shard's slices that the old one does not hold: to be read from the checkpoint."""


def reshard(config: LmConfig, family: Family, old: Shard, new: Shard) -> Reshard:
    """What a rank whose shard changes from ``old`` to ``new`` already holds, and what it must read.

    E.g. rank 2 of 4 that goes on as rank 2 of 3 after a loss: ``reshard(config, family,
    config.shard(2, 4), config.shard(2, 3))``.  Every piece of ``new`` (``pieces``) is split
    where ``old`` holds a part of it: the part held goes to ``held`` (a replicated tensor, an
    expert both hold, the rows of the heads both hold), what is left to ``missing``; together
    they cover each of ``new``'s pieces once.  A pure function of its arguments.
    """
    holding = {piece.name: piece for piece in pieces(config, family, old)}
    held: list[tuple[Piece, Piece]] = []
    missing: list[Piece] = []
    for piece in pieces(config, family, new):
        had = holding.get(piece.name)
        if had is None:
            missing.append(piece)
            continue
        if _ranges(had) == _ranges(piece):  # held whole
            held.append((had, piece))
            continue
        common = _common(had, piece)
        if common is None:
            missing.append(piece)
            continue
        dim, start, stop = common
        mine = _ranges(piece)[dim]
        held.append((_narrowed(had, dim, start, stop), _narrowed(piece, dim, start, stop)))
        missing += [_narrowed(piece, dim, a, b) for a, b in ((mine.start, start), (stop, mine.stop)) if a < b]
    return Reshard(held, missing)


def _ranges(piece: Piece) -> tuple[range, ...]:
    """The indices ``piece.part`` reads along each dimension of its tensor."""
    whole = (slice(None),) * (len(piece.shape) - len(piece.part))
    return tuple(
        range(size)[index] if isinstance(index, slice) else range(index, index + 1)
        for size, index in zip(piece.shape, piece.part + whole, strict=True)
    )


def _common(had: Piece, wanted: Piece) -> tuple[int, int, int] | None:
    """What ``had`` holds of ``wanted``, another part of its tensor: ``(dim, start, stop)``, the indices
    ``start .. stop - 1`` along dimension ``dim`` of the tensor and the same as ``wanted``'s along the others;
    ``None`` when it holds none of it, or the parts differ in more than one dimension (then it is read whole)."""
    ours, theirs = _ranges(had), _ranges(wanted)
    differ = [dim for dim, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    if len(differ) != 1 or any(r.step != 1 for r in ours + theirs):
        return None
    dim = differ[0]
    start, stop = max(ours[dim].start, theirs[dim].start), min(ours[dim].stop, theirs[dim].stop)
    return (dim, start, stop) if start < stop else None


def _narrowed(piece: Piece, dim: int, start: int, stop: int) -> Piece:
    """``piece`` cut to indices ``start .. stop - 1`` of its tensor's dimension ``dim`` (within its part), its
    place in the parameter cut alike."""
    index = piece.part + (slice(None),) * (len(piece.shape) - len(piece.part))
    kept = [d for d, entry in enumerate(index) if isinstance(entry, slice)]  # an int drops its dimension
    axis = kept.index(dim)  # the dimension of the part read
    first = _ranges(piece)[dim].start
    start, stop = start - first, stop - first
    into_axis = len(kept) - 1 - axis if piece.transposed else axis
    return replace(piece, part=_cut(piece.part, axis, start, stop), into=_cut(piece.into, into_axis, start, stop))


def _cut(index: Index, axis: int, start: int, stop: int) -> Index:
    """``index`` narrowed to ``start .. stop - 1`` of what it selects along ``axis`` (counted among the dimensions
    it keeps: its slices, then those past it)."""
    entries = list(index)
    kept = [at for at, entry in enumerate(entries) if isinstance(entry, slice)]
    while len(kept) <= axis:
        entries.append(slice(None))
        kept.append(len(entries) - 1)
    entry = entries[kept[axis]]
    assert isinstance(entry, slice) and entry.step in (None, 1)
    first = entry.start or 0
    entries[kept[axis]] = slice(first + start, first + stop)
    return tuple(entries)


Read = Callable[[Piece], torch.Tensor]
"""Reads a piece's part of its tensor."""


def fill(model: ShardedLm, family: Family, read: Read, found: Sequence[Piece] | None = None) -> None:
    """Copy into ``model``'s parameters every piece of its shard (or ``found``, pieces of it), as ``read`` gives it
    (converted to their dtype)."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for piece in pieces(model.config, family, model.shard) if found is None else found:
            place = parameters[piece.target][piece.into]
            part = read(piece).t() if piece.transposed else read(piece)
            if tuple(part.shape) != tuple(place.shape):  # the tensor's whole shape was checked: a bug if not
                raise AssertionError(f"{piece.name}{list(piece.part)} has shape {tuple(part.shape)}, not {place.shape}")
            place.copy_(part)


def copy_held(model: ShardedLm, held: ShardedLm, slices: Sequence[tuple[Piece, Piece]]) -> None:
    """Copy into ``model``'s parameters the ``slices`` that ``held`` holds (``Reshard.held``: ``held``'s place, then
    ``model``'s), converted to ``model``'s dtype and device."""
    theirs, ours = dict(held.named_parameters()), dict(model.named_parameters())
    with torch.no_grad():
        for old, new in slices:
            ours[new.target][new.into].copy_(theirs[old.target][old.into])


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
