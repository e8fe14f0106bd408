"""Mapping ahead of need, so the step thread rarely maps: look-ahead for the next step's
tokens, group padding, and pre-mapped idle slots for the next admissions (the reserve). Jobs
for running sequences take pages as the step thread would (the reserve's, then free ones, then
idle slots' and cached chunks' kept pages), but never another sequence's mapped-ahead pages;
pre-mapping takes free sets only (it may evict least recently used cached chunks at the held
peak: _room_for_reserve). Jobs are dropped when their slot changed owner since they were
queued, and run on the background mapper's thread (mapper.py) or, without one, inline. The
caller holds the cache's lock."""

from __future__ import annotations

import time
from collections.abc import Sequence

from vmkv.dense.plan import group_decodes
from vmkv.kv_cache import OutOfKVMemory, StepBatch
from vmkv.vattention.mapper import MapJob
from vmkv.vattention.mapping import Slot
from vmkv.vattention.slots import SlotSeq, SlotTable

# pages a pre-mapping job maps at once: 2 MiB at 64 KiB pages, about a millisecond of populating
# under the cache lock, which an admission may be waiting for
PREMAP_PIECE = 32


class MapAhead:
    def __init__(self, table: SlotTable) -> None:
        self.table = table
        self.geometry, self.config = table.geometry, table.config
        # the reserve (private idle slots' pages) stays within this many page sets
        self.reserve_limit = int(self.config.premap_fraction * table.pool.num_sets)
        self.chunk = max(1, self.config.ahead_bytes // self.geometry.page_set_bytes)
        # pre-mapping jobs queued and not yet run: every free() asks for the reserve again, and
        # the at-once wave's 64 sequences finishing together queued ~2,000 jobs that mapped
        # nothing, each walking the slots under the lock on the mapper thread (its CPU in that
        # wave: 0.40 s with them, 0.35 s without; docs/vattention.md)
        self.queued_idle: set[MapJob] = set()

    def look_ahead(self, seqs: Sequence[SlotSeq]) -> list[MapJob]:
        """Back each sequence max(1, eager_steps) tokens past what it holds now, and when it must
        grow, `chunk` page sets beyond: a job per few pages costs the step's cores less than one
        per page (the pool hands a slot consecutive sets, which the driver maps in one call)."""
        ahead, geo = max(1, self.config.eager_steps), self.geometry
        jobs = []
        for seq in seqs:
            slot = self.table.slots[seq.slot]
            need = geo.pages_for(seq.length + ahead)
            if need > len(slot.sets):  # only wake the mapper for work
                target = min(geo.tokens_backed(need + self.chunk - 1), geo.max_len)
                jobs.append(MapJob(slot.index, slot.generation, target, least_tokens=seq.length + ahead))
        return jobs

    def group_pad(self, batch: StepBatch, seqs: Sequence[SlotSeq], upcoming: int) -> list[MapJob]:
        """Map targets that let runs of consecutive decode slots share one batched call.

        A batched call reads every slot up to the run's longest context, so a slot one page
        short splits the run. Allowing up to group_pad_pages more pages per slot, these jobs
        back each member up to its run's longest context `upcoming` steps from now. The pages
        are surplus: taken from free pages only, and reclaimable under pressure.
        """
        geo, slots = self.geometry, self.table.slots
        decodes = [(s, seq) for s, seq in zip(batch.steps, seqs, strict=True) if s.num_new == 1]
        pad = self.config.group_pad_pages
        entries = [
            (seq.slot, s.context_len + upcoming, geo.tokens_backed(len(slots[seq.slot].sets) + pad))
            for s, seq in decodes
        ]
        jobs = []
        for members in group_decodes(entries, self.config.max_padding):
            if len(members) > 1:
                target = max(entries[j][1] for j in members)
                for j in members:
                    slot = slots[entries[j][0]]
                    if geo.pages_for(target) > len(slot.sets):
                        jobs.append(MapJob(slot.index, slot.generation, target, group_pad=True))
        return jobs

    def premap(self, target_tokens: int, slots: int) -> list[MapJob]:
        """Jobs backing up to `slots` idle slots for a prompt of target_tokens, as many as fit
        the reserve limit whole: the slots the next admissions pick (SlotTable.pick), so they
        map nothing on the step thread."""
        fit = min(slots, self.reserve_limit // self.geometry.pages_for(target_tokens))
        return self._back_idle([target_tokens] * fit, upcoming=False, claimed=set())

    def for_upcoming(self, lengths: list[int], claimed: set[int]) -> list[MapJob]:
        """Jobs backing one idle slot for each prompt the next step likely admits, at its own
        length, so its admission maps nothing on the step thread and its slot (the best fit,
        SlotTable.pick) holds no page beside it. Neither the reserve limit nor the held peak
        bounds them: the admissions take these pages at the next step anyway. `claimed`: slots
        chosen for other upcoming prompts since the last step, skipped; the chosen join it."""
        return self._back_idle(sorted(lengths, reverse=True), upcoming=True, claimed=claimed)

    def _back_idle(self, targets: list[int], upcoming: bool, claimed: set[int]) -> list[MapJob]:
        """Back an idle slot to each target (largest first), each in pieces of PREMAP_PIECE
        pages, one job each, so the cache lock is free between them; slots in `claimed` are
        skipped and the chosen join it.

        An upcoming prompt gets the slot its admission would pick (SlotTable.pick), a slot
        keeping cached chunks included (the job drops them first, as the admission would), so
        the admission takes the very pages backed for it. Choosing among private slots only, a
        prompt told as it arrived was backed in an empty slot where its admission would have
        cleared one keeping cached chunks: every prompt then kept its predecessors' chunks mapped
        (held at peak, chat at 4 req/s: 87 against 57 MiB without the advice). The reserve tops
        up private slots only."""
        if not targets:  # the common step: nothing waits, so no walk over the idle slots
            return []
        table = self.table
        candidates = [
            s for s in table.idle() if s.index not in claimed and (upcoming or table.usable(s) == len(s.sets))
        ]
        jobs = []
        for target in targets:
            want = self.geometry.pages_for(target)
            slot = table.pick(want, among=candidates)
            if slot is None:
                break
            candidates.remove(slot)
            claimed.add(slot.index)
            usable = table.usable(slot)
            if usable < want:
                pieces = range(usable + PREMAP_PIECE, want, PREMAP_PIECE)
                tokens = [self.geometry.tokens_backed(p) for p in pieces] + [target]
                jobs += [MapJob(slot.index, slot.generation, t, idle=True, upcoming=upcoming) for t in tokens]
        jobs = [job for job in jobs if job not in self.queued_idle]
        self.queued_idle.update(jobs)
        return jobs

    def run(self, job: MapJob, background: bool) -> bool:
        """Back job.target_tokens of the slot; True when it mapped pages."""
        table, events = self.table, self.table.mapping.events
        self.queued_idle.discard(job)
        slot = table.slots[job.slot]
        if slot.generation != job.generation or (slot.seq_id is None) != job.idle:
            return False  # freed or reassigned since the job was queued
        if job.idle:
            table.clear_shared(slot)  # kept cached chunks: the admission would drop them too
        want = self.geometry.pages_for(job.target_tokens) - len(slot.sets)
        if want <= 0:
            return False
        if job.idle and not self._room_for_reserve(want, job.upcoming):
            return False  # pre-mapping waits for memory
        sets = self._take(job, slot, want)
        if sets is None:
            events.ahead_skipped += 1
            return False
        try:
            table.mapping.map_sets(slot, sets, background)
        except OutOfKVMemory:
            events.ahead_skipped += 1
            return False
        if job.idle:  # fresh pages: the trimmer must not take them for long idle
            slot.idle_since = time.monotonic()
        if job.group_pad:
            events.group_pad_page_sets += want
        return True

    def _take(self, job: MapJob, slot: Slot, want: int) -> list[int] | None:
        """The sets a job maps, or None when it must wait. A running sequence's next pages are
        found as the step thread would a step later, kept pages reclaimed included: in a full
        cache (a server's, after its first requests) every page comes from them. Pre-mapping
        and group padding take free sets only."""
        table, pool = self.table, self.table.pool
        if job.idle or job.group_pad:
            return pool.take(want, table.prefer(slot)) if want <= pool.free_count else None
        if want > pool.free_count:  # as many as free, reserve and index-only sets cover
            cover = pool.free_count + table.reserve() + pool.index_only
            if cover < max(1, self.geometry.pages_for(job.least_tokens) - len(slot.sets)):
                return None  # not even what the job needs at least
            want = min(want, cover)
        return table.take(want, slot)  # never a running sequence's pages: the cover holds none

    def _room_for_reserve(self, want: int, upcoming: bool) -> bool:
        """Whether `want` more sets may join the reserve, making room when they can.

        A free set stays for every running sequence's next page. Unless the sets back an
        upcoming prompt, the reserve stays within reserve_limit and the held sets within the most
        held so far (or the limit), so an idle cache holds no more than its running peak. Within
        those, the reserve outranks the least recently used cached chunks nobody maps: every
        admission draws on it, a chunk serves only a repeat of its prefix. They are evicted for it."""
        table, pool = self.table, self.table.pool
        if not upcoming and table.reserve() + want > self.reserve_limit:
            return False
        running = sum(1 for s in table.slots if s.seq_id is not None)
        held = pool.num_sets - pool.free_count
        ceiling = pool.num_sets if upcoming else max(pool.peak_held, self.reserve_limit)
        short = max(want + running - pool.free_count, held + want - ceiling)
        if 0 < short <= (table.prefix.evictable_sets() if table.prefix is not None else 0):
            table.prefix.evict(short)
            held = pool.num_sets - pool.free_count
        return want + running <= pool.free_count and held + want <= ceiling
