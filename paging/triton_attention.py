"""The paged layout's own GPU kernel, in Triton: decode and prefill read K/V through the block table.

flash-attn's paged kernels need block sizes that are multiples of 256, so at paged's block
size 16 a GPU run would otherwise gather every sequence's blocks into a dense copy before SDPA.
This kernel reads the blocks in place. One program per (query token, KV head): the G query
heads of that KV head are G rows of one tile (GQA without repeating K/V), and the program walks
the sequence's blocks up to the token's own position (causal, bottom-right after cached tokens,
so decode, prefill chunks and prefix-cache hits are one code path) with an online softmax in
fp32. Work per token is O(its context); a long prefill is slower than a dedicated prefill
kernel would be, but it never copies KV.

Triton is optional: `triton_unusable_reason` says why the path cannot run, and the module
imports without Triton. Under `TRITON_INTERPRET=1`, set before Triton is first imported (Triton
picks interpreter or compiler when it decorates the kernel), it runs on the CPU: the tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has it through xgrammar; a bare GPU image may not
    triton = None

MIN_TILE = 16  # tl.dot needs every dimension >= 16


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unusable_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """None when the kernel can run for this cache, else why not."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"the Triton kernel runs on CUDA (or on the CPU under TRITON_INTERPRET=1), not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes fp16, bf16 or fp32, not {dtype}"
    if block_size < MIN_TILE or block_size & (block_size - 1):
        return f"the Triton kernel needs a power-of-two block size of at least {MIN_TILE}, got {block_size}"
    return None


if triton is not None:

    @triton.jit
    def _paged_attention(
        Q,
        K,
        V,
        OUT,
        TABLES,
        TOKEN_SEQ,
        TOKEN_POS,
        scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_tb,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(TOKEN_SEQ + t).to(tl.int64)
        pos = tl.load(TOKEN_POS + t)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_SIZE)
        gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q_ptr = Q + t * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=gd_mask, other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        d_mask = (d < HEAD_DIM)[None, :]
        for i in range(0, pos // BLOCK_SIZE + 1):
            block = tl.load(TABLES + seq * stride_tb + i).to(tl.int64)
            k = tl.load(
                K + block * stride_kb + n[:, None] * stride_kt + h * stride_kh + d[None, :],
                mask=d_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((i * BLOCK_SIZE + n <= pos)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(
                V + block * stride_vb + n[:, None] * stride_vt + h * stride_vh + d[None, :],
                mask=d_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / denom[:, None]
        o_ptr = OUT + t * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=gd_mask)


@dataclass
class TritonPart:
    """What the kernel reads besides q and the blocks, built once per step."""

    tables: torch.Tensor  # int32 [B, width]
    token_seq: torch.Tensor  # int32 [T]: each query token's sequence (row of tables)
    token_pos: torch.Tensor  # int32 [T]: each query token's position in its sequence


def triton_part(steps: list, tables: torch.Tensor, device: torch.device) -> TritonPart:
    """One host-to-device copy for the per-token metadata (tables come from table_rows)."""
    seq_of, pos_of = [], []
    for i, s in enumerate(steps):
        seq_of += [i] * s.num_new
        pos_of += range(s.num_cached, s.context_len)
    meta = torch.tensor([seq_of, pos_of], dtype=torch.int32).to(device)
    return TritonPart(tables, meta[0], meta[1])


def paged_attention(
    q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, part: TritonPart, scale: float
) -> torch.Tensor:
    """q [T, Hq, D] over blocks [num_blocks, block_size, Hkv, D] (last dim contiguous) -> [T, Hq, D]."""
    tokens, num_q, head_dim = q.shape
    _, block_size, num_kv, _ = k_blocks.shape
    if num_q % num_kv or k_blocks.stride(-1) != 1 or v_blocks.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q heads must be a multiple of KV heads and every last dimension contiguous")
    group = num_q // num_kv
    out = torch.empty_like(q)
    _paged_attention[(tokens, num_kv)](
        q,
        k_blocks,
        v_blocks,
        out,
        part.tables,
        part.token_seq,
        part.token_pos,
        scale,
        q.stride(0),
        q.stride(1),
        k_blocks.stride(0),
        k_blocks.stride(1),
        k_blocks.stride(2),
        v_blocks.stride(0),
        v_blocks.stride(1),
        v_blocks.stride(2),
        out.stride(0),
        out.stride(1),
        part.tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(MIN_TILE, triton.next_power_of_2(group)),
        BLOCK_D=max(MIN_TILE, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
