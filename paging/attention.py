"""Attention through block tables, for a batch that mixes prefill and decode sequences.

The step's plan is built once (`plan`) and read by every layer (`forward`). Four paths:

- reference: each sequence's blocks are gathered into one tensor and SDPA runs on it;
- torch: one-token (decode) sequences are batched: their K/V rows are gathered head-major
  with one index_select each and one SDPA call attends them all; other sequences run alone;
- cpu_kernel: as torch, but decode runs the CPU decode kernel (vmkv/decode_kernel.py) through
  the block table: nothing is gathered, K/V are read once;
- flash: flash-attn's varlen kernel with a block table, one call for the whole batch (GPU
  with flash-attn installed and a block size that is a multiple of 256);
- triton: vmkv's own Triton kernel (triton_attention.py), one call for the whole batch, decode
  and prefill alike, reading the blocks in place at any power-of-two block size from 16 (GPU).

Sequences with several new tokens (prefill, chunks) take the same route in torch and
cpu_kernel: they attend their own new k/v directly, and only a cached prefix (earlier
chunks, prefix-cache hits) is gathered from the blocks. SDPA gets 4-D inputs: with 3-D ones
the CPU build takes its unfused math path (207 ms against 32 ms for a 1,000-token prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vmkv.decode_kernel import (
    SHORT_CHUNK,
    DecodeKernel,
    DecodeKernels,
    DecodePlan,
    KernelStep,
    kernel_step,
    paged_plan,
)
from vmkv.flash_support import flash_unusable_reason
from vmkv.host_metadata import host_query_starts
from vmkv.kv_cache import StepBatch
from vmkv.prefill_kernel import causal_attention

from .triton_attention import TritonPart, paged_attention, triton_part


def bottom_right_mask(num_cached: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """bool [new, context_len]: new query j (position num_cached + j) sees keys 0..num_cached + j.
    None when nothing is cached (SDPA's own is_causal, which aligns top-left, is then right)."""
    if not num_cached:
        return None
    keys = torch.arange(context_len, device=device)
    return keys <= torch.arange(num_cached, context_len, device=device)[:, None]


def causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    use_kernel: bool = False,
) -> None:
    """q [n, Hq, D] over k/v [L, Hkv, D] with a bottom_right_mask (None: nothing cached); GQA;
    into out [n, Hq, D]. use_kernel: the CPU prefill kernel where it applies (the same causal
    attention, vmkv/prefill_kernel.py, writing out in place), SDPA elsewhere."""
    if use_kernel and causal_attention(q, k, v, scale, out) is not None:
        return
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and q.shape[0] > 1,
        scale=scale,
        enable_gqa=True,
    )
    out.copy_(o[0].transpose(0, 1))


@dataclass
class SeqPart:
    """A sequence attended on its own: rows start..end of the packed batch."""

    start: int
    end: int
    num_cached: int
    context_len: int
    blocks: torch.Tensor | None  # the blocks holding its context; None: nothing is cached
    mask: torch.Tensor | None  # bottom_right_mask, built once per step for every layer


@dataclass
class DecodePart:
    """The batch's one-token sequences, and with the decode kernel its short chunks over a
    cached context, attended together: one row each, attending its context up to itself."""

    rows: torch.Tensor  # int64 [Bd]: their rows in the packed batch
    whole_batch: bool  # every row is a decode row, rows == 0..T-1
    tables: torch.Tensor  # int32 [Bd, max_blocks]
    lens: torch.Tensor  # int32 [Bd]: context lengths
    max_len: int
    gather: torch.Tensor | None = None  # torch path: int64 [Bd * Hkv * max_len] rows of [token rows * Hkv, D]
    mask: torch.Tensor | None = None  # torch path: bool [Bd, 1, 1, max_len]
    kernel_plan: DecodePlan | None = None  # cpu_kernel path, built by the step's first layer


@dataclass
class FlashPart:
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    cu_seqlens_k: torch.Tensor  # int32 [B+1]
    tables: torch.Tensor  # int32 [B, max_blocks]


@dataclass
class PagedPlan:
    """What every layer of one step reads: where to write, and how to attend."""

    batch: StepBatch
    write_rows: torch.Tensor  # int64 [T]: every new token's row in token_rows() of the layer's blocks
    parts: list[SeqPart]  # sequences attended one by one
    decode: DecodePart | None = None
    flash: FlashPart | None = None
    triton: TritonPart | None = None
    # the decode kernel writes the new k/v (whole-batch decode steps): at batch 64 the cache's
    # two index_copy_ per layer took ~2 ms of a ~57 ms step
    kernel_appends: bool = False


def block_rows(blocks: torch.Tensor) -> int:
    """Token rows from one block's start to the next's in blocks [num_blocks, block_size, Hkv, D]:
    2 * block_size in the pool, whose blocks hold their K and V side by side."""
    return blocks.stride(0) // blocks.stride(1)


def token_rows(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [num_blocks, block_size, Hkv, D] as one [rows, Hkv, D] view in which token `offset` of
    block `b` is row b * block_rows(blocks) + offset (the rows between blocks are the other of K
    and V), so a step writes its new tokens with one index_copy_ per tensor."""
    num_blocks, block_size, *row = blocks.shape
    return blocks.as_strided(((num_blocks - 1) * block_rows(blocks) + block_size, *row), blocks.stride()[1:])


def write_tokens(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k/v [T, Hkv, D] into rows `rows` of token_rows() of the blocks."""
    token_rows(k_blocks).index_copy_(0, rows, k)
    token_rows(v_blocks).index_copy_(0, rows, v)


def _padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def table_rows(
    tables: list[list[int]], rows: list[torch.Tensor] | None, device: torch.device
) -> torch.Tensor:
    """int32 [B, width] block tables. rows[i] (int32, at least len(tables[i]) long) is sequence
    i's table kept up to date by the cache, so this costs O(batch) Python work, not O(context)."""
    if rows is None:
        return _padded_tables(tables, device)
    width = max(len(t) for t in tables)
    return torch.stack([r[:width] for r in rows]).to(device)


class ReferenceAttention:
    """Gather each sequence's blocks, run SDPA on them: slow, obviously right."""

    name = "reference"

    def plan(
        self,
        batch: StepBatch,
        tables: list[list[int]],
        write_rows: torch.Tensor,
        rows: list[torch.Tensor] | None = None,
    ) -> PagedPlan:
        starts = host_query_starts(batch)
        device = write_rows.device  # the cache's device, whatever the batch was built on
        parts = [
            SeqPart(
                starts[i],
                starts[i + 1],
                s.num_cached,
                s.context_len,
                torch.tensor(t, device=device),
                bottom_right_mask(s.num_cached, s.context_len, device),
            )
            for i, (s, t) in enumerate(zip(batch.steps, tables, strict=True))
        ]
        return PagedPlan(batch, write_rows, parts)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        plan: PagedPlan,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        _attend_parts(q, k, v, k_blocks, v_blocks, plan.parts, out, scale, new_from_blocks=True)
        return out


def _attend_parts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    parts: list[SeqPart],
    out: torch.Tensor,
    scale: float,
    new_from_blocks: bool = False,
    use_kernel: bool = False,
) -> None:
    """Each part attends its context: the cached prefix read from the blocks, then its own new
    k/v as given (or, with new_from_blocks, as read back from the blocks: the reference).
    use_kernel: see causal_sdpa."""
    bs = k_blocks.shape[1]
    for p in parts:
        new_k, new_v = k[p.start : p.end], v[p.start : p.end]
        if new_from_blocks:
            ctx_k = k_blocks.index_select(0, p.blocks).flatten(0, 1)[: p.context_len]
            ctx_v = v_blocks.index_select(0, p.blocks).flatten(0, 1)[: p.context_len]
        elif p.blocks is None:  # nothing cached
            ctx_k, ctx_v = new_k, new_v
        else:
            cached = p.blocks[: -(-p.num_cached // bs)]
            ctx_k = torch.cat([k_blocks.index_select(0, cached).flatten(0, 1)[: p.num_cached], new_k])
            ctx_v = torch.cat([v_blocks.index_select(0, cached).flatten(0, 1)[: p.num_cached], new_v])
        causal_sdpa(q[p.start : p.end], ctx_k, ctx_v, p.mask, scale, out[p.start : p.end], use_kernel)


class BatchedAttention:
    """Decode sequences together, the others one by one.

    Decode runs the CPU decode kernel when use_kernel (built on first use for the query/KV
    head grouping it sees), else gather + SDPA; where the kernel cannot be built it falls back
    to gather + SDPA, or raises if require_kernel.
    """

    def __init__(self, use_kernel: bool, require_kernel: bool = False) -> None:
        self.use_kernel = use_kernel
        self.require_kernel = require_kernel
        self._kernels: DecodeKernels | None = None  # on the first decode, for its blocks' dtype and head_dim

    @property
    def name(self) -> str:
        return "cpu_kernel" if self.use_kernel else "torch"

    def plan(
        self,
        batch: StepBatch,
        tables: list[list[int]],
        write_rows: torch.Tensor,
        rows: list[torch.Tensor] | None = None,
    ) -> PagedPlan:
        """rows: each sequence's table as a tensor kept by the cache (see table_rows)."""
        device = write_rows.device  # the cache's device, whatever the batch was built on
        starts = host_query_starts(batch)
        parts: list[SeqPart] = []
        decode: list[tuple[int, int, int]] = []  # (row, context length, sequence) per decode row
        for i, (s, t) in enumerate(zip(batch.steps, tables, strict=True)):
            if s.num_new == 1:
                decode.append((starts[i], s.context_len, i))
            elif self.use_kernel and s.num_cached and s.num_new <= SHORT_CHUNK:
                decode += [(starts[i] + j, s.num_cached + j + 1, i) for j in range(s.num_new)]
            else:
                blocks = None
                if s.num_cached:
                    blocks = torch.tensor(t, device=device) if rows is None else rows[i][: len(t)].to(device)
                mask = bottom_right_mask(s.num_cached, s.context_len, device)
                parts.append(SeqPart(starts[i], starts[i + 1], s.num_cached, s.context_len, blocks, mask))
        whole_batch = not parts
        # the kernel writes a row's own k/v before reading it: only where no row reads another's
        appends = self.use_kernel and whole_batch and len(decode) == len(batch.steps)
        plan = PagedPlan(batch, write_rows, parts, kernel_appends=appends)
        if decode:
            lens = [length for _, length, _ in decode]
            seqs = [i for _, _, i in decode]
            plan.decode = DecodePart(
                rows=torch.tensor([row for row, _, _ in decode], dtype=torch.int64, device=device),
                whole_batch=whole_batch,
                tables=table_rows(
                    [tables[i] for i in seqs], None if rows is None else [rows[i] for i in seqs], device
                ),
                lens=torch.tensor(lens, dtype=torch.int32, device=device),
                max_len=max(lens),
            )
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        plan: PagedPlan,
        scale: float,
    ) -> torch.Tensor:
        d = plan.decode
        kernel = self._kernel(q, k_blocks) if d is not None and self.use_kernel else None
        if plan.kernel_appends and kernel is None:  # it could not be built after all: write them here
            write_tokens(k_blocks, v_blocks, plan.write_rows, k, v)
        if d is not None and d.whole_batch and kernel is None:
            return self._decode_sdpa(q, k_blocks, v_blocks, d, scale).view_as(q)
        out = torch.empty_like(q)
        if kernel is not None:
            if d.kernel_plan is None:  # the same strides in every layer: built once per step
                d.kernel_plan = paged_plan(d.rows, d.lens, d.tables, k_blocks)
            new = (k.contiguous(), v.contiguous()) if plan.kernel_appends else None
            kernel(d.kernel_plan, q.contiguous(), k_blocks, v_blocks, out, scale, new)
        elif d is not None:
            out.index_copy_(0, d.rows, self._decode_sdpa(q, k_blocks, v_blocks, d, scale).flatten(1, 2))
        _attend_parts(q, k, v, k_blocks, v_blocks, plan.parts, out, scale, use_kernel=self.use_kernel)
        return out

    def kernel_step(
        self, plan: PagedPlan, blocks: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> KernelStep | None:
        """forward's one kernel call per layer, where that is all it makes (kernel_appends: every
        row a decode row); blocks: each layer's (K, V) blocks."""
        d = plan.decode
        kernel = self._kernels.built() if self._kernels is not None else None
        if not plan.kernel_appends or d is None or kernel is None:
            return None
        if d.kernel_plan is None:
            d.kernel_plan = paged_plan(d.rows, d.lens, d.tables, blocks[0][0])
        keys, values = [k for k, _ in blocks], [v for _, v in blocks]
        return kernel_step(kernel, d.kernel_plan, keys, values, plan.batch.num_tokens)

    def _kernel(self, q: torch.Tensor, k_blocks: torch.Tensor) -> DecodeKernel | None:
        if self._kernels is None:
            self._kernels = DecodeKernels(k_blocks.dtype, k_blocks.shape[3], required=self.require_kernel)
        kernel = self._kernels.get(q.shape[1] // k_blocks.shape[2])
        self.use_kernel = kernel is not None  # the name then says which path really runs
        return kernel

    @staticmethod
    def _decode_sdpa(
        q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, d: DecodePart, scale: float
    ) -> torch.Tensor:
        """Attention of the decode rows -> [Bd, Hkv, G, D]."""
        _, block_size, num_kv_heads, head_dim = k_blocks.shape
        if d.gather is None:  # built by the first layer of the step, reused by the others
            device = k_blocks.device
            offsets = torch.arange(block_size, device=device)
            rows = (d.tables.long()[:, :, None] * block_rows(k_blocks) + offsets).flatten(1)[:, : d.max_len]
            heads = torch.arange(num_kv_heads, device=device)
            d.gather = (rows[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
            d.mask = (torch.arange(d.max_len, device=device) < d.lens[:, None])[:, None, None, :]
        bd = d.rows.shape[0]
        # rows of the [token rows * Hkv, D] view, gathered straight into SDPA's [B, Hkv, L, D] layout
        shape = (bd, num_kv_heads, d.max_len, head_dim)
        kk = token_rows(k_blocks).view(-1, head_dim).index_select(0, d.gather).view(shape)
        vv = token_rows(v_blocks).view(-1, head_dim).index_select(0, d.gather).view(shape)
        qq = q if d.whole_batch else q.index_select(0, d.rows)
        # the G query heads that share a KV head act as G query rows of that head
        return F.scaled_dot_product_attention(
            qq.reshape(bd, num_kv_heads, -1, head_dim), kk, vv, attn_mask=d.mask, scale=scale
        )


class FlashAttention:
    """flash-attn's varlen kernel reading the block table: one call for the whole batch."""

    name = "flash"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func  # GPU only; checked by flash_available()

        self._varlen = flash_attn_varlen_func

    def plan(
        self,
        batch: StepBatch,
        tables: list[list[int]],
        write_rows: torch.Tensor,
        rows: list[torch.Tensor] | None = None,
    ) -> PagedPlan:
        device = write_rows.device  # the cache's device, whatever the batch was built on
        cu_k = torch.zeros(len(batch.steps) + 1, dtype=torch.int32, device=device)
        cu_k[1:] = torch.cumsum(batch.context_lens, 0)
        flash = FlashPart(batch.query_start.to(device, torch.int32), cu_k, table_rows(tables, rows, device))
        return PagedPlan(batch, write_rows, [], flash=flash)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        plan: PagedPlan,
        scale: float,
    ) -> torch.Tensor:
        f = plan.flash
        return self._varlen(
            q,
            k_blocks,
            v_blocks,
            f.cu_seqlens_q,
            f.cu_seqlens_k,
            plan.batch.max_query_len,
            plan.batch.max_context_len,
            softmax_scale=scale,
            causal=True,
            block_table=f.tables,
        )


class TritonAttention:
    """The Triton paged kernel: every token of the batch in one launch, through the block table."""

    name = "triton"

    def plan(
        self,
        batch: StepBatch,
        tables: list[list[int]],
        write_rows: torch.Tensor,
        rows: list[torch.Tensor] | None = None,
    ) -> PagedPlan:
        device = write_rows.device  # the cache's device, whatever the batch was built on
        part = triton_part(batch.steps, table_rows(tables, rows, device), device)
        return PagedPlan(batch, write_rows, [], triton=part)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        plan: PagedPlan,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(q.contiguous(), k_blocks, v_blocks, plan.triton, scale)


def flash_available(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """flash-attn's paged kernels: usable flash-attn (flash_support.py) and a block size that is a
    multiple of 256."""
    return block_size % 256 == 0 and flash_unusable_reason(device, dtype, head_dim) is None


PagedAttentionPath = ReferenceAttention | BatchedAttention | FlashAttention | TritonAttention
