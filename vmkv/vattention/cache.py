"""VAttentionKVCache: per-sequence contiguous virtual KV, physical pages mapped on demand.

A sequence owns a slot of every per-layer K/V tensor (mapping.py); pages are mapped into it
as it grows so that every token a step writes is backed, and attention reads the slots in
place: stock kernels on views of them, or the CPU decode kernel for decodes (vmkv/dense/).
This file is the KV-cache contract; the jobs behind it each have their own file:
budget.py (construction from a budget), slots.py (slot table, placement and reclamation),
mapping.py (reservations, map/unmap with rollback), ahead.py (look-ahead and group padding),
swap.py (host copies).

The vAttention optimisations, each a VAttentionConfig switch:
- background_mapping: after prepare(), a thread maps the pages the next step will need
  while this step computes, so grow() rarely maps on the critical path;
- deferred_reclamation: a freed slot keeps its pages for the next sequence placed there;
  under pressure they are reclaimed (idle slots first) before memory is reported short;
- eager_steps: map pages that many tokens beyond what the sequence needs now;
- premap_slots: the mapper keeps idle slots backed for the next admissions' prompts.

Sharing: one physical page set may back the same pages of several slots (a fork's written
pages, a prefix hit's cached chunks; prefix.py, sharing.py), counted per set in the pool. A
shared page is never written: only pages wholly below a sequence's written tokens are shared,
a step writes at or past them (prepare() checks), and the one write that would land in a
shared page (a prompt cached whole) gets a private copy first (copy-on-write).

Thread safety: one lock guards every piece of state and every map/unmap. The mapper
takes it per job and checks the slot's generation, so it cannot race a free.
"""

from __future__ import annotations

import resource
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from vmkv.decode_kernel import KernelStep
from vmkv.dense.attention import attend_dense, check_attend_args, dense_kernel_step
from vmkv.dense.plan import DenseSlotPlan, decode_kernels, flash_usable, plan_step
from vmkv.dense.sequences import DenseSlotSequences
from vmkv.drivers import MemoryDriver
from vmkv.kv_cache import KVCache, KVMemory, KVShape, KVStats, StepBatch, UpcomingPrompt, check_truncate
from vmkv.vattention import swap
from vmkv.vattention.ahead import MapAhead
from vmkv.vattention.budget import size_cache
from vmkv.vattention.config import VAttentionConfig
from vmkv.vattention.geometry import ORDER_NAMES
from vmkv.vattention.kept import Trimmer, memory_pressure, trim
from vmkv.vattention.mapper import BackgroundMapper, MapJob
from vmkv.vattention.mapping import SlotMapping
from vmkv.vattention.prefix import PrefixIndex
from vmkv.vattention.report import HeldPeaks, kv_memory, kv_stats
from vmkv.vattention.sharing import place_with_hits
from vmkv.vattention.slots import SlotSeq, SlotTable

_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # the step thread's own faults


def _minor_faults() -> int:
    return resource.getrusage(_RUSAGE).ru_minflt


class VAttentionKVCache(DenseSlotSequences[SlotSeq], KVCache[DenseSlotPlan]):
    kv_mode = "vattention"

    @property
    def layout(self) -> str:
        """Which order and page size: with neither given they follow the device (default_layout)."""
        size = self.geometry.page_size
        page = f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"
        return f"vattention, {ORDER_NAMES[self.geometry.order]}, {page} pages"

    def __init__(
        self,
        shape: KVShape,
        max_len: int,
        kv_budget_bytes: int | None = None,
        device: torch.device | str | None = None,
        *,
        driver: MemoryDriver | None = None,
        config: VAttentionConfig | None = None,
        model_id: str = "",
        **options: object,
    ) -> None:
        """Build over `driver`, or over a driver of kv_budget_bytes for `device` when none is given
        (HostDriver on CPU; CudaDriver with 2 MiB pages on a GPU). model_id and a request's
        cache_salt make the prefix-cache identity.

        options override VAttentionConfig fields (page_size=..., background_mapping=False, ...).
        """
        sizing = size_cache(shape, max_len, kv_budget_bytes, device, driver, config, options)
        self.config = cfg = sizing.config
        self.driver, self.geometry = sizing.driver, sizing.geometry
        self.shape, self.max_len, self.device = shape, max_len, sizing.driver.device
        self._lock = threading.RLock()
        self.mapping = SlotMapping(
            self.driver,
            sizing.owns_driver,
            self.geometry,
            shape.dtype,
            sizing.num_sets,
            cfg.combined_reservation,
        )
        self.pool = self.mapping.pool
        self.model_id = model_id
        self.prefix = PrefixIndex(self.geometry, self.pool) if cfg.prefix_caching else None
        self.table = SlotTable(self.mapping, cfg, self.prefix)
        self.seqs = self.table.seqs  # by id; read them, change them only through the contract
        self._ahead = MapAhead(self.table)
        self._use_flash = cfg.use_flash_attn and flash_usable(self.device, shape.dtype)
        self._kernels = decode_kernels(cfg.attention, self.device, shape, self._use_flash)
        self._closed = False
        self._mapper = BackgroundMapper(self._run_job) if cfg.background_mapping else None
        # pre-mapped idle slots for admissions (the reserve), sized by recent demand: the most
        # prompt tokens an admission had to back itself, and the most admissions in one step
        self._premap = self._mapper is not None and cfg.deferred_reclamation and cfg.premap_slots > 0
        self._backed: deque[int] = deque(maxlen=16)
        self._bursts: deque[int] = deque(maxlen=16)
        self._admitted = 0  # since the last prepare()
        self._upcoming: list[int] = []  # lengths of the prompts the next step likely admits (expect)
        self._claimed: set[int] = set()  # idle slots chosen for upcoming prompts since the last prepare()
        self._step_faults = 0  # the step thread's minor faults when the step began (prepare)
        self._last_admit = time.monotonic()
        self.peaks = HeldPeaks()
        if self._premap:
            with self._lock:
                self._mapper.submit(self._ahead.premap(*self._premap_demand()))
        self._trimmer = None
        if cfg.kept_idle_seconds is not None or cfg.pressure_min_available > 0:
            interval = min(1.0, max(0.05, (cfg.kept_idle_seconds or 4.0) / 4))
            self._trimmer = Trimmer(self._trim_if_due, interval)

    # ------------------------------------------------------------ lifecycle
    def can_admit(self, num_tokens: int) -> bool:
        if not 0 < num_tokens <= self.max_len:
            return False
        with self._lock:
            needed = self.geometry.pages_for(num_tokens)
            slot = self.table.pick(needed)
            if slot is None:
                return False
            return needed - self.table.usable(slot) <= self.table.available(
                exclude=self.table.reusing([slot])
            )

    def admit(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if not token_ids:
            raise ValueError("cannot admit an empty prompt")
        self._check_len(len(token_ids))
        with self._lock:
            self._check_open()
            if seq_id in self.seqs:
                raise ValueError(f"sequence {seq_id} is already in the cache")
            seq = SlotSeq(-1, len(token_ids))
            cached = 0
            if self.prefix is not None:
                seq.token_ids, seq.identity = list(token_ids), (self.model_id, cache_salt)
                seq.hashes = self.prefix.hashes(seq.token_ids, seq.identity, [])
                hits = self.prefix.match(seq.token_ids, seq.hashes, seq.identity)
                if hits:
                    cached = place_with_hits(self.table, self.prefix, seq_id, seq, hits)
            if seq.slot < 0:
                self.table.place(seq_id, seq, eager=self._mapper is None)
            if self.prefix is not None:
                self.prefix.events.prefix_cache_queries += len(token_ids)
                self.prefix.events.prefix_cache_hits += cached
            self.seqs[seq_id] = seq
            self._backed.append(len(token_ids) - cached)
            self._admitted += 1
            self._last_admit = time.monotonic()
            self.peaks.observe(self.table)
        return cached

    def grow(self, seq_id: int, token_ids: Sequence[int]) -> None:
        with self._lock:
            seq = self._resident(seq_id)
            length = seq.length + len(token_ids)
            self._check_len(length)
            slot = self.table.slots[seq.slot]
            needed = self.geometry.pages_for(length)
            self.table.require(needed - len(slot.sets), exclude=slot)
            self.table.back(slot, needed, length, self._mapper is None)
            seq.length = length
            if self.prefix is not None:
                seq.token_ids += token_ids
                seq.hashes = self.prefix.hashes(seq.token_ids, seq.identity, seq.hashes)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """The pages mapped past num_tokens stay in the slot, for the tokens that come next; a
        chunk the prefix cache indexed from the dropped tokens is forgotten (prefix.py)."""
        with self._lock:
            seq = self._resident(seq_id)
            check_truncate(seq_id, num_tokens, seq.length)
            seq.length = num_tokens
            seq.written = min(seq.written, num_tokens)
            if self.prefix is not None:
                self.prefix.forget_after(num_tokens, seq.hashes, seq.keys, self.table.slots[seq.slot].sets)
                del seq.token_ids[num_tokens:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child maps the parent's full written pages (shared, immutable) and copies the rest."""
        with self._lock:
            parent = self._resident(parent_id)
            if child_id in self.seqs:
                raise ValueError(f"sequence {child_id} is already in the cache")
            self.table.fork(parent, child_id)

    def free(self, seq_id: int) -> None:
        with self._lock:
            seq = self._get(seq_id)
            if self.prefix is not None:
                self.prefix.touch(self.prefix.held_by(seq.hashes, seq.keys))
            if seq.slot >= 0:
                # kept pages someone else holds too (a fork, the prefix cache) are never rewritten:
                # the slot's next sequence maps them only on a prefix hit (SlotTable.usable)
                self.table.release(self.table.slots[seq.slot], keep_pages=self.config.deferred_reclamation)
            del self.seqs[seq_id]
            # a slot fell idle: back it for the next prompt now, not at the next step's prepare(),
            # which comes after that step's admissions
            jobs = self._ahead.premap(*self._premap_demand()) if self._premap else []
        if jobs:
            self._mapper.submit(jobs)

    def free_capacity(self) -> int:
        geo = self.geometry
        with self._lock:
            room = sum(
                geo.tokens_backed(len(self.table.slots[s.slot].sets)) - s.length
                for s in self.seqs.values()
                if s.slot >= 0
            )
            return self.table.available() * geo.page_size // geo.column_token_bytes + max(0, room)

    def usage(self) -> float:
        with self._lock:
            return 1.0 - self.table.available() / self.pool.num_sets

    def memory(self) -> KVMemory:
        with self._lock:
            return kv_memory(self.table, self.seqs, self.shape)

    def stats(self) -> KVStats:
        """Units are physical pages (a page set holds geometry.units of them), a shared one
        counted once; pages_mapped counts mappings, so a page a fork shares counts twice."""
        with self._lock:
            errors = len(self._mapper.errors) if self._mapper else 0
            cpu = self._mapper.cpu_seconds if self._mapper else 0.0
            return kv_stats(self.table, self.driver.stats.pages_mapped, errors, cpu)

    # ----------------------------------------------------------- preemption
    def swap_out(self, seq_ids: Sequence[int]) -> None:
        with self._lock:
            swap.swap_out(self.table, self.mapping, [self._resident(i) for i in seq_ids])

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        with self._lock:
            seqs = [self._get(i) for i in seq_ids]
            swap.swap_in(self.table, self.mapping, seq_ids, seqs, eager=self._mapper is None)
            if self.prefix is not None:  # chunks evicted while it was out are indexed again
                for seq in seqs:
                    del seq.keys[self.prefix.still_indexed(seq.hashes, seq.keys) :]

    # -------------------------------------------------------------- a step
    def prepare(self, batch: StepBatch) -> DenseSlotPlan:
        faults = _minor_faults()
        geo, slots = self.geometry, self.table.slots
        with self._lock:
            self._check_open()
            ids = [s.seq_id for s in batch.steps]
            if len(set(ids)) != len(ids):
                raise ValueError("a sequence appears twice in one step")
            seqs = [self._resident(i) for i in ids]
            for s, seq in zip(batch.steps, seqs, strict=True):
                if s.context_len > seq.length:
                    raise ValueError(
                        f"sequence {s.seq_id} writes up to token {s.context_len} "
                        f"but holds room for {seq.length}"
                    )
                first = s.num_cached * geo.column_token_bytes // geo.page_size
                sets = slots[seq.slot].sets
                if first < len(sets) and self.pool.refcount[sets[first]] > 1:
                    raise ValueError(f"sequence {s.seq_id} would write into a shared page (page {first})")
                if self.config.debug:
                    self.mapping.assert_backed(slots[seq.slot], s.context_len)
            kernel = self._kernels is not None and self._kernels.enabled
            # only batched SDPA reads past a sequence's tokens; the kernel and flash never do
            padding = self.config.group_pad_pages and not self._use_flash and not kernel
            if padding and self._mapper is None:
                for job in self._ahead.group_pad(batch, seqs, upcoming=0):
                    self._ahead.run(job, background=False)
            self.table.pin(seqs)
            indices = [seq.slot for seq in seqs]
            readable = [geo.tokens_backed(len(slots[i].sets)) for i in indices]
            jobs = self._ahead.look_ahead(seqs)
            if padding and self._mapper is not None:
                jobs += self._ahead.group_pad(batch, seqs, upcoming=1)
            self._claimed = set()  # this step's admissions took what earlier steps' advice backed
            jobs += self._ahead.for_upcoming(self._upcoming, self._claimed)
            self._upcoming = []
            admitted, self._admitted = self._admitted, 0
            if admitted:
                self._bursts.append(admitted)
            # The reserve changes hands only at admissions (refilled here) and frees (free()).
            # premap() walks every idle slot: run each step it cost ~0.6 ms at 64 sequences in
            # 255 slots (bench_kernels.py prepare), and resubmitted jobs the mapper then dropped.
            if self._premap and admitted:
                jobs += self._ahead.premap(*self._premap_demand())
            self.peaks.observe(self.table)
        plan = plan_step(
            batch,
            indices,
            readable,
            self.device,
            self.config.max_padding,
            self._use_flash,
            self._kernels,
            self.mapping.k[0],
        )
        if self._mapper is not None and jobs:
            self._mapper.submit(jobs)
        self._step_faults = faults  # counted up to finish_step: prepare and the forward
        return plan

    def expect(self, prompts: Sequence[UpcomingPrompt]) -> None:
        """Remember the lengths of the prompts the next step likely admits, for prepare() to
        queue their slots' mapping ahead of this step's compute. A prompt whose first chunk is
        cached is left out: its admission takes the idle slot keeping the hit's pages, or the
        emptiest, never a slot backed for it."""
        if not self._premap or not (prompts or self._upcoming):
            return
        with self._lock:
            self._upcoming = self._lengths_to_back(prompts)

    def arrived(self, prompts: Sequence[UpcomingPrompt]) -> None:
        """Queue backing one idle slot for each prompt now, skipping slots chosen for other
        upcoming prompts since the last step, so a request that arrives while a step computes
        is admitted at the next one into pages the mapper populated meanwhile (expect() names
        only the prompts waiting when a step is scheduled). Called from any thread."""
        with self._lock:
            if not self._premap or self._closed:
                return
            jobs = self._ahead.for_upcoming(self._lengths_to_back(prompts), self._claimed)
            if jobs:  # under the lock, as close() marks the cache closed before stopping the mapper
                self._mapper.submit(jobs)

    def _lengths_to_back(self, prompts: Sequence[UpcomingPrompt]) -> list[int]:
        """The lengths of the upcoming prompts a slot should be backed for: those a slot holds
        (admit refuses the others) and whose first chunk is not cached."""
        return [
            len(p.token_ids)
            for p in prompts
            if 0 < len(p.token_ids) <= self.max_len and not self._prefix_hit(p)
        ]

    def _prefix_hit(self, prompt: UpcomingPrompt) -> bool:
        """Whether the prompt's first chunk hash is indexed (unverified, so no collision is
        counted twice: a false hit only leaves the prompt to the reserve)."""
        if self.prefix is None:
            return False
        identity = (self.model_id, prompt.cache_salt)
        first = self.prefix.hashes(prompt.token_ids[: self.prefix.end(0)], identity, [])
        return bool(first) and first[0] in self.prefix.chunks

    def _premap_demand(self) -> tuple[int, int]:
        """Tokens and count of the idle slots to pre-map: the most prompt tokens a recent
        admission backed itself (a prefix hit backs only its uncached part) and twice the most
        admissions in one recent step. Twice, because arrivals at a rate come in bursts the
        last 16 admitting steps need not have seen: at 8 req/s of 256-token prompts (steps of
        ~75 ms) the most alone left 7 of ~300 map calls, whole prompts, on the step thread,
        twice it 0-1 (docs/vattention.md)."""
        cfg = self.config
        tokens = max(self._backed, default=min(cfg.premap_tokens, self.max_len))
        slots = min(cfg.premap_slots, 2 * max(self._bursts, default=cfg.premap_slots))
        return max(1, tokens), slots

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DenseSlotPlan, scale: float
    ) -> torch.Tensor:
        check_attend_args(self.shape, layer, q, k, v, plan)
        return attend_dense(self.mapping.k[layer], self.mapping.v[layer], q, k, v, plan, scale)

    def kernel_step(self, plan: DenseSlotPlan) -> KernelStep | None:
        return dense_kernel_step(self.mapping.k, self.mapping.v, plan)

    def finish_step(self, plan: DenseSlotPlan) -> None:
        """Every layer wrote the step's tokens: from now on a fork may share their full pages,
        and the prefix cache indexes the chunks they complete. No plan reads the slots now, so
        their pages mapped ahead are reclaimable again until the next prepare() pins them."""
        self.mapping.events.minor_faults += _minor_faults() - self._step_faults
        with self._lock:
            self.table.pin([])
            for s in plan.batch.steps:
                seq = self.seqs.get(s.seq_id)
                if seq is not None and seq.slot >= 0:
                    seq.written = max(seq.written, s.context_len)
                    if self.prefix is not None:
                        sets = self.table.slots[seq.slot].sets
                        self.prefix.add(seq.token_ids, seq.hashes, seq.keys, sets, seq.written, seq.identity)

    def trim(self, force: bool = False) -> int:
        """Apply the kept-pages policy now (kept.py): unmap kept sets beyond the watermark that
        were idle for kept_idle_seconds (any, with force), the pre-mapped reserve too once nothing
        was admitted for that long and nothing runs (or with force), and give unused memory back
        to the OS. Returns the page sets unmapped. The trimmer thread calls it; so may an operator."""
        with self._lock:
            if self._closed:
                return 0
            quiet = self.config.kept_idle_seconds is not None and not self.seqs
            quiet = quiet and time.monotonic() - self._last_admit > self.config.kept_idle_seconds
            return trim(self.table, force, drop_reserve=force or quiet)

    def _trim_if_due(self) -> None:
        self.trim(force=memory_pressure(self.config.pressure_min_available))

    def wait_mapper(self) -> None:
        """Block until the background mapper has run every job submitted so far."""
        if self._mapper is not None:
            self._mapper.wait_idle()

    def reset_prefix_cache(self) -> int:
        """Drop the index's reference on every cached chunk: a set no slot maps is free at once."""
        with self._lock:
            if self.prefix is None:
                return 0
            forgotten = len(self.prefix.chunks)
            self.prefix.clear()
            return forgotten

    def close(self) -> None:
        """Stop the mapper, unmap everything and give the pages (and an own driver) back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here queued jobs, trims and advice from other threads do nothing
        if self._mapper is not None:
            self._mapper.close()
        if self._trimmer is not None:
            self._trimmer.close()
        with self._lock:
            if self.prefix is not None:
                self.prefix.clear()
            self.mapping.give_back()

    def slot_pages(self, seq_id: int) -> int:
        """Pages per column mapped in the sequence's slot (tests and benchmarks)."""
        with self._lock:
            return len(self.table.slots[self._resident(seq_id).slot].sets)

    # -------------------------------------------------------------- helpers
    def _run_job(self, job: MapJob) -> None:
        """The mapper thread's work: one job under the lock, unless the cache closed."""
        with self._lock:
            if not self._closed and self._ahead.run(job, background=True):
                self.peaks.observe(self.table)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")
