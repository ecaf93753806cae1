"""The reference model on one rank: ``ShardedLm``, a shard (see ``config``) of the whole transformer.

Its weights come from a checkpoint in the Hugging Face layout
([`metrale_model_engine.reference.checkpoint`][metrale_model_engine.reference.checkpoint]), each rank reading its own
part.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LmConfig, Shard, check_world
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
    cache_rows,
    rms_norm,
    span_groups,
)

Table = Sequence[int]
"""A block table: the cache blocks that hold a sequence's positions, in order (see ``layers``)."""


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


def decode_span(needed: int, max_seq_len: int) -> int:
    """The positions a decode step attends over when its longest row needs ``needed``: a power of two,
    at least 16, at most ``max_seq_len``; so that the cache read grows with the sequences, in few shapes."""
    return min(max_seq_len, max(16, 1 << (needed - 1).bit_length()))


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
    """Rank ``rank`` of ``world_size`` of the decoder-only MoE transformer, with a KV cache of ``num_blocks`` blocks.

    Query heads, KV heads and experts are split over the ranks
    ([`LmConfig.shard`][metrale_model_engine.reference.LmConfig.shard]); embedding, norms, router and LM head are
    replicated.  Every call of [`forward`][metrale_model_engine.reference.ShardedLm.forward],
    [`prefill`][metrale_model_engine.reference.ShardedLm.prefill] and
    [`decode`][metrale_model_engine.reference.ShardedLm.decode] calls ``all_reduce`` exactly ``2 * n_layers`` times, in
    the same order on every rank, so the ranks must make the same calls with the same arguments.  Parameters start as
    zeros (norm gains as ones): a checkpoint's loader fills them
    ([`load_shard`][metrale_model_engine.reference.checkpoint.load_shard]).

    The KV cache is a pool: per layer, ``kv_cache`` of shape
    ``[num_blocks, block_size, 2, kv_heads, head_dim]`` (keys, then values; a
    non-persistent buffer, so ``state_dict()`` is the weights alone).  It knows no
    sequences: each call passes the *block table* of each sequence it feeds, the blocks
    that hold its positions in order (position ``p`` at offset ``p % block_size`` of block
    ``table[p // block_size]``), and the positions; a table's entries past the positions
    attended to are ignored.  Who holds which block is the caller's to decide
    ([`KvBlocks`][metrale_model_engine.reference.KvBlocks] on the head of a served model).

    No call reads a value of the device back to the host (with ``expert_routing``
    ``"device"``, the default off the CPU: ``experts``): index arguments are
    checked when they are host (CPU) tensors, and trusted when they already live on
    an accelerator (an index out of range there is a device-side assert).
    [`decode_step`][metrale_model_engine.reference.ShardedLm.decode_step] is the decode without any check, for callers
    that checked the host values they built the tensors from
    ([`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] does), and for CUDA graphs (``graphs``).

    Args:
        config: the model's shape.
        num_blocks: the blocks of the KV cache.
        block_size: the positions of a block; default 16.
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
        ValueError: ``num_blocks < 1`` or ``block_size < 1``, bad ``rank``/``world_size`` (see
            [`check_world`][metrale_model_engine.reference.check_world]), ``all_reduce`` is missing while ``world_size >
            1``, or an unknown ``expert_routing``.
    """

    lm_head: nn.Parameter | None

    def __init__(
        self,
        config: LmConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
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
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        check_world(config, rank, world_size)
        if all_reduce is None and world_size > 1:
            raise ValueError(f"all_reduce is required when world_size={world_size} > 1 (it sums over the ranks)")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
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
                ShardedAttention(
                    config, self.shard, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device
                ),
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
        self.offsets: torch.Tensor
        """``0 .. block_size - 1`` on the model's device, non-persistent: a block's cache rows are cut from it."""
        self.register_buffer("offsets", torch.arange(block_size, device=device), persistent=False)

    @property
    def blocks_per_sequence(self) -> int:
        """The blocks a sequence of ``max_seq_len`` positions takes: the longest table a call needs."""
        return -(-self.config.max_seq_len // self.block_size)

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
    def prefill(self, table: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed a chunk of a sequence: ``tokens`` (1-D int64) at positions ``start .. start + len - 1`` of the
        sequence whose block table is ``table`` (1-D int64).

        Writes the chunk's keys and values into the table's blocks; each position ``p``
        attends to positions ``0 ..= p`` of the sequence, earlier chunks included.

        Returns:
            The logits ``[vocab]`` after the chunk's last token.

        Raises:
            TypeError: a wrong argument type.
            ValueError: ``tokens`` or ``table`` empty, or (host tensors) a token outside the vocabulary, a block
                out of range or named twice; ``start < 0``, ``start + len(tokens) > max_seq_len``, or past the
                positions the table's blocks hold.
        """
        table = _check_int_tensor("table", table, 1)
        tokens = _check_int_tensor("tokens", tokens, 1)
        _check_int("start", start, self.config.max_seq_len)
        end = start + tokens.shape[0]
        if end > self.config.max_seq_len:
            raise ValueError(
                f"start={start} + {tokens.shape[0]} tokens = {end} passes max_seq_len={self.config.max_seq_len}"
            )
        if end > table.shape[0] * self.block_size:
            raise ValueError(
                f"the table's {table.shape[0]} block(s) of {self.block_size} hold {table.shape[0] * self.block_size} "
                f"positions, fewer than the chunk's end {end}"
            )
        blocks = _host_values(table)
        _check_in_range("table", blocks, self.num_blocks)
        if blocks is not None and len(set(blocks)) != len(blocks):
            raise ValueError(f"a table names each block once, got {blocks}")
        _check_in_range("tokens", _host_values(tokens), self.config.vocab_size)
        attend = self._prefill_attend(table.to(self.embed.device, non_blocking=True), start, end)
        hidden = self._layers(self._embed(tokens), self.rotary.table[start:end], attend)
        return self._head(hidden[-1])

    @torch.no_grad()
    def decode(self, tables: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of ``B`` sequences: row ``i`` feeds ``tokens[i]`` at ``positions[i]`` of the sequence whose block
        table is ``tables[i]``.

        Each row writes its keys and values into its table's blocks and attends to
        positions ``0 ..= positions[i]`` of its sequence only; rows do not influence each other.
        Host tensors have their values checked, then go to the model's device (see the class).

        Args:
            tables: 2-D int64 tensor ``[B, n]``: each row's block table (entries past its
                positions ignored, but in range).
            tokens: 1-D int64 tensor of ``B`` tokens, one per row.
            positions: 1-D int64 tensor of ``B`` positions, one per row, each within its table's ``n`` blocks.

        Returns:
            The logits ``[B, vocab]``.

        Raises:
            TypeError: ``tables`` is not a 2-D, or ``tokens`` or ``positions`` not a 1-D, int64 tensor.
            ValueError: empty or unequal lengths, or in a host tensor a block, token or position out of range,
                or two rows that write one place of the cache.
        """
        tables = _check_int_tensor("tables", tables, 2)
        tokens = _check_int_tensor("tokens", tokens, 1)
        positions = _check_int_tensor("positions", positions, 1)
        if not tables.shape[0] == tokens.shape[0] == positions.shape[0]:
            raise ValueError(
                f"tables, tokens and positions must have one length, got {tables.shape[0]}, "
                f"{tokens.numel()} and {positions.numel()}"
            )
        held = tables.shape[1] * self.block_size
        table_values, position_values = _host_values(tables), _host_values(positions)
        _check_in_range("tables.flatten()", table_values, self.num_blocks)
        _check_in_range("tokens", _host_values(tokens), self.config.vocab_size)
        _check_in_range("positions", position_values, min(held, self.config.max_seq_len))
        if table_values is not None and position_values is not None:
            width = tables.shape[1]
            written = [table_values[row * width + p // self.block_size] * self.block_size + p % self.block_size
                       for row, p in enumerate(position_values)]  # fmt: skip
            if len(set(written)) != len(written):
                raise ValueError(f"two rows write one cache row: {written} (block * block_size + offset)")
        span = None
        if position_values is not None:
            span = min(held, decode_span(max(position_values) + 1, self.config.max_seq_len))
        device = self.embed.device
        moved = (t.to(device, non_blocking=True) for t in (tables, tokens, positions))
        return self.decode_step(*moved, span=span)

    @torch.no_grad()
    def decode_step(
        self, tables: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, span: int | None = None
    ) -> torch.Tensor:
        """``decode`` without its checks: the arguments on the model's device, their values trusted.

        ``span``: the positions each row attends over, at least every ``positions[i] + 1``
        ([`decode_span`][metrale_model_engine.reference.decode_span]) and at most what the
        tables' blocks hold; ``None``: all of these (``tables.shape[1] * block_size``, at most
        ``max_seq_len``).  Only the first ``ceil(span / block_size)`` columns of ``tables`` are read.
        Launches a fixed sequence of kernels for a given batch size and span, reads nothing back
        to the host (with device routing) and allocates only its own intermediates: a CUDA graph can hold it.
        """
        width = min(tables.shape[1] * self.block_size, self.config.max_seq_len) if span is None else span
        read = cache_rows(self.offsets, tables, width)  # [B, W]
        written = read.gather(1, positions[:, None])[:, 0]  # each row's own position: no read back
        visible = (self.positions[None, :width] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, W]
        attend = functools.partial(attend_decode, written, read, self._bias(visible))
        hidden = self._layers(self._embed(tokens), self.rotary.table[positions], attend)
        return self._head(hidden)

    @torch.no_grad()
    def fused_step(self, chunks: Sequence[tuple[Table, int, Sequence[int]]], rows: Sequence[tuple[Table, int, int]]
                   ) -> torch.Tensor:  # fmt: skip
        """Prefill chunks and decode rows of distinct sequences in one forward: the single-device fused path.

        Each chunk ``(table, start, tokens)`` is a [`prefill`][metrale_model_engine.reference.ShardedLm.prefill], each
        row ``(table, token, position)`` a row of [`decode`][metrale_model_engine.reference.ShardedLm.decode], the
        tables as lists of block ids; the layers' weights are read once for all of them.  The rows attend longest
        first, in groups of like lengths (``span_groups``), each group gathering its rows' blocks over the positions
        its own longest row needs: no row's gather padded to the longest row of the step.  Their values are trusted
        (the caller checked them, as [`ReferenceLm`][metrale_model_engine.reference.ReferenceLm] does).

        Returns:
            The logits ``[len(rows) + len(chunks), vocab]``: the rows', then each chunk's after its last token.
        """
        order = sorted(range(len(rows)), key=lambda row: -rows[row][2])  # longest first
        ordered = [rows[row] for row in order]
        tokens = [token for _, token, _ in ordered]
        positions = [position for _, _, position in ordered]
        for _, start, chunk in chunks:
            tokens.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
        groups = span_groups([position + 1 for position in positions[: len(rows)]], self.block_size,
                             self.config.max_seq_len)  # fmt: skip
        flat = [*tokens, *positions]  # everything the device needs, in one copy
        for first, end, span in groups:
            columns = -(-span // self.block_size)  # of each row's table
            for table, _, _ in ordered[first:end]:
                flat.extend([*table[:columns], *[0] * (columns - len(table))])
        for table, start, chunk in chunks:
            flat.extend(table[: -(-(start + len(chunk)) // self.block_size)])
        inputs = torch.tensor(flat, dtype=torch.int64).to(self.embed.device, non_blocking=True)
        count = len(tokens)
        at = 2 * count
        parts: list[tuple[Attend, int]] = []
        for first, end, span in groups:
            columns = -(-span // self.block_size)
            row_positions = inputs[count + first : count + end]
            read = cache_rows(self.offsets, inputs[at : at + (end - first) * columns].view(end - first, columns), span)
            at += (end - first) * columns
            visible = (self.positions[None, :span] <= row_positions[:, None])[:, None, None, :]
            written = read.gather(1, row_positions[:, None])[:, 0]
            parts.append((functools.partial(attend_decode, written, read, self._bias(visible)), end - first))
        last = [0] * len(rows)
        for place, row in enumerate(order):  # each row's logits where the caller put it
            last[row] = place
        place = len(rows) - 1
        for _, start, chunk in chunks:
            end = start + len(chunk)
            blocks = -(-end // self.block_size)
            parts.append((self._prefill_attend(inputs[at : at + blocks], start, end), len(chunk)))
            at += blocks
            place += len(chunk)
            last.append(place)
        hidden = self._layers(
            self._embed(inputs[:count]), self.rotary.table[inputs[count : 2 * count]],
            functools.partial(attend_split, parts),
        )  # fmt: skip
        return self._head(hidden[last])

    def blocks(self) -> Iterator[ShardedBlock]:
        """The layers, in order."""
        for block in self.layers:
            assert isinstance(block, ShardedBlock)
            yield block

    def _prefill_attend(self, table: torch.Tensor, start: int, end: int) -> Attend:
        """The ``Attend`` of a chunk at positions ``start .. end - 1`` of the sequence of block table ``table``
        (1-D, on the model's device)."""
        read = cache_rows(self.offsets, table[None], end)[0]
        visible = self.positions[None, :end] <= self.positions[start:end, None]  # [L, end]: key q for query p
        return functools.partial(attend_prefill, read[start:], read, self._bias(visible))

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
