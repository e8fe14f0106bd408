"""Per-sequence state of the paged layout: its tokens, block table and prefix-cache chain."""

from __future__ import annotations

from dataclasses import dataclass, field

from .prefix_cache import BlockKey, CacheIdentity
from .swap import SwappedBlocks


@dataclass
class PagedSequence:
    seq_id: int
    token_ids: list[int]
    identity: CacheIdentity
    block_table: list[int] = field(default_factory=list)  # logical block i -> physical block id
    num_computed: int = 0  # leading tokens whose KV is written in every layer
    block_hashes: list[int] = field(default_factory=list)  # hash of every full block (prefix caching)
    block_keys: list[BlockKey] = field(default_factory=list)  # key of every full, computed block
    swapped: SwappedBlocks | None = None  # where the KV is while swapped out

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def copy(self, seq_id: int) -> PagedSequence:
        """A fork: same tokens and blocks (the caller takes the block references)."""
        return PagedSequence(
            seq_id,
            list(self.token_ids),
            self.identity,
            list(self.block_table),
            self.num_computed,
            list(self.block_hashes),
            list(self.block_keys),
        )
