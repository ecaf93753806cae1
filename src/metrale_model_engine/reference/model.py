"""The reference model on one rank: ``ShardedLm``, a shard (see ``config``) of the whole transformer.

Its weights come from a checkpoint in the Hugging Face layout
([`metrale_model_engine.reference.checkpoint`][metrale_model_engine.reference.checkpoint]), each rank reading its own
part.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn

from .config import LmConfig, Shard, check_world
from .experts import ExpertRouting, ShardedMoe
from .layers import (
    AllReduce,
    Attend,
    RotaryTables,
    ShardedAttention,
    attend_causal,
    attend_decode,
    attend_prefill,
    attend_split,
    rms_norm,
)


class ShardedBlock(nn.Module):
    """One layer: pre-norm attention, then a pre-norm mixture of experts, each summed over the ranks.

    ``attn_norm`` and ``moe_norm`` are the RMSNorm gains, replicated, initially ones.
    """

    def __init__(self, attn: ShardedAttention, moe: ShardedMoe, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        width, like = attn.wo.shape[0], attn.wo
        self.attn_norm: nn.Parameter = nn.Parameter(torch.ones(width, dtype=like.dtype, device=like.device))
        self.attn = attn
        self.moe_norm: nn.Parameter = nn.Parameter(torch.ones(width, dtype=like.dtype, device=like.device))
        self.moe = moe

    def forward(self, x: torch.Tensor, factors: torch.Tensor, attend: Attend, all_reduce: AllReduce) -> torch.Tensor:
        """The residual stream ``x`` ``[*N, D]`` after this layer; calls ``all_reduce`` twice.

        ``factors``: the rows of ``RotaryTables`` at the tokens' positions.
        """
        partial: torch.Tensor = self.attn(rms_norm(x, self.attn_norm, self.eps), factors, attend)
        all_reduce(partial)
        x = x + partial
        partial = self.moe(rms_norm(x, self.moe_norm, self.eps))
        all_reduce(partial)
        return x + partial


RUN_SPAN_STEP: Final = 32
"""What ``run_span`` rounds to."""


def decode_span(needed: int, max_seq_len: int) -> int:
    """The positions a decode step attends over when its longest row needs ``needed``: a power of two,
    at least 16, at most ``max_seq_len``; so that the cache read grows with the sequences, in few shapes."""
    return min(max_seq_len, max(16, 1 << (needed - 1).bit_length()))


def run_span(needed: int, max_seq_len: int) -> int:
    """The positions a fused step's run of decode rows attends over when its longest row needs ``needed``:
    ``needed`` rounded up to a multiple of ``RUN_SPAN_STEP``, at most ``max_seq_len``.  Closer than
    ``decode_span``'s powers of two (no CUDA graph holds a fused step): past a power of two, the cache read
    by a decode of long rows is up to half masked positions, which cost as much to read as the others."""
    return min(max_seq_len, -(-needed // RUN_SPAN_STEP) * RUN_SPAN_STEP)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of ``slots`` that name consecutive slots, ascending: ``(first, end)`` ranges of their indices, in
    order, together covering every index (``[3, 4, 5, 9, 2]`` -> ``[(0, 3), (3, 4), (4, 5)]``)."""
    runs: list[tuple[int, int]] = []
    first = 0
    for index in range(1, len(slots) + 1):
        if index == len(slots) or slots[index] != slots[index - 1] + 1:
            runs.append((first, index))
            first = index
    return runs


def _no_reduce(_: torch.Tensor) -> None:
    """The all-reduce of a one-rank group: nothing to add."""


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


def _host_values(values: torch.Tensor) -> list[int] | None:
    """The values of a host tensor, flattened; None for one on a device (reading it would wait for the device)."""
    return values.flatten().tolist() if values.device.type == "cpu" else None


def _check_in_range(name: str, values: list[int] | None, end: int) -> None:
    """Raise ValueError naming the first of ``values`` outside ``0 ..= end - 1`` (None: not checked)."""
    for index, value in enumerate(values or ()):
        if not 0 <= value < end:
            raise ValueError(f"{name}[{index}]={value} is out of range (0 ..= {end - 1})")


def _check_int(name: str, value: object, end: int) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.80}")
    if not 0 <= value < end:
        raise ValueError(f"{name}={value} is out of range (0 ..= {end - 1})")
    return value


class ShardedLm(nn.Module):
    """Rank ``rank`` of ``world_size`` of the decoder-only MoE transformer, with a KV cache of ``num_slots`` slots.

    Query heads, KV heads and experts are split over the ranks
    ([`LmConfig.shard`][metrale_model_engine.reference.LmConfig.shard]); embedding, norms, router and LM head are
    replicated.  Every call of [`forward`][metrale_model_engine.reference.ShardedLm.forward],
    [`prefill`][metrale_model_engine.reference.ShardedLm.prefill] and
    [`decode`][metrale_model_engine.reference.ShardedLm.decode] calls ``all_reduce`` exactly ``2 * n_layers`` times, in
    the same order on every rank, so the ranks must make the same calls with the same arguments.  Parameters start as
    zeros (norm gains as ones): a checkpoint's loader fills them
    ([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard]).

    The KV cache holds, per layer, ``kv_cache`` of shape
    ``[num_slots, max_seq_len, 2, kv_heads, head_dim]`` (keys, then values; a
    non-persistent buffer, so ``state_dict()`` is the weights alone).  It knows no
    sequence lengths: callers pass positions, and a slot's entries past the
    position attended to are ignored.

    No call reads a value of the device back to the host (with ``expert_routing``
    ``"device"``, the default off the CPU: ``experts``): index arguments are
    checked when they are host (CPU) tensors, and trusted when they already live on
    an accelerator (an index out of range there is a device-side assert).
    [`decode_step`][metrale_model_engine.reference.ShardedLm.decode_step] is the decode without any check, for callers
    that checked the host values they built the tensors from
    ([`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] does), and for CUDA graphs (``graphs``).

    Args:
        config: the model's shape.
        num_slots: the number of sequences the cache holds.
        rank: this rank, in ``0 ..= world_size - 1``.
        world_size: the group size; it must split the model
            ([`check_world`][metrale_model_engine.reference.check_world]). One rank is the plain model.
        all_reduce: in-place sum over the group; required when ``world_size > 1``.
            With one rank it may be given (it is then called as above) or not.
        dtype: of the weights, cache and activations (norms, rotations and routing
            weights are computed in at least float32).
        device: of the weights and cache; default torch's current default.
        expert_routing: how the picked experts run (``experts``); ``"auto"`` by default.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``num_slots < 1``, bad ``rank``/``world_size`` (see
            [`check_world`][metrale_model_engine.reference.check_world]), ``all_reduce`` is missing while ``world_size >
            1``, or an unknown ``expert_routing``.
    """

    lm_head: nn.Parameter | None

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
        expert_routing: ExpertRouting = "auto",
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
        self.shard: Shard = config.shard(rank, world_size)
        """What this rank holds."""
        self._all_reduce: AllReduce = _no_reduce if all_reduce is None else all_reduce
        self.embed: nn.Parameter = nn.Parameter(
            torch.zeros(config.vocab_size, config.d_model, dtype=dtype, device=device)
        )
        self.layers: nn.ModuleList = nn.ModuleList(
            ShardedBlock(
                ShardedAttention(config, self.shard, num_slots=num_slots, dtype=dtype, device=device),
                ShardedMoe(config, self.shard, routing=expert_routing, dtype=dtype, device=device),
                eps=config.norm_eps,
            )
            for _ in range(config.n_layers)
        )
        self.final_norm: nn.Parameter = nn.Parameter(torch.ones(config.d_model, dtype=dtype, device=device))
        self.lm_head = None  # tied: the embedding is the LM head
        if not config.tie_embeddings:
            self.lm_head = nn.Parameter(torch.zeros(config.vocab_size, config.d_model, dtype=dtype, device=device))
        self.rotary: RotaryTables = RotaryTables(
            config.head_dim, config.max_seq_len, config.rope_base, dtype=dtype, device=device
        )
        self.positions: torch.Tensor
        """``0 .. max_seq_len - 1`` on the model's device, non-persistent: the masks are cut from it."""
        self.register_buffer("positions", torch.arange(config.max_seq_len, device=device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The training path: logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]`` (int64) at positions ``0 .. T-1``.

        Causal attention within each row, no cache.  Differentiable when
        ``world_size == 1`` (the all-reduce is not autograd-aware).

        Raises:
            TypeError: ``tokens`` is not a 2-D int64 tensor.
            ValueError: ``tokens`` is empty, longer than ``max_seq_len``, or holds a token outside the vocabulary.
        """
        tokens = _check_int_tensor("tokens", tokens, 2)
        length = tokens.shape[1]
        if length > self.config.max_seq_len:
            raise ValueError(f"tokens has {length} positions, more than max_seq_len={self.config.max_seq_len}")
        _check_in_range("tokens.flatten()", _host_values(tokens), self.config.vocab_size)
        hidden = self._layers(self._embed(tokens), self.rotary.table[:length], attend_causal)
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
            ValueError: ``slot`` out of range, ``tokens`` empty or (a host tensor) outside
                the vocabulary, ``start < 0`` or ``start + len(tokens) > max_seq_len``.
        """
        _check_int("slot", slot, self.num_slots)
        tokens = _check_int_tensor("tokens", tokens, 1)
        _check_int("start", start, self.config.max_seq_len)
        end = start + tokens.shape[0]
        if end > self.config.max_seq_len:
            raise ValueError(
                f"start={start} + {tokens.shape[0]} tokens = {end} passes max_seq_len={self.config.max_seq_len}"
            )
        _check_in_range("tokens", _host_values(tokens), self.config.vocab_size)
        visible = self.positions[None, :end] <= self.positions[start:end, None]  # [L, end]: key q for query p
        attend = functools.partial(attend_prefill, slot, start, self._bias(visible))
        hidden = self._layers(self._embed(tokens), self.rotary.table[start:end], attend)
        return self._head(hidden[-1])

    @torch.no_grad()
    def decode(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of ``B`` sequences: row ``i`` feeds ``tokens[i]`` at ``positions[i]`` of ``slots[i]``.

        Each row writes its keys and values into its slot's cache and attends to
        positions ``0 ..= positions[i]`` of that slot only; rows do not influence each other.
        Host tensors have their values checked, then go to the model's device (see the class).

        Args:
            slots: 1-D int64 tensor of ``B`` distinct slot indices.
            tokens: 1-D int64 tensor of ``B`` tokens, one per slot.
            positions: 1-D int64 tensor of ``B`` positions, one per slot.

        Returns:
            The logits ``[B, vocab]``.

        Raises:
            TypeError: an argument is not a 1-D int64 tensor.
            ValueError: empty or unequal lengths, or in a host tensor a repeated slot, or a
                slot, token or position out of range.
        """
        slots = _check_int_tensor("slots", slots, 1)
        tokens = _check_int_tensor("tokens", tokens, 1)
        positions = _check_int_tensor("positions", positions, 1)
        if not slots.shape == tokens.shape == positions.shape:
            raise ValueError(
                f"slots, tokens and positions must have one length, got {slots.numel()}, "
                f"{tokens.numel()} and {positions.numel()}"
            )
        slot_values, position_values = _host_values(slots), _host_values(positions)
        _check_in_range("slots", slot_values, self.num_slots)
        _check_in_range("tokens", _host_values(tokens), self.config.vocab_size)
        _check_in_range("positions", position_values, self.config.max_seq_len)
        if slot_values is not None and len(set(slot_values)) != len(slot_values):
            raise ValueError(f"slots must be distinct, got {slot_values}")
        span = None if position_values is None else decode_span(max(position_values) + 1, self.config.max_seq_len)
        device = self.embed.device
        moved = (t.to(device, non_blocking=True) for t in (slots, tokens, positions))
        return self.decode_step(*moved, span=span)

    @torch.no_grad()
    def decode_step(
        self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, span: int | None = None
    ) -> torch.Tensor:
        """``decode`` without its checks: the arguments on the model's device, their values trusted.

        ``span``: the positions each row attends over, at least every ``positions[i] + 1``
        ([`decode_span`][metrale_model_engine.reference.decode_span]); ``None``: all of ``max_seq_len``.  Launches a
        fixed sequence of kernels for a given batch size and span, reads nothing back to the
        host (with device routing) and allocates only its own intermediates: a CUDA
        graph can hold it.
        """
        width = self.config.max_seq_len if span is None else span
        visible = (self.positions[None, :width] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, W]
        attend = functools.partial(attend_decode, slots, positions, self._bias(visible))
        hidden = self._layers(self._embed(tokens), self.rotary.table[positions], attend)
        return self._head(hidden)

    @torch.no_grad()
    def fused_step(
        self, chunks: Sequence[tuple[int, int, Sequence[int]]], rows: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Prefill chunks and decode rows of distinct slots in one forward: the single-device fused path.

        Each chunk ``(slot, start, tokens)`` is a [`prefill`][metrale_model_engine.reference.ShardedLm.prefill], each
        row ``(slot, token, position)`` a row of [`decode`][metrale_model_engine.reference.ShardedLm.decode]; the
        layers' weights are read once for all of them.  The rows attend run by run (``slot_runs``): a run of
        consecutive slots, ascending, reads their caches in place, over the positions its own longest row needs
        (``run_span``), never a copy of them.  Their values are trusted (the caller checked them, as
        [`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] does).

        Returns:
            The logits ``[len(rows) + len(chunks), vocab]``: the rows', then each chunk's after its last token.
        """
        tokens = [token for _, token, _ in rows]
        positions = [position for _, _, position in rows]
        for _, start, chunk in chunks:
            tokens.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
        inputs = torch.tensor([tokens, positions], dtype=torch.int64).to(self.embed.device, non_blocking=True)
        parts: list[tuple[Attend, int]] = []
        if rows:
            ids = [slot for slot, _, _ in rows]
            slots = torch.tensor(ids, dtype=torch.int64).to(self.embed.device)
            for first, end in slot_runs(ids):  # each run reads its slots' caches in place, over its own span
                span = run_span(max(positions[first:end]) + 1, self.config.max_seq_len)
                row_positions = inputs[1, first:end]
                visible = (self.positions[None, :span] <= row_positions[:, None])[:, None, None, :]
                run = slice(ids[first], ids[first] + end - first)
                attend = functools.partial(
                    attend_decode, slots[first:end], row_positions, self._bias(visible), consecutive=run
                )
                parts.append((attend, end - first))
        last = list(range(len(rows)))
        for slot, start, chunk in chunks:
            end = start + len(chunk)
            visible = self.positions[None, :end] <= self.positions[start:end, None]
            parts.append((functools.partial(attend_prefill, slot, start, self._bias(visible)), len(chunk)))
            last.append(last[-1] + len(chunk) if last else len(chunk) - 1)
        hidden = self._layers(
            self._embed(inputs[0]), self.rotary.table[inputs[1]], functools.partial(attend_split, parts)
        )
        return self._head(hidden[last])

    def blocks(self) -> Iterator[ShardedBlock]:
        """The layers, in order."""
        for block in self.layers:
            assert isinstance(block, ShardedBlock)
            yield block

    def _bias(self, visible: torch.Tensor) -> torch.Tensor:
        """``visible`` as the additive mask the attention kernels take, 0 or ``-inf``, made once for every layer
        (a boolean mask would be turned into it in each)."""
        return visible.to(self.embed.dtype).log()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.to(self.embed.device, non_blocking=True), self.embed)

    def _layers(self, x: torch.Tensor, factors: torch.Tensor, attend: Attend) -> torch.Tensor:
        for block in self.blocks():
            x = block(x, factors, attend, self._all_reduce)
        return x

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        return F.linear(rms_norm(hidden, self.final_norm, self.config.norm_eps), head)
