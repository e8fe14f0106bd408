"""Automatic prefix caching for vattention: cached chunks of page sets, found by the shared
hash chain (vmkv/prefix_cache.py) and verified against token ids, evicted least recently used.

The mechanism differs from paged's: a hit maps the cached chunk's physical pages into the new
sequence's own virtual range, so stock kernels read shared KV as one contiguous tensor.

In the per-layer orders a chunk is the fewest pages per column that end on a token boundary, so
no token of a cached chunk spills into a page the next sequence writes: head-major pages hold
whole tokens (one page per chunk); token-major ones may end mid-token (SmolLM2: 384 B tokens in
64 KiB pages, a chunk is 3 pages = 512 tokens). A packed token is every layer's K and V (SmolLM2:
23,040 B), so a chunk ending on a token boundary would be 45 pages (2,048 tokens at 64 KiB, 4,096
at 2 MiB) and almost never hit; there a chunk is the fewest pages holding CHUNK_MIN_TOKENS, and
may end mid-token. Its key then covers every token with a byte in its pages (the straddling one
included), a hit reuses only the tokens wholly inside, and the hit's last page, where the
straddling token is rewritten, gets a private copy first (copy-on-write, sharing.py).
Invariants, under the cache's lock:
- the index holds one reference on each set of each chunk it holds, and a set in one chunk only,
  so pool.refcount[s] is the number of slots mapping s plus one while s is indexed;
- only chunks wholly below a sequence's written tokens are indexed, and a sequence only ever
  writes at or beyond its written tokens, so a cached page is never written;
- a chunk is evictable when the index is the only holder of at least one of its sets: a hit
  that copied its last page on write leaves the chunk's first sets mapped by the sequence and
  its last set held by the index alone. Evicting such a chunk frees that set and leaves the
  sequence's mappings as they are. The cache counts every set no slot maps as available
  (SlotTable.available), so reclaiming must be able to free each of them.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vmkv import prefix_cache
from vmkv.prefix_cache import BlockKey, CacheIdentity
from vmkv.vattention.geometry import SlotGeometry
from vmkv.vattention.pool import PageSetPool

CHUNK_MIN_TOKENS = 16  # packed chunks: paged mode's default block size


def chunk_pages(geometry: SlotGeometry) -> int:
    """Pages per column of one chunk: the fewest that end on a token boundary, or in the packed
    order the fewest holding CHUNK_MIN_TOKENS when that is fewer."""
    aligned = math.lcm(geometry.page_size, geometry.column_token_bytes) // geometry.page_size
    if geometry.order != "packed":
        return aligned
    return min(aligned, geometry.pages_for(CHUNK_MIN_TOKENS))


@dataclass(eq=False)
class CachedChunk:
    block_hash: int
    key: BlockKey  # what the hash stands for; compared on every hit
    sets: list[int]  # the chunk's page sets, in page order
    last_used: float  # monotonic seconds; also the idle clock of issue-15 trimming


@dataclass
class PrefixEvents:
    """Event counts (KVStats fields of the same names)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which were mapped from the cache
    prefix_cache_evictions: int = 0  # chunks given up
    hash_collisions: int = 0  # equal hash, different prefix: detected, never shared


class PrefixIndex:
    """Cached chunks by hash, least recently used first."""

    def __init__(self, geometry: SlotGeometry, pool: PageSetPool) -> None:
        self.pool = pool
        self.pages = chunk_pages(geometry)
        self._chunk_bytes = self.pages * geometry.page_size
        self._token_bytes = geometry.column_token_bytes
        self.chunks: OrderedDict[int, CachedChunk] = OrderedDict()
        self.events = PrefixEvents()

    def end(self, i: int) -> int:
        """Tokens with a byte in chunks 0..i: chunk i's key covers tokens end(i-1)..end(i)-1."""
        return -(-(i + 1) * self._chunk_bytes // self._token_bytes) if i >= 0 else 0

    def whole(self, n: int) -> int:
        """Tokens lying wholly in the first n chunks: what a hit on them saves computing."""
        return n * self._chunk_bytes // self._token_bytes

    def hashes(self, token_ids: Sequence[int], identity: CacheIdentity, known: list[int]) -> list[int]:
        """The chunk hashes of token_ids, extending those already `known` for its first chunks."""
        out = list(known)
        i = len(out)
        while self.end(i) <= len(token_ids):
            chunk = token_ids[self.end(i - 1) : self.end(i)]
            out.append(prefix_cache.hash_block(out[-1] if out else None, chunk, identity if i == 0 else None))
            i += 1
        return out

    def match(
        self, token_ids: Sequence[int], hashes: list[int], identity: CacheIdentity
    ) -> list[CachedChunk]:
        """The cached chunks holding the longest prefix of token_ids, each verified by its key."""
        hits: list[CachedChunk] = []
        parent: BlockKey | None = None
        for i, block_hash in enumerate(hashes):
            chunk = self.chunks.get(block_hash)
            if chunk is None:
                break
            if not chunk.key.matches(parent, token_ids[self.end(i - 1) : self.end(i)], identity):
                self.events.hash_collisions += 1
                break
            hits.append(chunk)
            parent = chunk.key
        return hits

    def add(
        self,
        token_ids: Sequence[int],
        hashes: list[int],
        keys: list[BlockKey],
        sets: list[int],
        written: int,
        identity: CacheIdentity,
    ) -> None:
        """Index a sequence's chunks that are now wholly written (keys: its chunks so far).

        A chunk another sequence computed the same already is not indexed twice: the sequence
        adopts that key (its own pages stay private). A collision is counted and skipped.
        """
        now = time.monotonic()
        i = len(keys)
        while i < len(hashes) and self.end(i) <= written:  # every byte of the chunk's pages written
            parent = keys[-1] if keys else None
            tokens = tuple(token_ids[self.end(i - 1) : self.end(i)])
            cached = self.chunks.get(hashes[i])
            if cached is None:
                key = BlockKey(parent, tokens, identity)
                chunk_sets = sets[i * self.pages : (i + 1) * self.pages]
                for s in chunk_sets:
                    self.pool.share(s, index=True)
                self.chunks[hashes[i]] = CachedChunk(hashes[i], key, chunk_sets, now)
            elif cached.key.matches(parent, tokens, identity):
                key = cached.key
            else:
                self.events.hash_collisions += 1
                key = BlockKey(parent, tokens, identity)
            keys.append(key)
            i += 1

    def forget_after(self, num_tokens: int, hashes: list[int], keys: list[BlockKey], sets: list[int]) -> None:
        """A sequence keeps only its first num_tokens tokens (a speculative step's rejected
        draft): drop its chunk hashes and keys past them, and un-index the chunks it indexed from
        its own pages (`sets`, its slot's) that hold a dropped token: it writes them again. A
        chunk indexed from another sequence's pages stays."""
        kept = 0
        while kept < len(hashes) and self.end(kept) <= num_tokens:
            kept += 1
        for i in range(kept, len(keys)):
            chunk = self.chunks.get(hashes[i])
            own = sets[i * self.pages : (i + 1) * self.pages]
            if chunk is not None and chunk.key is keys[i] and chunk.sets == own:
                del self.chunks[hashes[i]]
                for s in chunk.sets:
                    self.pool.release(s, index=True)
        del hashes[kept:]
        del keys[kept:]

    def touch(self, chunks: Sequence[CachedChunk]) -> None:
        """Mark chunks used now, the last one least recent: eviction then gives up a prefix's
        tail before its head, which more requests share."""
        now = time.monotonic()
        for chunk in reversed(chunks):
            chunk.last_used = now
            if self.chunks.get(chunk.block_hash) is chunk:  # a placement's own reclaim may evict a hit
                self.chunks.move_to_end(chunk.block_hash)

    def held_by(self, hashes: Sequence[int], keys: Sequence[BlockKey]) -> list[CachedChunk]:
        """The indexed chunks whose key a sequence holds (it computed or hit them)."""
        out = []
        for block_hash, key in zip(hashes, keys, strict=False):
            chunk = self.chunks.get(block_hash)
            if chunk is not None and chunk.key is key:
                out.append(chunk)
        return out

    def still_indexed(self, hashes: Sequence[int], keys: Sequence[BlockKey]) -> int:
        """How many of a sequence's leading chunk keys the index still holds; a swapped-in
        sequence keeps only those, so finish_step indexes the rest again from its own pages."""
        n = 0
        for block_hash, key in zip(hashes, keys, strict=False):
            chunk = self.chunks.get(block_hash)
            if chunk is None or chunk.key is not key:
                break
            n += 1
        return n

    def evictable(self, chunk: CachedChunk) -> bool:
        """Whether evicting the chunk frees a set (see the invariants above)."""
        return any(self.pool.refcount[s] == 1 for s in chunk.sets)

    def evictable_sets(self) -> int:
        """Sets that evicting every evictable chunk would free."""
        return self.pool.index_only

    def evict(self, n: int, idle_before: float | None = None) -> list[int]:
        """Give up least recently used evictable chunks until n sets are free (or, with
        idle_before, only chunks unused since then); returns the sets freed (a set some slot
        still maps stays with it and is not counted)."""
        victims: list[CachedChunk] = []
        frees = 0
        for chunk in self.chunks.values():  # chosen first, dropped after: no copy of the index
            if frees >= n or (idle_before is not None and chunk.last_used > idle_before):
                break
            if self.evictable(chunk):
                victims.append(chunk)
                frees += sum(self.pool.refcount[s] == 1 for s in chunk.sets)
        freed: list[int] = []
        for chunk in victims:
            del self.chunks[chunk.block_hash]
            for s in chunk.sets:
                self.pool.release(s, index=True)
            self.events.prefix_cache_evictions += 1
            freed += [s for s in chunk.sets if self.pool.refcount[s] == 0]
        return freed

    def clear(self) -> None:
        """Drop every chunk's reference (close, a reset): sequences keep what they map."""
        for chunk in self.chunks.values():
            for s in chunk.sets:
                self.pool.release(s, index=True)
        self.chunks.clear()
