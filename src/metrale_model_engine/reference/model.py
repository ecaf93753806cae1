"""The reference model on one rank: :class:`ShardedLm`, a shard (see :mod:`.config`) of the whole transformer.

A rank's :class:`ShardedLm` has the ``state_dict()`` that :func:`~.config.shard_state`
cuts out of the full state.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .._core.namespace import PublicDir, public_dir
from .config import LmConfig, check_world, shard_state
from .layers import (
    AllReduce,
    Attend,
    RotaryTables,
    ShardedBlock,
    attend_causal,
    attend_decode,
    attend_prefill,
    rms_norm,
)

__all__ = ["AllReduce", "ShardedLm"]


__dir__: PublicDir = public_dir(globals(), __all__)


def _no_reduce(_: torch.Tensor) -> None:
    """The all-reduce of a one-rank group: nothing to add."""


def _check_in_range(name: str, values: torch.Tensor, end: int) -> None:
    """Raise ValueError naming the first value of the 1-D ``values`` outside ``0 ..= end - 1`` (a host sync)."""
    bad = ((values < 0) | (values >= end)).nonzero()
    if bad.numel():
        index = int(bad[0, 0])
        raise ValueError(f"{name}[{index}]={int(values[index])} is out of range (0 ..= {end - 1})")


def _check_int_tensor(name: str, value: object, dim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != dim:
        if isinstance(value, torch.Tensor):
            described = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
        else:
            described = f"{type(value).__name__} {value!r:.80}"
        raise TypeError(f"{name} must be a {dim}-D int64 tensor, got {described}")
    if value.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    return value


def _check_int(name: str, value: object, end: int) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.80}")
    if not 0 <= value < end:
        raise ValueError(f"{name}={value} is out of range (0 ..= {end - 1})")
    return value


class ShardedLm(nn.Module):
    """Rank ``rank`` of ``world_size`` of the decoder-only MoE transformer, with a KV cache of ``num_slots`` slots.

    Attention heads and experts are split over the ranks (see the package
    docstring); embedding, norms, router and LM head are replicated.  Every call
    of :meth:`forward`, :meth:`prefill` and :meth:`decode` calls ``all_reduce``
    exactly ``2 * n_layers`` times, in the same order on every rank, so the ranks
    must make the same calls with the same arguments.  Parameters start as zeros
    (norm gains as ones): load weights with :meth:`load_full_state`.

    The KV cache holds, per layer, ``k_cache`` and ``v_cache`` of shape
    ``[num_slots, max_seq_len, local_heads, head_dim]`` (non-persistent buffers, so
    ``state_dict()`` is the weights alone).  It knows no sequence lengths: callers
    pass positions, and a slot's entries past the position attended to are ignored.

    Args:
        config: the model's shape.
        num_slots: the number of sequences the cache holds.
        rank: this rank, in ``0 ..= world_size - 1``.
        world_size: the group size; it must divide ``n_heads`` and ``n_experts``.  One
            rank is the plain model.
        all_reduce: in-place sum over the group; required when ``world_size > 1``.
            With one rank it may be given (it is then called as above) or not.
        dtype: of the weights, cache and activations (norms, rotations and routing
            weights are computed in at least float32).
        device: of the weights and cache; default torch's current default.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``num_slots < 1``, bad ``rank``/``world_size`` (see :func:`check_world`),
            or ``all_reduce`` is missing while ``world_size > 1``.
    """

    def __init__(
        self,
        config: LmConfig,
        *,
        num_slots: int,
        rank: int = 0,
        world_size: int = 1,
        all_reduce: AllReduce | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, LmConfig):
            raise TypeError(f"config must be an LmConfig, got {type(config).__name__}")
        if type(num_slots) is not int:
            raise TypeError(f"num_slots must be an int, got {type(num_slots).__name__} {num_slots!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        check_world(config, rank, world_size)
        if all_reduce is None and world_size > 1:
            raise ValueError(f"all_reduce is required when world_size={world_size} > 1 (it sums over the ranks)")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        self.num_slots = num_slots
        self.rank = rank
        self.world_size = world_size
        self._all_reduce: AllReduce = _no_reduce if all_reduce is None else all_reduce
        self.embed: nn.Parameter = nn.Parameter(
            torch.zeros(config.vocab_size, config.d_model, dtype=dtype, device=device)
        )
        self.layers: nn.ModuleList = nn.ModuleList(
            ShardedBlock.build(config, rank, world_size, num_slots=num_slots, dtype=dtype, device=device)
            for _ in range(config.n_layers)
        )
        self.final_norm: nn.Parameter = nn.Parameter(torch.ones(config.d_model, dtype=dtype, device=device))
        self.lm_head: nn.Parameter = nn.Parameter(
            torch.zeros(config.vocab_size, config.d_model, dtype=dtype, device=device)
        )
        self.rotary: RotaryTables = RotaryTables(
            config.head_dim, config.max_seq_len, config.rope_base, dtype=dtype, device=device
        )

    def load_full_state(self, full: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's shard (:func:`shard_state`) of the unsharded ``full``, converted to the model's dtype.

        Raises:
            ValueError: ``full`` is not a full state of the model's config.
        """
        self.load_state_dict(shard_state(full, self.config, self.rank, self.world_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The training path: logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]`` (int64) at positions ``0 .. T-1``.

        Causal attention within each row, no cache.  Differentiable when
        ``world_size == 1`` (the all-reduce is not autograd-aware).

        Raises:
            TypeError: ``tokens`` is not a 2-D int64 tensor.
            ValueError: ``tokens`` is empty, longer than ``max_seq_len``, or holds a token outside the vocabulary.
        """
        tokens = _check_int_tensor("tokens", tokens, 2).to(self.embed.device)
        length = tokens.shape[1]
        if length > self.config.max_seq_len:
            raise ValueError(f"tokens has {length} positions, more than max_seq_len={self.config.max_seq_len}")
        _check_in_range("tokens.flatten()", tokens.flatten(), self.config.vocab_size)
        positions = torch.arange(length, device=tokens.device)
        hidden = self._layers(F.embedding(tokens, self.embed), self.rotary.at(positions), attend_causal)
        return self._head(hidden)

    @torch.no_grad()
    def prefill(self, slot: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed a chunk of a sequence: ``tokens`` (1-D int64) at positions ``start .. start + len - 1`` of ``slot``.

        Writes the chunk's keys and values into the slot's cache; each position ``p``
        attends to positions ``0 ..= p`` of the slot, earlier chunks included.

        Returns:
            The logits ``[vocab]`` after the chunk's last token.

        Raises:
            TypeError: a wrong argument type.
            ValueError: ``slot`` out of range, ``tokens`` empty or outside the vocabulary,
                ``start < 0`` or ``start + len(tokens) > max_seq_len``.
        """
        _check_int("slot", slot, self.num_slots)
        tokens = _check_int_tensor("tokens", tokens, 1).to(self.embed.device)
        _check_int("start", start, self.config.max_seq_len)
        end = start + tokens.shape[0]
        if end > self.config.max_seq_len:
            raise ValueError(
                f"start={start} + {tokens.shape[0]} tokens = {end} passes max_seq_len={self.config.max_seq_len}"
            )
        _check_in_range("tokens", tokens, self.config.vocab_size)
        positions = torch.arange(start, end, device=tokens.device)
        attend = functools.partial(attend_prefill, slot, start)
        hidden = self._layers(F.embedding(tokens, self.embed).unsqueeze(0), self.rotary.at(positions), attend)
        return self._head(hidden[0, -1])

    @torch.no_grad()
    def decode(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of ``B`` sequences: row ``i`` feeds ``tokens[i]`` at ``positions[i]`` of ``slots[i]``.

        Each row writes its keys and values into its slot's cache and attends to
        positions ``0 ..= positions[i]`` of that slot only; rows do not influence each other.

        Args:
            slots: 1-D int64 tensor of ``B`` distinct slot indices.
            tokens: 1-D int64 tensor of ``B`` tokens, one per slot.
            positions: 1-D int64 tensor of ``B`` positions, one per slot.

        Returns:
            The logits ``[B, vocab]``.

        Raises:
            TypeError: an argument is not a 1-D int64 tensor.
            ValueError: empty or unequal lengths, a repeated slot, or a slot, token or
                position out of range.
        """
        device = self.embed.device
        slots = _check_int_tensor("slots", slots, 1).to(device)
        tokens = _check_int_tensor("tokens", tokens, 1).to(device)
        positions = _check_int_tensor("positions", positions, 1).to(device)
        if not slots.shape == tokens.shape == positions.shape:
            raise ValueError(
                f"slots, tokens and positions must have one length, got {slots.numel()}, "
                f"{tokens.numel()} and {positions.numel()}"
            )
        _check_in_range("slots", slots, self.num_slots)
        _check_in_range("tokens", tokens, self.config.vocab_size)
        _check_in_range("positions", positions, self.config.max_seq_len)
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError(f"slots must be distinct, got {slots.tolist()}")
        attend = functools.partial(attend_decode, slots, positions)
        hidden = self._layers(F.embedding(tokens, self.embed).unsqueeze(1), self.rotary.at(positions[:, None]), attend)
        return self._head(hidden[:, 0])

    def _blocks(self) -> Iterator[ShardedBlock]:
        for block in self.layers:
            assert isinstance(block, ShardedBlock)
            yield block

    def _layers(
        self,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        for block in self._blocks():
            x = block(x, tables, attend, self._all_reduce)
        return x

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.final_norm, self.config.norm_eps), self.lm_head)
