"""What the cache reports: its memory in bytes and its KVStats, sharing and kept pages included.
The caller holds the cache's lock."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

from vmkv.kv_cache import KVMemory, KVShape, KVStats
from vmkv.vattention.slots import SlotSeq, SlotTable


def kv_memory(table: SlotTable, seqs: dict[int, SlotSeq], shape: KVShape) -> KVMemory:
    geo, pool = table.geometry, table.pool
    held = pool.num_sets - pool.free_count
    # a page several sequences map holds tokens each of them counts
    counts = table.mappers(running_only=True)
    double = sum(counts.values()) - len(counts)
    tokens = sum(s.length for s in seqs.values() if s.slot >= 0)
    return KVMemory(
        reserved_bytes=geo.regions * geo.region_bytes,
        allocated_bytes=held * geo.page_set_bytes,
        used_bytes=tokens * shape.bytes_per_token - double * geo.page_set_bytes,
    )


def kv_stats(table: SlotTable, pages_mapped: int, mapper_errors: int, mapper_cpu_seconds: float) -> KVStats:
    units, pool = table.geometry.units, table.pool
    counts = table.mappers(running_only=True)  # sequences mapping each set
    # counted in C, not per set in Python: this runs every step (engine stats)
    shared, extra = len(counts) - operator.countOf(counts.values(), 1), sum(counts.values()) - len(counts)
    prefix = dataclasses.asdict(table.prefix.events) if table.prefix is not None else {}
    return KVStats(
        unit="page",
        units_total=pool.num_sets * units,
        units_in_use=(pool.num_sets - pool.free_count) * units,
        units_peak=pool.peak_held * units,
        pages_mapped=pages_mapped,
        page_sets_total=pool.num_sets,
        page_sets_free=pool.free_count,
        page_sets_idle_kept=sum(len(s.sets) for s in table.idle()),
        units_kept=table.kept() * units,
        shared_pages=shared * units,
        bytes_saved=extra * units * table.geometry.page_size,
        mapper_errors=mapper_errors,
        mapper_cpu_seconds=mapper_cpu_seconds,
        **dataclasses.asdict(table.mapping.events),
        **prefix,
    )


@dataclass
class HeldPeaks:
    """The most page sets held at once, split: those backing sequences (their pages and cached
    chunks) and the reserve of pre-mapped idle slots (SlotTable.reserve). Each is its own
    maximum, sampled at every admission, step and mapper job."""

    backing: int = 0
    reserve: int = 0

    def observe(self, table: SlotTable) -> None:
        reserve = table.reserve()
        held = table.pool.num_sets - table.pool.free_count
        self.backing = max(self.backing, held - reserve)
        self.reserve = max(self.reserve, reserve)
