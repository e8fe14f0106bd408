"""PagedKVCache: the PagedAttention layout behind the one KV-cache contract.

Storage is one tensor `kv` of [num_layers, num_blocks, 2 (K, V), block_size, kv_heads, head_dim],
allocated up front from the byte budget. Token-major blocks are what flash-attn's paged
kernels read (at any block stride), a block's K and V lie side by side so a decode reads one run
per block, and with all layers in one tensor a copy-on-write or a swap moves a block in every
layer with a single copy.

Lifecycle rules, which keep shared KV immutable:
- a step may write only blocks its sequence owns alone (count one, not in the prefix cache);
  `prepare` checks this;
- copy-on-write happens in `grow`, when the block the next step writes into is shared (the
  partly filled last block after a fork); the data copy is done there, before the step;
- a block enters the prefix cache once it is full and its KV written in every layer, i.e.
  at `finish_step` of the step that computed it. A request admitted in the
  same step as the one still computing a block therefore does not reuse it (it computes its
  own copy); one admitted after that step does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from vmkv.drivers import require_available, zeros_on_huge_pages

from vmkv.decode_kernel import KernelStep
from vmkv.kv_cache import (
    KVCache,
    KVMemory,
    KVShape,
    KVStats,
    OutOfKVMemory,
    SequenceTooLong,
    StepBatch,
    check_truncate,
)

from .attention import (
    BatchedAttention,
    FlashAttention,
    PagedAttentionPath,
    PagedPlan,
    ReferenceAttention,
    TritonAttention,
    block_rows,
    flash_available,
    write_tokens,
)
from .block_pool import Block, BlockPool
from .prefix_cache import BlockKey, chain_hashes
from .sequence import PagedSequence
from .swap import SwappedBlocks, copy_from_host, copy_to_host
from .triton_attention import triton_unusable_reason

ATTENTION_PATHS = ("auto", "reference", "torch", "cpu_kernel", "flash", "triton")


@dataclass
class PagedEvents:
    """The cache's own event counts (KVStats fields of the same names)."""

    cow_copies: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_query_blocks: int = 0
    prefix_cache_hit_blocks: int = 0
    hash_collisions: int = 0  # equal hash, different prefix: detected, never shared
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0


class PagedKVCache(KVCache[PagedPlan]):
    kv_mode = "paged"

    @property
    def layout(self) -> str:
        return f"paged, {self.block_size}-token blocks"

    def __init__(
        self,
        shape: KVShape,
        max_len: int,
        kv_budget_bytes: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        enable_prefix_caching: bool = True,
        model_id: str = "",
        attention: str = "auto",
    ) -> None:
        """model_id and a request's cache_salt make the prefix-cache identity; attention picks
        the path (see attention.py): "auto" is flash where usable, else the Triton kernel on a
        GPU, else the compiled CPU kernel on a CPU (torch where it cannot be built), else torch."""
        if block_size < 1 or max_len < 1:
            raise ValueError(f"block_size and max_len must be positive, got {block_size} and {max_len}")
        self.shape = shape
        self.max_len = max_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.block_bytes = block_size * shape.bytes_per_token
        num_blocks = kv_budget_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_budget_bytes={kv_budget_bytes} is less than one block ({self.block_bytes} bytes)"
            )
        self.pool = BlockPool(num_blocks)
        kv_shape = (shape.num_layers, num_blocks, 2, block_size, shape.num_kv_heads, shape.head_dim)
        if self.device.type == "cpu":  # blocks are read scattered: huge pages spare a TLB miss each
            require_available(num_blocks * self.block_bytes, "the paged block pool")
            self.kv = zeros_on_huge_pages(kv_shape, shape.dtype)
        else:
            self.kv = torch.zeros(kv_shape, dtype=shape.dtype, device=self.device)
        self._blocks = [(self.kv[i, :, 0], self.kv[i, :, 1]) for i in range(shape.num_layers)]
        self._block_rows = block_rows(self._blocks[0][0])  # a new token's write row: block * this + offset
        self.attention = self._attention_path(attention)
        self.seqs: dict[int, PagedSequence] = {}  # by id; read them, change them only through the contract
        # every running sequence's block table as an int32 tensor of max_len's blocks, updated
        # where the table changes, so prepare() stacks rows instead of converting lists
        self._rows: dict[int, torch.Tensor] = {}
        self._events = PagedEvents()

    def _attention_path(self, name: str) -> PagedAttentionPath:
        if name not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {name!r}")
        shape, device = self.shape, self.device
        flash = flash_available(device, shape.dtype, self.block_size, shape.head_dim)
        if name == "auto" and flash:
            name = "flash"
        elif (
            name == "auto"
            and device.type == "cuda"
            and triton_unusable_reason(device, shape.dtype, self.block_size) is None
        ):
            name = "triton"
        if name == "flash":
            if not flash:
                raise ValueError(
                    "flash needs flash-attn, a CUDA device, fp16/bf16 and a block size multiple of 256"
                )
            return FlashAttention()
        if name == "triton":
            reason = triton_unusable_reason(device, shape.dtype, self.block_size)
            if reason is not None:
                raise ValueError(reason)
            return TritonAttention()
        if name == "reference":
            return ReferenceAttention()
        if name == "cpu_kernel" and device.type != "cpu":
            raise ValueError("the compiled paged kernel runs on the CPU only")
        return BatchedAttention(
            use_kernel=name != "torch" and device.type == "cpu", require_kernel=name == "cpu_kernel"
        )

    # ------------------------------------------------------------ lifecycle
    def can_admit(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_len and self._blocks_for(num_tokens) <= self.pool.num_free

    def admit(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already admitted")
        seq = PagedSequence(seq_id, list(token_ids), (self.model_id, cache_salt))
        if not seq.token_ids:
            raise ValueError("a sequence needs at least one token")
        if seq.num_tokens > self.max_len:
            raise SequenceTooLong(f"prompt of {seq.num_tokens} tokens exceeds max_len={self.max_len}")
        hits: list[Block] = []
        if self.enable_prefix_caching:
            seq.block_hashes = chain_hashes(seq.token_ids, self.block_size, seq.identity, None, 0)
            hits = self._cached_prefix(seq)
        # the last prompt token is always computed (its logits sample the next token): when the
        # whole prompt is cached, its last block comes as a private copy for that one write or,
        # with no block to spare for the copy, is recomputed whole
        copy_last = len(hits) * self.block_size == seq.num_tokens
        needed, free = self._admission_need(seq, hits, copy_last)
        if copy_last and needed > free:
            hits.pop()
            copy_last = False
            needed, free = self._admission_need(seq, hits, copy_last)
        if needed > free:
            raise OutOfKVMemory(needed, free, "blocks")
        for b in hits:
            self.pool.take(b)
        seq.block_table = [b.block_id for b in hits]
        seq.block_keys = [b.key for b in hits]
        if copy_last:
            self._copy_on_write(seq, len(hits) - 1)
            seq.block_keys.pop()
        self._append_blocks(seq, self._blocks_for(seq.num_tokens) - len(seq.block_table))
        seq.num_computed = min(len(hits) * self.block_size, seq.num_tokens - 1)
        self._sync_row(seq, 0)
        if self.enable_prefix_caching:
            c = self._events
            c.prefix_cache_queries += seq.num_tokens
            c.prefix_cache_hits += seq.num_computed
            c.prefix_cache_query_blocks += len(seq.block_hashes)
            c.prefix_cache_hit_blocks += len(hits)
        self.seqs[seq_id] = seq
        return seq.num_computed

    def grow(self, seq_id: int, token_ids: Sequence[int]) -> None:
        seq = self._running(seq_id)
        new = list(token_ids)
        if not new:
            raise ValueError("grow needs at least one token")
        total = seq.num_tokens + len(new)
        if total > self.max_len:
            raise SequenceTooLong(
                f"sequence {seq_id} would grow to {total} tokens, past max_len={self.max_len}"
            )
        fresh = self._blocks_for(total) - len(seq.block_table)
        # the next step writes into the partly filled last block: copy it first if it is shared
        # (a fork) or cached (a block a speculative step filled and truncate() cut short)
        last = self.pool.blocks[seq.block_table[-1]] if seq.num_tokens % self.block_size else None
        shared_last = last is not None and (last.ref_count > 1 or last.block_hash is not None)
        if fresh + shared_last > self.pool.num_free:
            raise OutOfKVMemory(fresh + shared_last, self.pool.num_free, "blocks")
        if shared_last:
            self._copy_on_write(seq, len(seq.block_table) - 1)
        self._append_blocks(seq, fresh)
        if fresh or shared_last:  # a decode adds a block once per block_size steps
            self._sync_row(seq, len(seq.block_table) - fresh - shared_last)
        seq.token_ids.extend(new)
        if self.enable_prefix_caching:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes += chain_hashes(
                seq.token_ids, self.block_size, seq.identity, parent, len(seq.block_hashes)
            )

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Blocks wholly past num_tokens go back to the pool (a full one the prefix cache indexed
        stays cached, its KV right for its tokens); an indexed block that now ends partly filled
        is copied before its next write (grow)."""
        seq = self._running(seq_id)
        check_truncate(seq_id, num_tokens, seq.num_tokens)
        keep = self._blocks_for(num_tokens)
        for b in reversed(seq.block_table[keep:]):
            self.pool.release(self.pool.blocks[b])
        del seq.block_table[keep:]
        del seq.token_ids[num_tokens:]
        full = num_tokens // self.block_size
        del seq.block_hashes[full:]
        del seq.block_keys[full:]
        seq.num_computed = min(seq.num_computed, num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._running(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id} already exists")
        for b in parent.block_table:
            self.pool.take(self.pool.blocks[b])
        self.seqs[child_id] = parent.copy(child_id)
        self._rows[child_id] = self._rows[parent_id].clone()

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        self._rows.pop(seq_id, None)
        self._release(seq)  # a swapped-out one holds no blocks; its host copy goes with it

    def free_capacity(self) -> int:
        return self.pool.num_free * self.block_size

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def memory(self) -> KVMemory:
        in_use = self.pool.num_blocks - self.pool.num_free
        # every block in use is full except a sequence's last one (shared ones counted once)
        partial: dict[int, int] = {}
        for seq in self.seqs.values():
            fill = seq.num_tokens % self.block_size
            if fill and seq.swapped is None:
                last = seq.block_table[-1]
                partial[last] = max(partial.get(last, 0), fill)
        used_tokens = in_use * self.block_size - sum(self.block_size - f for f in partial.values())
        return KVMemory(
            reserved_bytes=self.pool.num_blocks * self.block_bytes,
            allocated_bytes=in_use * self.block_bytes,
            used_bytes=used_tokens * self.shape.bytes_per_token,
        )

    def stats(self) -> KVStats:
        pool = self.pool
        return KVStats(
            unit="block",
            units_total=pool.num_blocks,
            units_in_use=pool.num_blocks - pool.num_free,
            units_peak=pool.events.peak_in_use,
            blocks_cached_free=len(pool.cached_free),
            blocks_allocated=pool.events.blocks_allocated,
            prefix_cache_evictions=pool.events.evictions,
            **asdict(self._events),
        )

    # ----------------------------------------------------------- preemption
    def swap_out(self, seq_ids: Sequence[int]) -> None:
        seqs = self._distinct(seq_ids, self._running)
        if not seqs:
            return
        start = time.perf_counter()
        distinct = list(dict.fromkeys(b for s in seqs for b in s.block_table))
        host_block = {b: i for i, b in enumerate(distinct)}
        host = self._to_host(distinct)
        for s in seqs:
            swapped = SwappedBlocks(host, [host_block[b] for b in s.block_table])
            self._release(s)
            s.swapped = swapped
        self._events.swap_out_bytes += host.numel() * host.element_size()
        self._events.swap_out_seconds += time.perf_counter() - start

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        seqs = self._distinct(seq_ids, self._swapped)
        # one new block per distinct host block: what the group shared, it shares again
        wanted = list(dict.fromkeys((id(s.swapped.host), h) for s in seqs for h in s.swapped.host_blocks))
        if len(wanted) > self.pool.num_free:
            raise OutOfKVMemory(len(wanted), self.pool.num_free, "blocks")
        start = time.perf_counter()
        hosts = {id(s.swapped.host): s.swapped.host for s in seqs}
        placed: dict[tuple[int, int], Block] = {}
        for host_id, host in hosts.items():
            host_blocks = [h for i, h in wanted if i == host_id]
            blocks = self.pool.allocate_run(len(host_blocks))  # in a run, as they were
            self._from_host(host, host_blocks, [b.block_id for b in blocks])
            placed.update(((host_id, h), b) for h, b in zip(host_blocks, blocks, strict=True))
            self._events.swap_in_bytes += len(host_blocks) * host[:, 0].numel() * host.element_size()
        taken: set[int] = set()
        for s in seqs:
            blocks = [placed[(id(s.swapped.host), h)] for h in s.swapped.host_blocks]
            for b in blocks:
                if b.block_id in taken:
                    self.pool.take(b)
                taken.add(b.block_id)
            s.block_table = [b.block_id for b in blocks]
            s.swapped = None
            self._sync_row(s, 0)
            self._recache(s)
        self._events.swap_in_seconds += time.perf_counter() - start

    # -------------------------------------------------------------- a step
    def prepare(self, batch: StepBatch) -> PagedPlan:
        """Host work is O(batch) plus O(tokens written): tables come as kept rows."""
        bs, stride = self.block_size, self._block_rows
        tables, rows, write_rows, seen = [], [], [], set()
        for s in batch.steps:
            seq = self._running(s.seq_id)
            if s.seq_id in seen:
                raise ValueError(f"sequence {s.seq_id} appears twice in one step")
            seen.add(s.seq_id)
            if s.context_len > seq.num_tokens:
                raise ValueError(
                    f"sequence {s.seq_id}: the step writes up to token {s.context_len} but only "
                    f"{seq.num_tokens} are allocated (grow first)"
                )
            table = seq.block_table
            for i in range(s.num_cached // bs, (s.context_len - 1) // bs + 1):
                block = self.pool.blocks[table[i]]
                if block.ref_count > 1 or block.block_hash is not None:
                    raise ValueError(
                        f"sequence {s.seq_id}: block {i} is shared (forked or prefix-cached); a step "
                        "may only write blocks it owns alone"
                    )
            tables.append(table)
            rows.append(self._rows[s.seq_id])
            write_rows.extend(table[p // bs] * stride + p % bs for p in range(s.num_cached, s.context_len))
        write = torch.tensor(write_rows, dtype=torch.int64, device=self.device)
        return self.attention.plan(batch, tables, write, rows)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PagedPlan, scale: float
    ) -> torch.Tensor:
        if not 0 <= layer < self.shape.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.shape.num_layers} layers")
        if q.dtype != self.shape.dtype:
            raise ValueError(f"q is {q.dtype} but the cache holds {self.shape.dtype}")
        k_blocks, v_blocks = self._blocks[layer]
        if not plan.kernel_appends:
            write_tokens(k_blocks, v_blocks, plan.write_rows, k, v)
        return self.attention.forward(q, k, v, k_blocks, v_blocks, plan, scale)

    def kernel_step(self, plan: PagedPlan) -> KernelStep | None:
        if not isinstance(self.attention, BatchedAttention):
            return None
        return self.attention.kernel_step(plan, self._blocks)

    def finish_step(self, plan: PagedPlan) -> None:
        """Every layer wrote the step's KV: advance what is computed, cache full blocks."""
        for s in plan.batch.steps:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.swapped is not None:
                continue
            seq.num_computed = max(seq.num_computed, s.context_len)
            if self.enable_prefix_caching:
                self._cache_computed_blocks(seq)

    def reset_prefix_cache(self) -> int:
        return self.pool.forget_cached()

    def close(self) -> None:
        self.seqs.clear()
        self._rows.clear()
        self.kv = torch.empty(0, dtype=self.shape.dtype, device=self.device)
        self._blocks = []

    # -------------------------------------------------------------- helpers
    def _append_blocks(self, seq: PagedSequence, count: int) -> None:
        """count new blocks at the end of seq's table, in a run after its last."""
        last = seq.block_table[-1] if seq.block_table else None
        seq.block_table += [b.block_id for b in self.pool.allocate_run(count, last)]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _sync_row(self, seq: PagedSequence, start: int) -> None:
        """Copy seq.block_table[start:] into its row tensor (created on first use)."""
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = torch.zeros(self._blocks_for(self.max_len), dtype=torch.int32)
            start = 0
        row[start : len(seq.block_table)] = torch.tensor(seq.block_table[start:], dtype=torch.int32)

    def _admission_need(self, seq: PagedSequence, hits: list[Block], copy_last: bool) -> tuple[int, int]:
        """(blocks to allocate, blocks free for that) when admitting seq with these cache hits;
        hits that sit in the cached free list stop being free once taken."""
        needed = self._blocks_for(seq.num_tokens) - len(hits) + copy_last
        return needed, self.pool.num_free - sum(1 for b in hits if b.ref_count == 0)

    def _running(self, seq_id: int) -> PagedSequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        if seq.swapped is not None:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    def _swapped(self, seq_id: int) -> PagedSequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        if seq.swapped is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        return seq

    @staticmethod
    def _distinct(seq_ids: Sequence[int], get: Callable[[int], PagedSequence]) -> list[PagedSequence]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in {list(seq_ids)}")
        return [get(i) for i in seq_ids]

    def _release(self, seq: PagedSequence) -> None:
        """Drop the sequence's references, tail first: on eviction the cache then gives up a
        prefix's last blocks before its first ones, which more requests share."""
        for b in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[b])
        seq.block_table = []

    def _copy_on_write(self, seq: PagedSequence, i: int) -> None:
        """Give seq a private copy of its logical block i (every layer); the caller checked that
        a block is free."""
        old = self.pool.blocks[seq.block_table[i]]
        new = self.pool.allocate(seq.block_table[i - 1] if i else None)
        self._copy_block(old.block_id, new.block_id)
        self.pool.release(old)
        seq.block_table[i] = new.block_id
        self._events.cow_copies += 1

    # Every change of block contents outside a step's attend() goes through these three, so a
    # subclass can repeat it elsewhere (tensor parallelism: on the other ranks' caches).
    def _copy_block(self, src: int, dst: int) -> None:
        self.kv[:, dst].copy_(self.kv[:, src])

    def _to_host(self, block_ids: list[int]) -> torch.Tensor:
        return copy_to_host(self.kv, block_ids)

    def _from_host(self, host: torch.Tensor, host_blocks: list[int], block_ids: list[int]) -> None:
        copy_from_host(self.kv, host, host_blocks, block_ids)

    def _cached_prefix(self, seq: PagedSequence) -> list[Block]:
        """The cached blocks holding seq's longest prefix of full blocks, each hit verified."""
        hits: list[Block] = []
        parent: BlockKey | None = None
        for i, block_hash in enumerate(seq.block_hashes):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            if not block.key.matches(parent, tokens, seq.identity):
                self._events.hash_collisions += 1
                break
            hits.append(block)
            parent = block.key
        return hits

    def _cache_computed_blocks(self, seq: PagedSequence) -> None:
        bs = self.block_size
        for i in range(len(seq.block_keys), seq.num_computed // bs):
            parent = seq.block_keys[-1] if seq.block_keys else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            cached = self.pool.lookup(seq.block_hashes[i])
            if cached is None:
                key = BlockKey(parent, tokens, seq.identity)
                self.pool.index(self.pool.blocks[seq.block_table[i]], seq.block_hashes[i], key)
            elif cached.key.matches(parent, tokens, seq.identity):
                key = cached.key  # computed twice at once: keep the cached copy, share its key
            else:
                self._events.hash_collisions += 1
                key = BlockKey(parent, tokens, seq.identity)
            seq.block_keys.append(key)

    def _recache(self, seq: PagedSequence) -> None:
        """Index a swapped-in sequence's computed full blocks again where nothing else holds their hash."""
        if not self.enable_prefix_caching:
            return
        for i, key in enumerate(seq.block_keys):
            block = self.pool.blocks[seq.block_table[i]]
            if block.block_hash is None and self.pool.lookup(seq.block_hashes[i]) is None:
                self.pool.index(block, seq.block_hashes[i], key)
