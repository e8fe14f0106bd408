"""The pool of fixed-size KV blocks: reference counts, free blocks, and the prefix-cache index.

A block is free exactly when its reference count is zero. Free blocks come in two kinds:
plain ones (never full, or evicted) and cached ones, which keep their hash and KV so that a
later request can take them back. New blocks come from the plain ones first; only when none
is left is the least recently freed cached block evicted.

Placement: a sequence's next block is the one after its last where that is free, and a
sequence that cannot continue (a new one, or one whose neighbour is taken) starts in the
middle of the longest run of free blocks, leaving the first half to whoever ends before it.
So a sequence's K/V mostly lies in runs of consecutive blocks, which the decode kernel reads
faster: 0.83-0.87 ms per layer against 0.94-1.01 ms with the blocks scattered (batch 64 x 320
tokens, SmolLM2's shape, bf16, benchmarks/bench_kernels.py), 4.3-4.5 against 5.5-5.7 ms at
2,048 tokens. Reusing the most recently freed block instead scatters every table once requests
come and go (docs/paging.md).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

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
        # plain free blocks as an ordered set (popitem() gives the most recently freed, low ids
        # first at the start), and the same as a mask for finding runs
        self.plain_free: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self._plain_mask = np.ones(num_blocks, dtype=bool)
        self.keep_runs = True  # placement above; scatter() turns it off
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

    def allocate(self, after: int | None = None) -> Block:
        """A block for new KV with count one, placed to follow block `after` (the sequence's
        last, if it has one); the caller has checked that one is free."""
        if self.plain_free:
            block_id = self._place(after)
            del self.plain_free[block_id]
            self._plain_mask[block_id] = False
            block = self.blocks[block_id]
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            self.events.evictions += 1
        block.ref_count = 1
        self.events.blocks_allocated += 1
        self._note_in_use()
        return block

    def allocate_run(self, count: int, after: int | None = None) -> list[Block]:
        """count blocks for new KV, each placed to follow the one before it (the first to follow
        `after`); the caller has checked that they are free."""
        blocks: list[Block] = []
        for _ in range(count):
            blocks.append(self.allocate(blocks[-1].block_id if blocks else after))
        return blocks

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
                self.plain_free[block.block_id] = None
                self._plain_mask[block.block_id] = True
            else:
                self.cached_free[block.block_id] = None

    def scatter(self, seed: int) -> None:
        """Hand plain free blocks out in a random order from now on, as a pool does after a long
        run without run-keeping: tests use it to exercise block tables with no two blocks in a
        row, benchmarks to measure that case."""
        order = list(self.plain_free)
        random.Random(seed).shuffle(order)
        self.plain_free = dict.fromkeys(order)
        self.keep_runs = False

    def _place(self, after: int | None) -> int:
        if not self.keep_runs:
            return next(reversed(self.plain_free))
        if after is not None and after + 1 < self.num_blocks and self._plain_mask[after + 1]:
            return after + 1
        edges = np.flatnonzero(np.diff(self._plain_mask, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]  # runs of plain free blocks: [start, end)
        longest = int(np.argmax(ends - starts))
        start, end = int(starts[longest]), int(ends[longest])
        return start if start == 0 else start + (end - start) // 2

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def index(self, block: Block, block_hash: int, key: BlockKey) -> None:
        """Put a full, computed block under block_hash; the caller checked the hash is unused."""
        block.block_hash = block_hash
        block.key = key
        self.cached[block_hash] = block

    def forget_cached(self) -> int:
        """Empty the prefix-cache index: cached free blocks become plain free ones, blocks in use
        keep their KV but lose their hash (freed, they are plain). Returns the blocks it held."""
        forgotten = len(self.cached)
        for block in list(self.cached.values()):
            if block.ref_count == 0:
                del self.cached_free[block.block_id]
                self.plain_free[block.block_id] = None
                self._plain_mask[block.block_id] = True
            self._uncache(block)
        return forgotten

    def _note_in_use(self) -> None:
        self.events.peak_in_use = max(self.events.peak_in_use, self.num_blocks - self.num_free)

    def _uncache(self, block: Block) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        block.key = None
