"""The one KV-cache contract every layout implements (vattention, paged, contiguous).

The engine never looks inside a layout: it admits, grows, forks and frees sequences,
asks for free capacity, and once per step turns the batch into a layout-specific plan
that each layer's attention call reads; after the forward pass it tells the layout the
step's tokens are written (finish_step). Attention itself is model-independent: packed
(varlen) queries, per-sequence lengths, grouped-query heads, causal within a sequence.

Token positions: a sequence's KV occupies positions 0..len-1. In one step a sequence
writes `num_new` tokens at positions num_cached..num_cached+num_new-1 and those same
tokens are its queries, each attending causally to every position up to its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from vmkv.decode_kernel import KernelStep


class OutOfKVMemory(MemoryError):
    """The documented 'memory is short' signal: the scheduler preempts and retries.

    Raised before any state changes, so the cache stays usable and no sequence's data
    is touched.
    """

    def __init__(self, needed: int, free: int, unit: str) -> None:
        super().__init__(f"KV cache out of memory: need {needed} {unit}, {free} free")
        self.needed = needed
        self.free = free
        self.unit = unit


class SequenceTooLong(ValueError):
    """A sequence would grow past the cache's max_len; it can never fit, so do not retry."""


@dataclass(frozen=True)
class KVShape:
    """What a layout must store per token: one K and one V of [num_kv_heads, head_dim] per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes one token takes in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class UpcomingPrompt:
    """A prompt the next step likely admits: waiting (KVCache.expect) or just arrived (KVCache.arrived)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a step: write and attend for num_new tokens after num_cached."""

    seq_id: int
    num_cached: int
    num_new: int

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass
class StepBatch:
    """Layout-independent metadata of a step, built once and shared by every layer.

    query_start[i]..query_start[i+1] are sequence i's rows in the packed q/k/v.
    """

    steps: list[SeqStep]
    query_start: torch.Tensor  # int64 [B+1], on the cache's device
    num_cached: torch.Tensor  # int64 [B]
    context_lens: torch.Tensor  # int64 [B]
    max_query_len: int
    max_context_len: int
    is_decode_only: bool

    @classmethod
    def build(cls, steps: Sequence[SeqStep], device: torch.device | str = "cpu") -> StepBatch:
        steps = list(steps)
        if not steps:
            raise ValueError("a step needs at least one sequence")
        for s in steps:
            if s.num_new < 1 or s.num_cached < 0:
                raise ValueError(f"invalid step {s}: num_new must be >= 1 and num_cached >= 0")
        new = torch.tensor([s.num_new for s in steps], dtype=torch.int64)
        cached = torch.tensor([s.num_cached for s in steps], dtype=torch.int64)
        start = torch.zeros(len(steps) + 1, dtype=torch.int64)
        torch.cumsum(new, 0, out=start[1:])
        return cls(
            steps=steps,
            query_start=start.to(device),
            num_cached=cached.to(device),
            context_lens=(cached + new).to(device),
            max_query_len=int(new.max()),
            max_context_len=int((cached + new).max()),
            is_decode_only=bool((new == 1).all()),
        )

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.steps)


@dataclass
class KVMemory:
    """Bytes, for the capacity comparison: reserved (address space or up-front allocation),
    allocated (physical memory held), used (bytes of tokens actually stored)."""

    reserved_bytes: int
    allocated_bytes: int
    used_bytes: int

    @property
    def fragmentation_bytes(self) -> int:
        """Allocated minus used: internal fragmentation plus anything kept on purpose."""
        return self.allocated_bytes - self.used_bytes


@dataclass
class KVStats:
    """What a layout counts, read by attribute (engine, /metrics, bench).

    The common fields mean the same in every layout. A layout-specific field is None where
    the layout has no such thing, so a reader shows it where it is present and never asks
    which layout it is. Event counts grow over time; gauges (units_*, *_free, *_kept) do not.
    """

    unit: str  # what units_* count: "page" (vattention), "block" (paged), "slot" (contiguous)
    units_total: int
    units_in_use: int
    units_peak: int
    prefix_cache_queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries_total)
    prefix_cache_hits: int = 0  # of which were found cached
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    # vattention: page mapping, on the step's critical path or by the background mapper
    pages_mapped: int | None = None  # mappings: a page shared by a fork counts once per slot
    map_calls_critical: int | None = None
    map_calls_background: int | None = None
    map_seconds_critical: float | None = None
    map_seconds_background: float | None = None
    unmap_calls: int | None = None
    minor_faults: int | None = None  # the step thread's, from prepare to finish_step
    page_sets_total: int | None = None
    page_sets_free: int | None = None
    page_sets_idle_kept: int | None = None  # kept mapped by idle slots (deferred reclamation)
    page_sets_reused: int | None = None
    page_sets_reclaimed: int | None = None
    group_pad_page_sets: int | None = None
    ahead_skipped: int | None = None
    fork_shared_pages: int | None = None
    fork_copied_pages: int | None = None
    mapper_errors: int | None = None
    mapper_cpu_seconds: float | None = None  # the background mapper thread's CPU: taken from the step's cores
    # vattention sharing: gauges, then event counts (cow_copies, prefix_cache_evictions and
    # hash_collisions below are shared with paged)
    units_kept: int | None = None  # of units_in_use, held only for reuse (idle slots, cached chunks)
    shared_pages: int | None = None  # physical pages mapped by more than one sequence
    bytes_saved: int | None = None  # physical bytes those mappings would take unshared
    page_sets_trimmed: int | None = None  # kept sets unmapped by the idle policy
    pages_returned: int | None = None  # pages whose memory went back to the OS
    # paged: blocks, copy-on-write, prefix cache
    blocks_allocated: int | None = None
    blocks_cached_free: int | None = None
    cow_copies: int | None = None
    prefix_cache_evictions: int | None = None
    prefix_cache_query_blocks: int | None = None
    prefix_cache_hit_blocks: int | None = None
    hash_collisions: int | None = None  # equal hash, different prefix: detected, never shared
    swap_out_seconds: float | None = None
    swap_in_seconds: float | None = None
    # contiguous: whole-context copies
    fork_copies: int | None = None
    swap_outs: int | None = None
    swap_ins: int | None = None
    copied_bytes: int | None = None

    def present(self) -> dict[str, float]:
        """Every numeric field the layout reports, by name."""
        return {
            f.name: value
            for f in fields(self)
            if f.name != "unit" and (value := getattr(self, f.name)) is not None
        }

    def since(self, before: KVStats) -> KVStats:
        """Each numeric field minus its value in `before`: meaningful for event counts."""
        return replace(self, **{k: v - getattr(before, k) for k, v in self.present().items()})


def check_truncate(seq_id: int, num_tokens: int, length: int) -> None:
    """KVCache.truncate's argument check, the same in every layout: keep 1..length tokens."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens <= length:
        raise ValueError(f"sequence {seq_id} holds {length} tokens: cannot keep {num_tokens!r}")


Plan = TypeVar("Plan")


class KVCache(ABC, Generic[Plan]):
    """Sequence lifecycle + per-layer write-and-attend, the same for every layout.

    Plan is the layout's own step plan: what prepare() returns, every attend() reads and
    finish_step() consumes once the forward pass has written every layer.
    """

    kv_mode: str  # the layout, as EngineConfig.kv_mode names it
    shape: KVShape
    max_len: int
    device: torch.device

    @property
    def layout(self) -> str:
        """The layout as the start-up log names it: kv_mode and what varies within it."""
        return self.kv_mode

    # ------------------------------------------------------------ lifecycle
    @abstractmethod
    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence of num_tokens would fit right now."""

    @abstractmethod
    def admit(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Allocate for a new sequence's prompt; returns how many leading tokens are already
        cached (prefix caching; always < len(token_ids)). Raises OutOfKVMemory."""

    @abstractmethod
    def grow(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Make room for token_ids appended to the sequence (written by the next step).
        Atomic: raises OutOfKVMemory and changes nothing when memory is short."""

    @abstractmethod
    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the sequence's first num_tokens tokens (0 < num_tokens <= its length): the
        rest count as never written, and the room they held may be given back. A speculative
        step writes a draft's KV before the model has verified it; what it rejects goes here."""

    @abstractmethod
    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id starts as a copy of parent_id, sharing its KV where the layout can."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything the sequence holds."""

    @abstractmethod
    def free_capacity(self) -> int:
        """Tokens that could still be stored (upper bound; shared pages/blocks not counted)."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of the KV memory budget in use, 0..1 (the kv_cache_usage_perc metric)."""

    @abstractmethod
    def memory(self) -> KVMemory: ...

    @abstractmethod
    def stats(self) -> KVStats:
        """Units in use, prefix-cache and swap counts, and the layout's own events."""

    # ----------------------------------------------------------- preemption
    @abstractmethod
    def swap_out(self, seq_ids: Sequence[int]) -> None:
        """Move the sequences' KV to host memory and release their device memory."""

    @abstractmethod
    def swap_in(self, seq_ids: Sequence[int]) -> None:
        """Bring swapped sequences back. Raises OutOfKVMemory if they do not fit yet."""

    # -------------------------------------------------------------- a step
    @abstractmethod
    def prepare(self, batch: StepBatch) -> Plan:
        """Turn the step's batch into the layout's plan (slots, block tables, ...), once per step."""

    @abstractmethod
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float
    ) -> torch.Tensor:
        """Write this step's k/v [T, Hkv, D] for `layer`, then return attention of q [T, Hq, D]
        over each sequence's whole context as [T, Hq, D]."""

    def kernel_step(self, plan: Plan) -> KernelStep | None:
        """The step as one CPU decode-kernel call per layer, where attend() would make only that
        call (a whole-batch decode step on the kernel path, no checks beyond the arguments'):
        the native attention op then runs the layers without Python. None: attend() runs them."""
        return None

    @abstractmethod
    def finish_step(self, plan: Plan) -> None:
        """The forward pass has written the plan's tokens in every layer: they count as written
        from now on (forks share them, prefix caching indexes them). Not called for a step
        whose forward failed, so nothing half written is ever shared."""

    def expect(self, prompts: Sequence[UpcomingPrompt]) -> None:  # noqa: B027 - advice only
        """The prompts the next step likely admits (the waiting queue's head), told once a step
        before prepare(), replacing the last step's. A layout that maps memory may back them
        while this step computes; the others ignore it. Advice only: nothing is reserved."""

    def arrived(self, prompts: Sequence[UpcomingPrompt]) -> None:  # noqa: B027 - advice only
        """Prompts that just arrived, told from any thread, often while a step computes: the next
        step likely admits them. A layout that maps memory may start backing them now; the
        others ignore it. Advice only: nothing is reserved."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, so no request admitted later hits what came before (a
        benchmark that must start cold); the KV of the sequences in the cache stays. Returns the
        entries forgotten (blocks, chunks); a layout without a prefix cache forgets none."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook; layouts holding no OS resources skip it
        """Give back every resource (driver pages, threads)."""
