"""The head's block manager: [`KvBlocks`][metrale_model_engine.reference.KvBlocks] decides which blocks of every
rank's KV cache hold which sequence.

Every rank's cache is one pool of ``num_blocks`` blocks of ``block_size`` positions
(``network.layers``).  A sequence's *block table* lists the blocks that hold its positions, in
order: position ``p`` lives at offset ``p % block_size`` of block ``table[p // block_size]``.
The head alone decides the tables; the commands that write KV carry the entries each
sequence gains (``rank.commands.words``), so every rank holds the same tables and no worker ever
allocates.

A block is held by the sequences whose tables list it (a reference count); a block no
sequence holds is free.  Free blocks are handed out least recently freed first, and a
sequence's blocks are freed last block first, so the ends of sequences are reused before
their beginnings.

Prefix caching: a full block is keyed by its tokens and the hash of the key of the block
before it, the first block's by the model's identity: a chain, so that a key stands for
the whole prefix up to its block.  A freed block keeps its contents and its key until it is
handed out again, so a later sequence whose tokens begin with the same blocks shares them
(found by ``prefix``, taken by ``reserve``) and computes only the rest.  A key is found by
its tokens compared one by one (a dict's equality, not a hash alone); the blocks before it,
by their chain's 64-bit hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

Key = tuple[int, tuple[int, ...]]
"""A full block's key: the chain hash of the blocks before it (the identity for the first), and its tokens."""


@dataclass
class _Held:
    """What one slot holds on the head."""

    blocks: list[int] = field(default_factory=list)
    """Its block table as the head decided it: the entries the workers have, and any reserved ahead."""
    cached: int = 0
    """The leading tokens its reservation found in cached blocks (a multiple of the block size)."""
    chain: list[int] = field(default_factory=list)
    """The chain hash of each of its first full blocks, as far as they are registered."""


class KvBlocks:
    """The head's block manager over a pool of ``num_blocks`` blocks of ``block_size`` tokens (see the module).

    Args:
        num_blocks: the blocks every rank's cache holds.
        block_size: the positions of a block.
        identity: the model's identity, the first link of every key's chain.

    Attributes:
        hit_tokens: prompt tokens that reservations found cached, so far.
        query_tokens: prompt tokens that reservations looked up, so far.
        peak_used: the most blocks held at once, so far.
    """

    def __init__(self, num_blocks: int, block_size: int, identity: int = 0) -> None:
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.hit_tokens: int = 0
        self.query_tokens: int = 0
        self.peak_used: int = 0
        self._identity = identity
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self._key_of: dict[int, Key] = {}  # a cached block's key
        self._cached: dict[Key, int] = {}  # the block that holds a key
        self._held: dict[int, _Held] = {}  # by slot

    @property
    def free(self) -> int:
        """Blocks no sequence holds (cached or not)."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """The blocks ``tokens`` positions take."""
        return -(-tokens // self.block_size)

    def held(self, seq_id: int) -> list[int]:
        """Slot ``seq_id``'s blocks as the head decided them (a copy; empty for a slot that holds none)."""
        held = self._held.get(seq_id)
        return [] if held is None else list(held.blocks)

    def cached(self, seq_id: int) -> int:
        """The leading tokens of slot ``seq_id``'s reservation found cached (0 without one)."""
        held = self._held.get(seq_id)
        return 0 if held is None else held.cached

    def prefix(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks that hold the longest prefix of ``tokens`` in whole blocks, leaving at least one token
        to compute (whose logits pick the next one)."""
        found: list[int] = []
        parent = self._identity
        size = self.block_size
        for index in range((len(tokens) - 1) // size):
            key = (parent, tuple(tokens[index * size : (index + 1) * size]))
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
            parent = hash(key)
        return found

    def reserve(self, seq_id: int, tokens: Sequence[int], *, share: bool = True, spare: int = 0) -> int | None:
        """Hold the blocks of ``tokens`` for slot ``seq_id`` (what it held is released first): with ``share``, its
        cached prefix (``prefix``) shared, and the rest allocated.

        Returns the leading tokens found cached; ``None``, changing nothing, when fewer than the blocks it needs
        and ``spare`` more are free.
        """
        hits = self.prefix(tokens) if share else []
        fresh = self.blocks_for(len(tokens)) - len(hits)
        if fresh + spare > self.free - sum(1 for block in hits if not self._refs[block]):
            return None
        self.release(seq_id)
        if share:
            self.query_tokens += len(tokens)
            self.hit_tokens += len(hits) * self.block_size
        chain: list[int] = []
        for block in hits:
            self._take(block)
            chain.append(hash(self._key_of[block]))
        self._held[seq_id] = _Held(hits + self._allocate(fresh), len(hits) * self.block_size, chain)
        return len(hits) * self.block_size

    def table(self, seq_id: int, count: int) -> list[int]:
        """Slot ``seq_id``'s first ``count`` blocks, allocating those it does not hold yet.

        Raises:
            RuntimeError: fewer blocks are free than it lacks (nothing changes).
        """
        held = self._held.setdefault(seq_id, _Held())
        lacking = count - len(held.blocks)
        if lacking > self.free:
            raise RuntimeError(
                f"slot {seq_id} needs {lacking} more KV block(s) of {self.block_size} tokens, but {self.free} of the "
                f"{self.num_blocks} are free: free a sequence first (a Server preempts one)"
            )
        if lacking > 0:
            held.blocks.extend(self._allocate(lacking))
        return held.blocks[:count]

    def filled(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Slot ``seq_id``'s cache now holds ``tokens``: key its blocks that are full and not keyed yet (a key
        held by another block already stays with that one)."""
        held = self._held.get(seq_id)
        if held is None:
            return
        size = self.block_size
        for index in range(len(held.chain), min(len(tokens) // size, len(held.blocks))):
            key = (held.chain[-1] if held.chain else self._identity, tuple(tokens[index * size : (index + 1) * size]))
            block = held.blocks[index]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
            held.chain.append(hash(key))

    def release(self, seq_id: int) -> None:
        """Slot ``seq_id`` holds no block any more: each of its blocks that no other sequence holds is free, its
        contents kept for a later prefix (its last block the first to be reused)."""
        held = self._held.pop(seq_id, None)
        for block in reversed(held.blocks if held is not None else ()):
            self._refs[block] -= 1
            if not self._refs[block]:
                self._free[block] = None

    def clear(self) -> None:
        """Every rank's cache was made again, empty (the link re-formed over the ranks left): every block free, none
        held or cached.  The counts (``hit_tokens``, ``query_tokens``, ``peak_used``) are kept."""
        self._refs = [0] * self.num_blocks
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._key_of.clear()
        self._cached.clear()
        self._held.clear()

    def _take(self, block: int) -> None:
        if not self._refs[block]:
            del self._free[block]
        self._refs[block] += 1
        self.peak_used = max(self.peak_used, self.used)

    def _allocate(self, count: int) -> list[int]:
        """``count`` free blocks, least recently freed first; what they held is forgotten."""
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._cached[key]
            self._refs[block] = 1
            blocks.append(block)
        self.peak_used = max(self.peak_used, self.used)
        return blocks
