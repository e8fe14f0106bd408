"""VAttentionKVCache: per-sequence contiguous virtual KV, physical pages mapped on demand.

Per layer, K and V are virtual tensors [max_slots, max_len, Hkv, D] (token- or head-major
underneath, see geometry.py) reserved through a MemoryDriver. A sequence owns a slot;
pages are mapped into it as it grows so that every token a step writes is backed, and
attention reads the slots in place: stock kernels on views of them, or the CPU decode
kernel for decodes (attention.py).

The vAttention optimisations, each a VAttentionConfig switch:
- background_mapping: after prepare(), a thread maps the pages the next step will need
  while this step computes, so grow() rarely maps on the critical path;
- deferred_reclamation: a freed slot keeps its pages for the next sequence placed there;
  under pressure they are reclaimed (idle slots first) before memory is reported short;
- eager_steps: map pages that many tokens beyond what the sequence needs now.

Thread safety: one lock guards every piece of state and every map/unmap. The mapper
takes it per job and checks the slot's generation, so it cannot race a free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import resource
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vmkv.dense_slots import DenseSlotSequences
from vmkv.drivers import DEFAULT_PAGE_SIZE, CudaDriver, HostDriver, MemoryDriver, RawCallError, Reservation
from vmkv.kv_cache import KVCache, KVMemory, KVShape, KVStats, OutOfKVMemory, StepBatch
from vmkv.vattention.attention import (
    DEFAULT_MAX_PADDING,
    DecodeKernels,
    DenseSlotPlan,
    attend_dense,
    check_attend_args,
    flash_usable,
    group_decodes,
    plan_step,
)
from vmkv.vattention.geometry import SlotGeometry
from vmkv.vattention.mapper import BackgroundMapper, MapJob
from vmkv.vattention.pool import PageSetPool

_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # the step thread's own faults


def _minor_faults() -> int:
    return resource.getrusage(_RUSAGE).ru_minflt


# "auto" layout: head-major up to this page size. Its decode attention is ~25-30% faster on
# CPU SDPA, but a sequence grows by one page per KV head at a time, so with 2 MiB (CUDA)
# pages one step of growth would hold 16k tokens; token-major keeps that at 5.4k.
AUTO_HEAD_MAJOR_MAX_PAGE = 64 * 1024
CUDA_PAGE_SIZE = 2 * 1024 * 1024  # the cuMemCreate granularity on current GPUs
ATTENTION_PATHS = ("auto", "cpu_kernel", "sdpa")


@dataclass(frozen=True)
class VAttentionConfig:
    page_size: int = DEFAULT_PAGE_SIZE
    layout: str = "auto"  # "token" [slot, len, Hkv, D], "head" [slot, Hkv, len, D], or "auto" (see below)
    max_slots: int | None = None  # default: min(page sets, 256)
    combined_reservation: bool = False  # one reservation for every K/V tensor
    background_mapping: bool = True
    deferred_reclamation: bool = True
    eager_steps: int = 0
    populate: bool = True  # pre-fault pages at map time (only for a driver this cache builds)
    max_padding: float = DEFAULT_MAX_PADDING
    group_pad_pages: int = 1  # pages a decode may get beyond its needs to join a batched call
    use_flash_attn: bool = True  # flash_attn_with_kvcache when importable and on a GPU
    # decode attention on the CPU: "cpu_kernel" (vmkv/decode_kernel.py, reads the slots in
    # place), "sdpa" (stock kernels, unmodified, on the virtual memory), or "auto": the kernel
    # where it can be built (bf16/fp16/fp32, head_dim a multiple of 16, a C compiler), else sdpa
    attention: str = "auto"
    debug: bool = False  # verify every range a kernel reads is mapped


@dataclass
class MappingEvents:
    """The cache's own event counts (KVStats fields of the same names)."""

    map_calls_critical: int = 0
    map_calls_background: int = 0
    map_seconds_critical: float = 0.0
    map_seconds_background: float = 0.0
    unmap_calls: int = 0
    group_pad_page_sets: int = 0
    page_sets_reused: int = 0
    page_sets_reclaimed: int = 0
    ahead_skipped: int = 0
    minor_faults: int = 0
    fork_shared_pages: int = 0
    fork_copied_pages: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0


@dataclass
class _Slot:
    index: int
    sets: list[int] = field(default_factory=list)  # page-set id mapped at each page index
    seq_id: int | None = None  # None: idle (it may still keep pages)
    generation: int = 0  # bumped whenever the owner changes; stale mapper jobs compare it
    pinned: int = 0  # pages the current step's plan reads; never reclaimed under it


@dataclass
class _Seq:
    slot: int  # -1 while swapped out
    length: int  # tokens reserved: prompt + every grow
    written: int = 0  # tokens some step has written; fork shares only pages below this
    host_kv: torch.Tensor | None = None  # [tensors, length, Hkv, D] while swapped out


class VAttentionKVCache(DenseSlotSequences[_Seq], KVCache[DenseSlotPlan]):
    kind = "vattention"

    def __init__(
        self,
        shape: KVShape,
        max_len: int,
        kv_budget_bytes: int | None = None,
        device: torch.device | str | None = None,
        *,
        driver: MemoryDriver | None = None,
        config: VAttentionConfig | None = None,
        **options: object,
    ) -> None:
        """Build over `driver`, or over a driver of kv_budget_bytes for `device` when none is given
        (HostDriver on CPU; CudaDriver with 2 MiB pages on a GPU).

        options override VAttentionConfig fields (page_size=..., background_mapping=False, ...).
        """
        cfg = dataclasses.replace(config or VAttentionConfig(), **options)
        if cfg.eager_steps < 0:
            raise ValueError(f"eager_steps must be >= 0, got {cfg.eager_steps}")
        if driver is None and kv_budget_bytes is None:
            raise ValueError("give kv_budget_bytes or a driver")
        if driver is not None and "page_size" in options and options["page_size"] != driver.page_size:
            raise ValueError(f"page_size {options['page_size']} differs from the driver's {driver.page_size}")
        target = torch.device(device or (driver.device if driver is not None else "cpu"))
        if driver is not None:
            page_size = driver.page_size
        elif target.type == "cuda" and "page_size" not in options and config is None:
            page_size = CUDA_PAGE_SIZE
        else:
            page_size = cfg.page_size
        if cfg.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {cfg.attention!r}")
        layout = cfg.layout
        if layout == "auto":  # measured in docs/vattention.md
            layout = "head" if page_size <= AUTO_HEAD_MAJOR_MAX_PAGE else "token"
        probe = SlotGeometry(shape, max_len, cfg.max_slots or 1, page_size, layout)  # validates
        budget_pages = driver.free_page_count if driver is not None else kv_budget_bytes // page_size
        if kv_budget_bytes is not None:
            budget_pages = min(budget_pages, kv_budget_bytes // page_size)
        num_sets = budget_pages // probe.units
        if num_sets < 1:
            raise ValueError(
                f"a budget of {budget_pages} pages holds no page set ({probe.units} pages of {page_size} B)"
            )
        self._owns_driver = driver is None
        if driver is None and target.type == "cuda":
            driver = CudaDriver(num_sets * probe.units, page_size, device=target.index or 0)
        elif driver is None:
            if target.type != "cpu":
                raise ValueError(f"no memory driver for device {target}")
            driver = HostDriver(num_sets * probe.units, page_size, populate=cfg.populate)
        elif (target.type, target.index or 0) != (driver.device.type, driver.device.index or 0):
            raise ValueError(f"device {device} differs from the driver's {driver.device}")
        self.config = cfg
        self.driver = driver
        self.shape = shape
        self.max_len = max_len
        self.device = driver.device
        self.geometry = geo = dataclasses.replace(probe, max_slots=cfg.max_slots or min(num_sets, 256))
        self._lock = threading.RLock()
        self._placed: list[tuple[Reservation, int]] = []
        self._pages: list[int] = []
        try:
            self._pages = driver.alloc(num_sets * geo.units)
            self.pool = PageSetPool(self._pages, geo.units)
            self._reserve()
        except BaseException:
            self._give_back()
            raise
        self._slots = [_Slot(i) for i in range(geo.max_slots)]
        self._seqs: dict[int, _Seq] = {}
        self._use_flash = cfg.use_flash_attn and flash_usable(self.device, shape.dtype)
        self._kernels = self._decode_kernels()
        self._events = MappingEvents()
        self._closed = False
        self._mapper = BackgroundMapper(self._run_job) if cfg.background_mapping else None

    def _decode_kernels(self) -> DecodeKernels | None:
        """The CPU decode kernel when the config asks for it and this cache can use it."""
        mode, shape = self.config.attention, self.shape
        if mode == "sdpa" or self._use_flash:
            return None
        if self.device.type != "cpu":
            if mode == "cpu_kernel":
                raise ValueError("the CPU decode kernel runs on the CPU only")
            return None
        return DecodeKernels(shape.dtype, shape.head_dim, required=mode == "cpu_kernel")

    def _reserve(self) -> None:
        """One reservation per tensor (or one for all), and their zero-copy views."""
        geo, drv = self.geometry, self.driver
        if self.config.combined_reservation:
            whole = drv.reserve(geo.num_tensors * geo.tensor_bytes)
            self._placed = [(whole, t * geo.tensor_bytes) for t in range(geo.num_tensors)]
        else:
            for _ in range(geo.num_tensors):
                self._placed.append((drv.reserve(geo.tensor_bytes), 0))
        placed = self._placed
        numel = geo.tensor_bytes // geo.itemsize
        self._bytes = [
            drv.view(r, torch.uint8, [geo.tensor_bytes], off, require_mapped=False) for r, off in placed
        ]
        views = [
            geo.as_tensor(drv.view(r, self.shape.dtype, [numel], off, require_mapped=False))
            for r, off in placed
        ]
        self._k, self._v = views[0::2], views[1::2]

    # ------------------------------------------------------------ lifecycle
    def can_admit(self, num_tokens: int) -> bool:
        if not 0 < num_tokens <= self.max_len:
            return False
        with self._lock:
            slot = self._pick_slot(self.geometry.pages_for(num_tokens))
            if slot is None:
                return False
            missing = self.geometry.pages_for(num_tokens) - len(slot.sets)
            return missing <= self._available(exclude=slot)

    def admit(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if not token_ids:
            raise ValueError("cannot admit an empty prompt")
        self._check_len(len(token_ids))
        with self._lock:
            self._check_open()
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id} is already in the cache")
            needed = self.geometry.pages_for(len(token_ids))
            slot = self._pick_slot(needed)
            if slot is None:
                raise OutOfKVMemory(1, 0, "slots")
            self._require(needed - len(slot.sets), exclude=slot)
            reused = min(needed, len(slot.sets))
            self._back(slot, needed, len(token_ids))  # first: a failed map leaves the slot idle
            self._events.page_sets_reused += reused
            slot.seq_id = seq_id
            slot.generation += 1
            self._seqs[seq_id] = _Seq(slot.index, len(token_ids))
        return 0

    def grow(self, seq_id: int, token_ids: Sequence[int]) -> None:
        with self._lock:
            seq = self._resident(seq_id)
            length = seq.length + len(token_ids)
            self._check_len(length)
            slot = self._slots[seq.slot]
            needed = self.geometry.pages_for(length)
            self._require(needed - len(slot.sets), exclude=slot)
            self._back(slot, needed, length)
            seq.length = length

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child maps the parent's full pages (shared, immutable) and copies the rest."""
        geo = self.geometry
        with self._lock:
            parent = self._resident(parent_id)
            if child_id in self._seqs:
                raise ValueError(f"sequence {child_id} is already in the cache")
            idle = [s for s in self._slots if s.seq_id is None]
            if not idle:
                raise OutOfKVMemory(1, 0, "slots")
            slot = min(idle, key=lambda s: (len(s.sets), s.index))
            src = self._slots[parent.slot]
            shared = src.sets[: parent.written * geo.column_token_bytes // geo.page_size]
            copied = geo.pages_for(parent.length) - len(shared)
            self._require(copied, exclude=[])  # the chosen slot's kept pages count: they are dropped
            self._drop_pages(slot, 0)
            slot.seq_id = child_id
            slot.generation += 1
            self._seqs[child_id] = _Seq(slot.index, parent.length, parent.written)
            try:
                if shared:
                    for set_id in shared:
                        self.pool.share(set_id)
                    self._map_sets(slot, shared, background=False)
                if copied:
                    self._map_sets(slot, self._take(copied, slot), background=False)
            except BaseException:
                self._release_slot(slot)
                del self._seqs[child_id]
                raise
            first, nbytes = len(shared) * geo.page_size, copied * geo.page_size
            for t in range(geo.num_tensors):
                for c in range(geo.columns):
                    dst = geo.page_offset(slot.index, c, 0) + first
                    from_ = geo.page_offset(src.index, c, 0) + first
                    self._bytes[t][dst : dst + nbytes].copy_(self._bytes[t][from_ : from_ + nbytes])
            self._events.fork_shared_pages += len(shared) * geo.units
            self._events.fork_copied_pages += copied * geo.units

    def free(self, seq_id: int) -> None:
        with self._lock:
            seq = self._get(seq_id)
            if seq.slot >= 0:
                slot = self._slots[seq.slot]
                shared = any(self.pool.refcount[s] > 1 for s in slot.sets)  # must never be rewritten
                self._release_slot(slot, keep_pages=self.config.deferred_reclamation and not shared)
            del self._seqs[seq_id]

    def free_capacity(self) -> int:
        geo = self.geometry
        with self._lock:
            room = sum(
                geo.tokens_backed(len(self._slots[s.slot].sets)) - s.length
                for s in self._seqs.values()
                if s.slot >= 0
            )
            return self._available() * geo.page_size // geo.column_token_bytes + max(0, room)

    def usage(self) -> float:
        with self._lock:
            return 1.0 - self._available() / self.pool.num_sets

    def memory(self) -> KVMemory:
        geo = self.geometry
        with self._lock:
            held = self.pool.num_sets - self.pool.free_count
            double = sum(r - 1 for r in self.pool.refcount if r > 1)
            tokens = sum(s.length for s in self._seqs.values() if s.slot >= 0)
            return KVMemory(
                reserved_bytes=geo.num_tensors * geo.tensor_bytes,
                allocated_bytes=held * geo.page_set_bytes,
                used_bytes=tokens * self.shape.bytes_per_token - double * geo.page_set_bytes,
            )

    def stats(self) -> KVStats:
        """Units are driver pages: a page set maps geometry.units of them."""
        driver = self.driver.stats
        with self._lock:
            return KVStats(
                unit="page",
                units_total=self.pool.num_sets * self.geometry.units,
                units_in_use=driver.pages_mapped,
                units_peak=driver.peak_pages_mapped,
                page_sets_total=self.pool.num_sets,
                page_sets_free=self.pool.free_count,
                page_sets_idle_kept=sum(len(s.sets) for s in self._slots if s.seq_id is None),
                mapper_errors=len(self._mapper.errors) if self._mapper else 0,
                **dataclasses.asdict(self._events),
            )

    # ----------------------------------------------------------- preemption
    def swap_out(self, seq_ids: Sequence[int]) -> None:
        """Copy each sequence's KV to host tensors and release its slot and pages."""
        with self._lock:
            seqs = [self._resident(i) for i in seq_ids]
            if len(set(seq_ids)) != len(seq_ids):
                raise ValueError("a sequence appears twice in one swap_out")
            for seq in seqs:
                views = [
                    view[seq.slot, : seq.length]
                    for pair in zip(self._k, self._v, strict=True)
                    for view in pair
                ]
                seq.host_kv = torch.stack([v.to("cpu", copy=True) for v in views])
                self._release_slot(self._slots[seq.slot])
                seq.slot = -1
                self._events.swap_out_bytes += seq.host_kv.numel() * seq.host_kv.element_size()

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        """Restore swapped sequences into any free slots; all or nothing."""
        geo = self.geometry
        with self._lock:
            seqs = [self._get(i) for i in seq_ids]
            if len(set(seq_ids)) != len(seq_ids):
                raise ValueError("a sequence appears twice in one swap_in")
            for i, seq in zip(seq_ids, seqs, strict=True):
                if seq.slot >= 0:
                    raise ValueError(f"sequence {i} is not swapped out")
            idle = sorted((s for s in self._slots if s.seq_id is None), key=lambda s: (-len(s.sets), s.index))
            if len(idle) < len(seqs):
                raise OutOfKVMemory(len(seqs), len(idle), "slots")
            targets = idle[: len(seqs)]
            missing = sum(
                max(0, geo.pages_for(q.length) - len(s.sets)) for q, s in zip(seqs, targets, strict=True)
            )
            self._require(missing, exclude=targets)
            for seq_id, seq, slot in zip(seq_ids, seqs, targets, strict=True):
                slot.seq_id = seq_id  # all targets first, so mapping one never reclaims another's pages
                slot.generation += 1
                seq.slot = slot.index
            try:
                for seq, slot in zip(seqs, targets, strict=True):
                    self._back(slot, geo.pages_for(seq.length), seq.length)
            except BaseException:
                for seq, slot in zip(seqs, targets, strict=True):
                    self._release_slot(slot, keep_pages=self.config.deferred_reclamation)
                    seq.slot = -1
                raise
            for seq, slot in zip(seqs, targets, strict=True):
                for t, view in enumerate(v for pair in zip(self._k, self._v, strict=True) for v in pair):
                    view[slot.index, : seq.length] = seq.host_kv[t].to(self.device)
                self._events.swap_in_bytes += seq.host_kv.numel() * seq.host_kv.element_size()
                seq.host_kv = None

    # -------------------------------------------------------------- a step
    def prepare(self, batch: StepBatch) -> DenseSlotPlan:
        faults = _minor_faults()
        geo = self.geometry
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
                if self.config.debug:
                    self._assert_backed(self._slots[seq.slot], s.context_len)
            kernel = self._kernels is not None and self._kernels.enabled
            # only batched SDPA reads past a sequence's tokens; the kernel and flash never do
            padding = self.config.group_pad_pages and not self._use_flash and not kernel
            if padding and self._mapper is None:
                for job in self._group_pad_jobs(batch, seqs, upcoming=0):
                    self._run_job(job, background=False)
            for slot in self._slots:
                slot.pinned = 0
            slots, readable, jobs = [], [], []
            ahead = max(1, self.config.eager_steps)
            for seq in seqs:
                slot = self._slots[seq.slot]
                slot.pinned = len(slot.sets)
                slots.append(slot.index)
                readable.append(geo.tokens_backed(len(slot.sets)))
                if geo.pages_for(seq.length + ahead) > len(slot.sets):  # only wake the mapper for work
                    jobs.append(MapJob(slot.index, slot.generation, seq.length + ahead))
            if padding and self._mapper is not None:
                jobs += self._group_pad_jobs(batch, seqs, upcoming=1)
        plan = plan_step(
            batch,
            slots,
            readable,
            self.device,
            self.config.max_padding,
            self._use_flash,
            self._kernels,
            self._k[0],
        )
        if self._mapper is not None and jobs:
            self._mapper.submit(jobs)
        self._events.minor_faults += _minor_faults() - faults
        return plan

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DenseSlotPlan, scale: float
    ) -> torch.Tensor:
        check_attend_args(self.shape, layer, q, k, v, plan)
        faults = _minor_faults()
        out = attend_dense(self._k[layer], self._v[layer], q, k, v, plan, scale)
        self._events.minor_faults += _minor_faults() - faults
        return out

    def finish_step(self, plan: DenseSlotPlan) -> None:
        """Every layer wrote the step's tokens: from now on a fork may share their full pages."""
        with self._lock:
            for s in plan.batch.steps:
                seq = self._seqs.get(s.seq_id)
                if seq is not None and seq.slot >= 0:
                    seq.written = max(seq.written, s.context_len)

    def wait_mapper(self) -> None:
        """Block until the background mapper has run every job submitted so far."""
        if self._mapper is not None:
            self._mapper.wait_idle()

    def close(self) -> None:
        """Stop the mapper, unmap everything and give the pages (and an own driver) back."""
        if self._closed:
            return
        if self._mapper is not None:
            self._mapper.close()
        with self._lock:
            self._closed = True
            self._give_back()

    def _give_back(self) -> None:
        if self.driver.closed:
            return
        if self._owns_driver:
            self.driver.close()
            return
        for res in {r for r, _ in self._placed}:
            self.driver.release(res)
        self.driver.free(self._pages)

    # ------------------------------------------------------- page mapping
    def _group_pad_jobs(self, batch: StepBatch, seqs: list[_Seq], upcoming: int) -> list[MapJob]:
        """Map targets that let runs of consecutive decode slots share one batched call.

        A batched call reads every slot up to the run's longest context, so a slot one page
        short splits the run. Allowing up to group_pad_pages more pages per slot, these jobs
        back each member up to its run's longest context `upcoming` steps from now. The pages
        are surplus: taken from free pages only, and reclaimable under pressure.
        """
        geo = self.geometry
        decodes = [(s, seq) for s, seq in zip(batch.steps, seqs, strict=True) if s.num_new == 1]
        pad = self.config.group_pad_pages
        entries = [
            (seq.slot, s.context_len + upcoming, geo.tokens_backed(len(self._slots[seq.slot].sets) + pad))
            for s, seq in decodes
        ]
        jobs = []
        for members in group_decodes(entries, self.config.max_padding):
            if len(members) > 1:
                target = max(entries[j][1] for j in members)
                for j in members:
                    slot = self._slots[entries[j][0]]
                    if geo.pages_for(target) > len(slot.sets):
                        jobs.append(MapJob(slot.index, slot.generation, target, group_pad=True))
        return jobs

    def _back(self, slot: _Slot, needed: int, length: int) -> None:
        """Map the pages tokens 0..length-1 need (critical path), plus eager ones if free."""
        if needed > len(slot.sets):
            self._map_sets(slot, self._take(needed - len(slot.sets), slot), background=False)
        if self.config.eager_steps and self._mapper is None:
            want = self.geometry.pages_for(length + self.config.eager_steps) - len(slot.sets)
            if 0 < want <= self.pool.free_count:
                with contextlib.suppress(OutOfKVMemory):  # eager pages are best effort
                    self._map_sets(slot, self.pool.take(want, self._prefer(slot)), background=False)

    def _run_job(self, job: MapJob, background: bool = True) -> None:
        """Back job.target_tokens of the slot from free pages only (the mapper thread runs these)."""
        with self._lock:
            if self._closed:
                return
            slot = self._slots[job.slot]
            if slot.generation != job.generation or slot.seq_id is None:
                return  # freed or reassigned since the job was queued
            want = self.geometry.pages_for(job.target_tokens) - len(slot.sets)
            if want <= 0:
                return
            if want > self.pool.free_count:
                self._events.ahead_skipped += 1
                return
            try:
                self._map_sets(slot, self.pool.take(want, self._prefer(slot)), background)
            except OutOfKVMemory:
                self._events.ahead_skipped += 1
                return
            if job.group_pad:
                self._events.group_pad_page_sets += want

    def _map_sets(self, slot: _Slot, sets: list[int], background: bool) -> None:
        """Map page sets at the slot's next page indices, in every column of every tensor."""
        geo = self.geometry
        calls = self.driver.stats.map_calls
        t0 = time.perf_counter()
        first = len(slot.sets)
        started: list[tuple[Reservation, int]] = []
        try:
            for t, (res, base) in enumerate(self._placed):
                for c in range(geo.columns):
                    offset = base + geo.page_offset(slot.index, c, first)
                    started.append((res, offset))
                    self.driver.map(res, offset, [self.pool.physical(s, t * geo.columns + c) for s in sets])
        except RawCallError as e:  # undo the whole call, so the slot's state is as before
            for res, offset in started:
                for i in range(len(sets)):
                    if self.driver.is_mapped(res, offset + i * geo.page_size, geo.page_size):
                        self.driver.unmap(res, offset + i * geo.page_size)
            for set_id in sets:
                self.pool.release(set_id)
            if e.errno == errno.ENOMEM:  # vm.max_map_count reached, or the machine is out of memory
                raise OutOfKVMemory(len(sets) * geo.units, 0, "pages") from e
            raise
        finally:
            calls, seconds = self.driver.stats.map_calls - calls, time.perf_counter() - t0
            if background:
                self._events.map_calls_background += calls
                self._events.map_seconds_background += seconds
            else:
                self._events.map_calls_critical += calls
                self._events.map_seconds_critical += seconds
        slot.sets.extend(sets)

    def _release_slot(self, slot: _Slot, keep_pages: bool = False) -> None:
        """The slot becomes idle; stale mapper jobs for it are dropped by the generation bump."""
        slot.seq_id = None
        slot.generation += 1
        slot.pinned = 0
        if not keep_pages:
            self._drop_pages(slot, 0)

    def _drop_pages(self, slot: _Slot, keep: int) -> None:
        """Unmap the slot's pages from index keep on and release their sets."""
        geo = self.geometry
        if len(slot.sets) <= keep:
            return
        count = len(slot.sets) - keep
        for res, base in self._placed:
            for c in range(geo.columns):
                self.driver.unmap(res, base + geo.page_offset(slot.index, c, keep), count)
                self._events.unmap_calls += 1
        for set_id in slot.sets[keep:]:
            self.pool.release(set_id)
        del slot.sets[keep:]

    def _take(self, n: int, slot: _Slot) -> list[int]:
        """n free page sets, reclaiming kept pages when the free list is short (checked by _require)."""
        if n > self.pool.free_count:
            self._reclaim(n - self.pool.free_count, exclude=slot)
        return self.pool.take(n, self._prefer(slot))

    def _prefer(self, slot: _Slot) -> int | None:
        """Continue the slot's physical run; a fresh slot lets the pool place it."""
        return slot.sets[-1] + 1 if slot.sets else None

    def _reclaimable(self, slot: _Slot) -> int:
        """Pages that can go without touching anything a sequence needs or a plan reads."""
        if slot.seq_id is None:
            return len(slot.sets)
        seq = self._seqs[slot.seq_id]
        return max(0, len(slot.sets) - max(self.geometry.pages_for(seq.length), slot.pinned))

    def _available(self, exclude: _Slot | list[_Slot] | None = None) -> int:
        skip = {s.index for s in (exclude if isinstance(exclude, list) else [exclude]) if s is not None}
        return self.pool.free_count + sum(self._reclaimable(s) for s in self._slots if s.index not in skip)

    def _require(self, missing: int, exclude: _Slot | list[_Slot]) -> None:
        """Raise OutOfKVMemory, before any change, unless `missing` page sets can be found."""
        if missing > 0:
            available = self._available(exclude)
            if missing > available:
                units = self.geometry.units
                raise OutOfKVMemory(missing * units, available * units, "pages")

    def _reclaim(self, n: int, exclude: _Slot) -> None:
        """Free n page sets: idle slots' kept pages first (highest slot first), then mapped-ahead pages."""
        order = sorted(self._slots, key=lambda s: (s.seq_id is not None, -s.index))
        for slot in order:
            if n <= 0:
                return
            take = min(n, self._reclaimable(slot)) if slot is not exclude else 0
            if take:
                self._drop_pages(slot, len(slot.sets) - take)
                self._events.page_sets_reclaimed += take
                n -= take

    def _pick_slot(self, needed: int) -> _Slot | None:
        """An idle slot: the lowest with enough kept pages, else the one keeping the most."""
        idle = [s for s in self._slots if s.seq_id is None]
        if not idle:
            return None
        enough = [s for s in idle if len(s.sets) >= needed]
        if enough:
            return enough[0]
        return min(idle, key=lambda s: (-len(s.sets), s.index))

    # -------------------------------------------------------------- helpers
    def _assert_backed(self, slot: _Slot, num_tokens: int) -> None:
        geo = self.geometry
        for res, base in self._placed:
            for c in range(geo.columns):
                self.driver.assert_mapped(
                    res, base + geo.page_offset(slot.index, c, 0), num_tokens * geo.column_token_bytes
                )

    def slot_pages(self, seq_id: int) -> int:
        """Pages per column mapped in the sequence's slot (tests and benchmarks)."""
        with self._lock:
            return len(self._slots[self._resident(seq_id).slot].sets)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")
