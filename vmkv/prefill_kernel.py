"""The CPU prefill-attention kernel (source and design: prefill_kernel_source.py).

`causal_attention(q, k, v, scale)` is what a layout calls for a sequence's new rows instead
of torch's SDPA: it returns None where the kernel does not apply (not bf16, not on a CPU with
AVX512-BF16, a head_dim that is not a multiple of 32, no compiler), and the caller then runs
SDPA, which stays the reference and the path on every other machine. Where the CPU has AMX
tiles the kernel computes its products on them (`tile_unit()`), elsewhere with `vdpbf16ps`.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from vmkv.native_build import load_c_function
from vmkv.prefill_kernel_source import SOURCE

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")


@cache
def _load(group: int, head_dim: int) -> ctypes._CFuncPtr | None:
    flags = [*_FLAGS, f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}"]
    unavailable = "CPU prefill kernel unavailable, prefill attention uses SDPA"
    i64, p = ctypes.c_int64, ctypes.c_void_p
    view, sizes = [p, i64, i64], [i64, i64, i64]  # a view: data pointer, token and head strides
    threads = [ctypes.c_int, ctypes.c_int]  # how many, and whether on the tile unit
    argtypes = [*view, *view, *view, *view, *sizes, ctypes.c_float, *threads]
    return load_c_function("prefill", SOURCE, flags, unavailable, "prefill_attention", ctypes.c_int, argtypes)


@cache
def tile_unit() -> bool:
    """Whether the kernel computes its products on the AMX tile unit (where the CPU has one)."""
    return torch.cpu._is_amx_tile_supported()


def kernel_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True where the kernel can run this attention: bf16 on a CPU with AVX512-BF16."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
        and q.shape[-1] % 32 == 0
        and torch.cpu._is_avx512_bf16_supported()
    )


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """q [n, Hq, D] over k/v [L, Hkv, D] (L >= n; query row i sits at position L - n + i and
    sees keys 0..L - n + i; GQA: query head j reads KV head j // (Hq / Hkv)) -> [n, Hq, D],
    written into `out` where given (any token/head strides, last dim contiguous: the layout's
    output rows, so nothing is copied after). Any token/head strides with the last dim
    contiguous for q, k and v too, k's and v's their own (a paged prefill's new k is RoPE's
    output, its v a slice of the fused projection). None where the kernel does not apply (see
    kernel_applies)."""
    n, num_q, head_dim = q.shape
    length, num_kv, _ = k.shape
    if not kernel_applies(q, k) or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        return None
    if k.data_ptr() % 4 or k.stride(0) % 2 or k.stride(1) % 2:  # K is read as words of two bf16
        return None
    if not 0 < n <= length or num_q % num_kv or k.shape != v.shape:
        raise ValueError(f"q {list(q.shape)} cannot attend over k {list(k.shape)} / v {list(v.shape)}")
    if out is None:
        out = torch.empty(n, num_q, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(2) != 1:
        raise ValueError(f"out must be a {q.dtype} view of q's shape {list(q.shape)}, last dim contiguous")
    function = _load(num_q // num_kv, head_dim)
    if function is None:
        return None
    status = function(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        n,
        length,
        num_kv,
        scale,
        torch.get_num_threads(),
        tile_unit(),
    )
    if status:
        raise MemoryError("the CPU prefill kernel could not allocate its buffers")
    return out
