"""The pool of fixed-size KV blocks: reference counts, free blocks, and the prefix-cache index.

A block is free exactly when its reference count is zero. Free blocks come in two kinds:
plain ones (never full, or evicted) and cached ones, which keep their hash and KV so that a
later request can take them back. New blocks come from the plain ones first; only when none
is left is the least recently freed cached block evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .prefix_cache import BlockKey


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix-cache index
    key: BlockKey | None = None  # what the hash stands for; compared on every hit


@dataclass
class PoolEvents:
    blocks_allocated: int = 0  # blocks taken for new KV: the paged analogue of page faults
    evictions: int = 0  # cached free blocks whose KV was given up for a new allocation
    peak_in_use: int = 0  # most blocks in use at once


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the pool needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.plain_free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.cached: dict[int, Block] = {}  # block hash -> the block holding that KV
        self.events = PoolEvents()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take, cached ones included."""
        return len(self.plain_free) + len(self.cached_free)

    def allocate(self) -> Block:
        """A block for new KV with count one; the caller has checked that one is free."""
        if self.plain_free:
            block = self.blocks[self.plain_free.pop()]
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            self.events.evictions += 1
        block.ref_count = 1
        self.events.blocks_allocated += 1
        self._note_in_use()
        return block

    def take(self, block: Block) -> None:
        """One more reference to a block that is in use or cached free (a prefix hit, a fork)."""
        if block.ref_count == 0:
            del self.cached_free[block.block_id]
            self._note_in_use()
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference; at zero the block is free, and stays in the cache if it is indexed."""
        if block.ref_count < 1:
            raise RuntimeError(f"block {block.block_id} released more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.plain_free.append(block.block_id)
            else:
                self.cached_free[block.block_id] = None

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def index(self, block: Block, block_hash: int, key: BlockKey) -> None:
        """Put a full, computed block under block_hash; the caller checked the hash is unused."""
        block.block_hash = block_hash
        block.key = key
        self.cached[block_hash] = block

    def _note_in_use(self) -> None:
        self.events.peak_in_use = max(self.events.peak_in_use, self.num_blocks - self.num_free)

    def _uncache(self, block: Block) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        block.key = None
