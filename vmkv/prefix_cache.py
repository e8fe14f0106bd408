"""Automatic prefix caching's policy, shared by the layouts that have one: the hash chain that
indexes full blocks, and the exact key that every hit is checked against.

A block is the layout's unit of sharing, a fixed number of whole tokens: paged's block, or
vattention's chunk (the fewest pages that end on a token boundary). How a layout holds the
blocks' memory (block tables, or pages mapped into virtual ranges) is its own mechanism.

The hash (parent block's hash, the block's token ids, the cache identity on the first block)
only finds a candidate. What a block's KV really depends on is every token before it and its
own, under one model and one tenant; `BlockKey` records exactly that as a chain of keys, so a
hit is accepted only if the candidate's whole prefix equals ours. A hash collision, however it
comes about, can never hand one sequence another's KV; it only costs a miss.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# model id and per-request cache salt: blocks of different identities never match
CacheIdentity = tuple[str, str | None]


def hash_block(parent_hash: int | None, token_ids: Sequence[int], identity: CacheIdentity | None) -> int:
    """64-bit hash of one full block; `identity` is given for the first block only, the
    following blocks inherit it through the parent hash (as in vLLM's extra keys)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if identity is not None:
        h.update(repr(identity).encode())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(
    token_ids: Sequence[int], block_size: int, identity: CacheIdentity, parent: int | None, first_block: int
) -> list[int]:
    """Hashes of the full blocks first_block, first_block+1, ... of token_ids, chained from
    `parent` (the hash of block first_block-1, None when first_block is 0)."""
    hashes = []
    for i in range(first_block, len(token_ids) // block_size):
        parent = hash_block(
            parent, token_ids[i * block_size : (i + 1) * block_size], identity if i == 0 else None
        )
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, eq=False)
class BlockKey:
    """Everything a full block's KV depends on: its tokens, its parent's key, the identity.

    Keys are shared objects: a sequence that hits a cached block adopts that block's key, so
    comparisons usually stop at the first parent (`is`), and a deep walk happens only when
    two equal prefixes were computed independently.
    """

    parent: BlockKey | None
    token_ids: tuple[int, ...]
    identity: CacheIdentity

    def matches(self, parent: BlockKey | None, token_ids: Sequence[int], identity: CacheIdentity) -> bool:
        """Whether this key names the block (parent, token_ids, identity), comparing whole prefixes."""
        if self.identity != identity or self.token_ids != tuple(token_ids):
            return False
        a, b = self.parent, parent
        while a is not b:
            if a is None or b is None or a.token_ids != b.token_ids or a.identity != b.identity:
                return False
            a, b = a.parent, b.parent
        return True
