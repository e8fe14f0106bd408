"""Attention over dense slots: every sequence's K/V is a contiguous run of one slot.

Shared by the vattention layout (slots in virtual memory) and the contiguous baseline
(slots in plain tensors). A layout hands over, per layer, K and V as [slots, len, Hkv, D]
views (any strides, last dim contiguous) and the step's plan (plan.py).

Decode sequences (one new token) take one of two routes, neither copying K/V:
- the CPU decode kernel (vmkv/decode_kernel.py), given a `DecodeKernels`: one call per
  layer for every decode sequence, reading each slot in place up to its own length (so
  it never reads past a sequence's tokens and needs no padding or grouping);
- stock SDPA ("sdpa"): decode sequences in consecutive slots are batched into one call
  over [m, Hkv, Lmax, D] with a padding mask. The padded tail of a shorter sequence is
  read (and masked), so a group only forms where every slot is readable up to Lmax; the
  others get their own call. Running unmodified kernels on the virtual memory is the
  point of the layout, so this stays selectable.
Every other sequence (prefill chunks) gets one call on its exact [len, Hkv, D] view: the CPU
prefill kernel (vmkv/prefill_kernel.py) where the decode kernel runs and it applies (bf16,
AVX512-BF16), else SDPA. With flash-attn importable and the cache on a GPU, flash_attn_with_kvcache appends
the new K/V and attends in one call per step for decodes and one per prefill sequence.

GQA without copying K/V: query head h reads KV head h // G (G = Hq / Hkv), so a decode
query [Hq, D] is viewed as [Hkv, G, D]: G query rows against each KV head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vmkv.decode_kernel import KernelStep, kernel_step
from vmkv.dense.plan import DenseSlotPlan, SingleSeq
from vmkv.kv_cache import KVShape
from vmkv.prefill_kernel import causal_attention


def attend_dense(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: DenseSlotPlan,
    scale: float,
) -> torch.Tensor:
    """Write k/v [T, Hkv, D] into the slots, then attend q [T, Hq, D]; returns [T, Hq, D]."""
    if plan.use_flash:
        return _attend_flash(k_cache, v_cache, q, k, v, plan, scale)
    num_kv = k_cache.shape[2]
    group = q.shape[1] // num_kv
    kd = plan.kernel_decode
    kernel = plan.kernels.get(group) if kd is not None else None
    appends = kernel is not None and plan.batch.is_decode_only  # the kernel writes every new token
    if not appends:
        k_cache[plan.write_slot, plan.write_pos] = k
        v_cache[plan.write_slot, plan.write_pos] = v
    out = torch.empty_like(q)
    if kd is not None:
        if kernel is not None:
            new = (k.contiguous(), v.contiguous()) if appends else None
            kernel(kd.plan, q.contiguous(), k_cache, v_cache, out, scale, new)
        else:  # no compiler after all: this step's decodes one by one, later plans group them
            for row, slot, length in zip(kd.rows.tolist(), kd.slots, kd.lens, strict=True):
                keys = k_cache[slot, :length].transpose(0, 1).unsqueeze(0)
                values = v_cache[slot, :length].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    q[row].view(1, num_kv, group, -1), keys, values, scale=scale
                )
                out[row] = o.reshape(num_kv * group, -1)
    for g in plan.groups:
        m, lmax = g.num_slots, g.max_len
        keys = k_cache[g.first_slot : g.first_slot + m, :lmax].transpose(1, 2)  # [m, Hkv, L, D] view
        values = v_cache[g.first_slot : g.first_slot + m, :lmax].transpose(1, 2)
        qg = q[g.rows].view(m, num_kv, group, -1)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask, scale=scale)
        out[g.rows] = o.reshape(m, num_kv * group, -1)
    for s in plan.singles:  # 4-D inputs: CPU SDPA only takes its fused kernel for 4-D
        keys = k_cache[s.slot, : s.context_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D] view
        values = v_cache[s.slot, : s.context_len].transpose(0, 1).unsqueeze(0)
        if s.row_end - s.row_start == 1:
            qs = q[s.row_start].view(1, num_kv, group, -1)
            o = F.scaled_dot_product_attention(qs, keys, values, scale=scale)
            out[s.row_start] = o.reshape(num_kv * group, -1)
        elif _prefill_kernel(plan, q, k_cache, v_cache, s, scale, out) is None:
            qs = q[s.row_start : s.row_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(
                qs,
                keys,
                values,
                attn_mask=s.causal_mask,
                is_causal=s.causal_mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[s.row_start : s.row_end] = o[0].transpose(0, 1)
    return out


def dense_kernel_step(
    k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor], plan: DenseSlotPlan
) -> KernelStep | None:
    """The step as one decode-kernel call per layer where attend_dense would make only that call
    (every row a decode row on the kernel path); k/v_layers: each layer's [slots, len, Hkv, D]."""
    kd, batch = plan.kernel_decode, plan.batch
    if kd is None or plan.use_flash or plan.groups or plan.singles or not batch.is_decode_only:
        return None
    kernel = plan.kernels.built() if plan.kernels is not None else None
    return None if kernel is None else kernel_step(kernel, kd.plan, k_layers, v_layers, batch.num_tokens)


def _prefill_kernel(
    plan: DenseSlotPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    s: SingleSeq,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor | None:
    """The CPU prefill kernel on the slot in place, into the sequence's rows of out, where the
    layout runs its kernels (not on the "sdpa" path) and the kernel applies; None otherwise."""
    if not plan.prefill_kernel:
        return None
    keys, values = k_cache[s.slot, : s.context_len], v_cache[s.slot, : s.context_len]
    rows = slice(s.row_start, s.row_end)
    return causal_attention(q[rows], keys, values, scale, out[rows])


def _attend_flash(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: DenseSlotPlan,
    scale: float,
) -> torch.Tensor:
    """flash_attn_with_kvcache appends the new K/V itself (at cache_seqlens) and attends."""
    from flash_attn import flash_attn_with_kvcache

    out = torch.empty_like(q)
    fd = plan.flash_decode
    if fd is not None:
        o = flash_attn_with_kvcache(
            q[fd.rows].unsqueeze(1),
            k_cache,
            v_cache,
            k=k[fd.rows].unsqueeze(1),
            v=v[fd.rows].unsqueeze(1),
            cache_seqlens=fd.cache_seqlens,
            cache_batch_idx=fd.slots,
            softmax_scale=scale,
            causal=True,
        )
        out[fd.rows] = o.squeeze(1)
    fp = plan.flash_prefill
    for j, s in enumerate(plan.singles):
        rows = slice(s.row_start, s.row_end)
        o = flash_attn_with_kvcache(
            q[rows].unsqueeze(0),
            k_cache,
            v_cache,
            k=k[rows].unsqueeze(0),
            v=v[rows].unsqueeze(0),
            cache_seqlens=fp.cache_seqlens[j : j + 1],  # slices of the step's tensors: no copy
            cache_batch_idx=fp.slots[j : j + 1],
            softmax_scale=scale,
            causal=True,
        )
        out[rows] = o.squeeze(0)
    return out


def check_attend_args(
    shape: KVShape, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object
) -> None:
    """Precise errors for a wrong attend() call, before anything is written."""
    if not isinstance(plan, DenseSlotPlan):
        raise TypeError(f"plan must come from this cache's prepare(), got {type(plan).__name__}")
    if not 0 <= layer < shape.num_layers:
        raise IndexError(f"layer {layer} is outside [0, {shape.num_layers})")
    tokens = plan.batch.num_tokens
    kv_shape = (tokens, shape.num_kv_heads, shape.head_dim)
    if k.shape != kv_shape or v.shape != kv_shape:
        raise ValueError(f"k and v must be {list(kv_shape)}, got {list(k.shape)} and {list(v.shape)}")
    heads_ok = q.dim() == 3 and q.shape[1] > 0 and q.shape[1] % shape.num_kv_heads == 0
    if not heads_ok or q.shape[0] != tokens or q.shape[2] != shape.head_dim:
        raise ValueError(
            f"q must be [{tokens}, a multiple of {shape.num_kv_heads} heads, {shape.head_dim}], "
            f"got {list(q.shape)}"
        )
    if k.dtype != shape.dtype or v.dtype != shape.dtype or q.dtype != shape.dtype:
        raise TypeError(f"q, k and v must be {shape.dtype}, got {q.dtype}, {k.dtype}, {v.dtype}")
