"""Placing a sequence whose prompt starts with cached chunks (a prefix hit): the cached page sets
are mapped into its own slot, so its KV is one contiguous virtual run like any other, and only
the rest of the prompt is computed. The caller holds the cache's lock."""

from __future__ import annotations

from vmkv.kv_cache import OutOfKVMemory
from vmkv.vattention.prefix import CachedChunk, PrefixIndex
from vmkv.vattention.slots import SlotSeq, SlotTable


def place_with_hits(
    table: SlotTable, prefix: PrefixIndex, seq_id: int, seq: SlotSeq, hits: list[CachedChunk]
) -> int:
    """Map the hits' pages and back the rest of the prompt; returns the tokens already cached
    (0 when no hit fits: the caller then places the sequence as a new one).

    The last prompt token is always computed (its logits sample the next token). When the hits
    cover the whole prompt, or their last page ends mid-token (packed chunks, prefix.py), the
    pages the first computed token's write touches get private copies first (copy-on-write), so
    a cached page is never written. Hits are dropped from the end while
    the pages they need cannot be found; cached chunks nobody maps count as free until we map them.
    """
    geo, length = table.geometry, seq.length
    idle = table.idle()
    if not idle:
        raise OutOfKVMemory(1, 0, "slots")
    wanted = [s for chunk in hits for s in chunk.sets]
    # an idle slot still mapping the hit's first pages (deferred reclamation) needs no map for them
    slot, kept = max(((s, _common(s.sets, wanted)) for s in idle), key=lambda p: (p[1], -len(p[0].sets)))
    while hits:
        hit_pages = len(hits) * prefix.pages
        cached = min(prefix.whole(len(hits)), length - 1)
        first_write = cached * geo.column_token_bytes // geo.page_size
        cow = max(0, hit_pages - first_write)
        fresh = geo.pages_for(length) - hit_pages + cow
        taken = len(set(wanted[:hit_pages]) - table.in_use(exclude=[slot]))  # kept now, in use then
        if fresh <= table.available(exclude=[slot]) - taken:  # the slot's other pages: not counted
            break
        hits.pop()
    if not hits:
        return 0
    kept = min(kept, hit_pages)
    private_tail = all(table.pool.refcount[s] == 1 for s in slot.sets[kept:])
    if kept < hit_pages or cow or not private_tail:
        table.mapping.drop_pages(slot, kept)  # else the pages after the hit are reused as storage
    table.assign(slot, seq_id)
    seq.slot = slot.index
    try:
        table.map_cached(slot, wanted[kept:hit_pages])
        if cow:
            table.copy_on_write(slot, first_write)
        table.back(slot, geo.pages_for(length), length, eager=False)
    except BaseException:
        table.release(slot)
        seq.slot = -1
        raise
    seq.written = cached
    seq.keys = [chunk.key for chunk in hits]
    prefix.touch(hits)
    return cached


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common start of two lists of set ids."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
