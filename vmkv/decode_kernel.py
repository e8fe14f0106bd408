"""The CPU decode-attention kernel that reads every KV layout in place (source and design:
decode_kernel_source.py).

Built with the system C compiler (`cc -O3 -march=native -fopenmp`, ~1 s) the first time a
shape is used and cached per source, flags and CPU (native_build.py). Without a compiler
`load_decode_kernel` logs a warning that says why and returns None; the layouts then fall
back to their torch paths.

Per step a layout builds one plan (`dense_plan` or `paged_plan`: where each sequence's K/V
lives, O(batch) host work); per layer it calls the kernel with that layer's K/V base, with
torch's thread count. (With the pip CPU build of torch, whose libgomp.so.1 is loaded first,
the kernel's OpenMP regions run on torch's own thread pool.)
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vmkv.decode_kernel_source import SOURCE
from vmkv.native_build import load_c_library

log = logging.getLogger(__name__)

_DTYPE_MACROS = {torch.bfloat16: "KV_BF16", torch.float16: "KV_F16", torch.float32: "KV_F32"}
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
# Where the kernel's prefetches put K/V lines (PREFETCH_LOCALITY in the source), per CPU kind:
# 2 is L2, 3 is L1. L2 read nearly twice as fast from memory on a Zen 4 EPYC (avx512_bf16 without
# AMX; decode_kernel_source.py); on an AMX Xeon (with the vector kernel, compute-bound there, and
# with the tile kernel) and an AVX2 Zen 3, L2 and L3 measured level or worse with the L1
# prefetches (docs/vattention.md), so those keep L1.
PREFETCH_LOCALITY = {"avx512_bf16_amx": 3, "avx512_bf16": 2, "other": 3}
# Contexts are split over threads only when sequences are too few for the
# cores, and never into pieces shorter than this (a piece's fixed cost is ~1 us).
MIN_SPLIT_TOKENS = 256
# A chunk of at most this many tokens over a cached context (a speculative step's last token and
# draft) is attended as that many decode rows, each with its context ending at its own token:
# causal within the chunk, and one kernel call for the step instead of a gather (paged) and an
# SDPA call per sequence per layer. In an engine step (paged, batch 1, ~300 tokens of context)
# a 5-token chunk's attention went from 0.09 to 0.045 ms a layer, one token's being 0.02 ms.
# Alone, each row reads the whole context: one sequence's 8-token chunk over 2,000-4,000 tokens
# took 0.27-0.52 ms against 0.34-0.67 the old way (paged) and 0.29-0.56 against 0.27-0.53
# (vattention); at 16 rows it was as often slower as faster, hence 8 (drafts of up to 7 tokens).
SHORT_CHUNK = 8


class _Plan(ctypes.Structure):
    """plan_t in the C source; field order matters."""

    _fields_ = [
        ("rows", ctypes.c_void_p),
        ("lens", ctypes.c_void_p),
        ("seq_base", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("min_split", ctypes.c_int64),
    ]


@dataclass
class DecodePlan:
    """Where one step's decode sequences keep their K/V, shared by every layer.

    The C struct holds raw pointers into `tensors`, which this object keeps alive; `strides`
    are the K/V strides it was built for (every layer's view must have them).
    """

    struct: _Plan
    tensors: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]


def _index(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to("cpu", dtype).contiguous()


def dense_plan(rows: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, view: torch.Tensor) -> DecodePlan:
    """Sequences b in slots[b] of [slots, max_len, Hkv, D] views with view's strides (any
    layout, last dim contiguous); query/output row rows[b], context lens[b]."""
    slot_stride, token_stride, head_stride, last = view.stride()
    if last != 1:
        raise ValueError("the K/V view's last dimension must be contiguous")
    rows, lens = _index(rows, torch.int64), _index(lens, torch.int32)
    base = _index(slots, torch.int64) * slot_stride
    struct = _Plan(
        rows=rows.data_ptr(),
        lens=lens.data_ptr(),
        seq_base=base.data_ptr(),
        num_seqs=len(rows),
        token_stride=token_stride,
        head_stride=head_stride,
        num_kv_heads=view.shape[2],
        min_split=MIN_SPLIT_TOKENS,
    )
    return DecodePlan(struct, (rows, lens, base), view.stride())


def paged_plan(
    rows: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, blocks: torch.Tensor
) -> DecodePlan:
    """Sequences b whose tokens t sit in blocks[tables[b, t // block_size]] of a
    [num_blocks, block_size, Hkv, D] pool (last dim contiguous)."""
    block_stride, token_stride, head_stride, last = blocks.stride()
    if last != 1:
        raise ValueError("the K/V blocks' last dimension must be contiguous")
    rows, lens, tables = _index(rows, torch.int64), _index(lens, torch.int32), _index(tables, torch.int32)
    struct = _Plan(
        rows=rows.data_ptr(),
        lens=lens.data_ptr(),
        tables=tables.data_ptr(),
        table_width=tables.shape[1],
        num_seqs=len(rows),
        block_size=blocks.shape[1],
        block_stride=block_stride,
        token_stride=token_stride,
        head_stride=head_stride,
        num_kv_heads=blocks.shape[2],
        min_split=MIN_SPLIT_TOKENS,
    )
    return DecodePlan(struct, (rows, lens, tables), blocks.stride())


@dataclass
class DecodeKernel:
    """The compiled kernel for one (dtype, GQA group, head_dim); call once per layer per step."""

    function: ctypes._CFuncPtr
    library: ctypes.CDLL  # kept alive as long as the function is
    dtype: torch.dtype
    group: int
    head_dim: int

    def __call__(
        self,
        plan: DecodePlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        new: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """out[rows[b]] = attention of q[rows[b]] over sequence b's context in k/v.

        q/out: contiguous [T, Hkv * group, head_dim]; k/v: this layer's views (slots or
        blocks) with the plan's strides. new: the step's (k, v) [T, Hkv, head_dim], contiguous;
        row rows[b] is first written as sequence b's last token (one C loop instead of two
        indexed stores: 7 us of a 28 us layer call at batch 1, measured).
        """
        if k.stride() != plan.strides or v.stride() != plan.strides:
            raise ValueError(f"K/V strides {k.stride()}, {v.stride()} differ from the plan's {plan.strides}")
        new_k, new_v = (None, None) if new is None else (new[0].data_ptr(), new[1].data_ptr())
        status = self.function(
            ctypes.byref(plan.struct),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            scale,
            torch.get_num_threads(),
            new_k,
            new_v,
        )
        if status:
            raise MemoryError("the CPU decode kernel could not allocate its work list")


@dataclass
class KernelStep:
    """A whole-batch decode step that the kernel runs alone, appending every new token: per
    layer, one call with that layer's K/V base. The native attention op (engine/native_attention.py)
    makes those calls without Python."""

    kernel: DecodeKernel
    plan: DecodePlan
    k_bases: list[int]  # data_ptr of each layer's K view
    v_bases: list[int]
    num_tokens: int

    @property
    def function_address(self) -> int:
        return ctypes.cast(self.kernel.function, ctypes.c_void_p).value or 0

    @property
    def plan_address(self) -> int:
        """Of the plan's C struct, alive as long as this object."""
        return ctypes.addressof(self.plan.struct)

    @property
    def num_kv_heads(self) -> int:
        return self.plan.struct.num_kv_heads


def kernel_step(
    kernel: DecodeKernel,
    plan: DecodePlan,
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    num_tokens: int,
) -> KernelStep | None:
    """The step as a KernelStep, or None where a layer's view has other strides than the plan's
    (that layer's call would raise; the Python path says why)."""
    if any(t.stride() != plan.strides for t in (*k_layers, *v_layers)):
        return None
    k_bases, v_bases = [t.data_ptr() for t in k_layers], [t.data_ptr() for t in v_layers]
    return KernelStep(kernel, plan, k_bases, v_bases, num_tokens)


class DecodeKernels:
    """The CPU decode kernel for one cache, compiled per GQA group on first use.

    `enabled` turns False (with a warning, from load_decode_kernel) the first time the kernel
    cannot be had, so later plans take the SDPA route; with `required` that raises instead.
    """

    def __init__(self, dtype: torch.dtype, head_dim: int, required: bool = False) -> None:
        self.dtype, self.head_dim, self.required = dtype, head_dim, required
        self.enabled = True
        self._kernels: dict[int, DecodeKernel | None] = {}

    def get(self, group: int) -> DecodeKernel | None:
        if group not in self._kernels:
            self._kernels[group] = load_decode_kernel(self.dtype, group, self.head_dim)
            self.enabled = self._kernels[group] is not None
            if not self.enabled and self.required:
                raise RuntimeError("the CPU decode kernel cannot be built here (the log says why)")
        return self._kernels[group]

    def built(self) -> DecodeKernel | None:
        """The one kernel built so far (a model has one GQA group), or None before the first
        decode step has built it."""
        kernels = list(self._kernels.values())
        return kernels[0] if len(kernels) == 1 else None


_loaded: dict[tuple, DecodeKernel | None] = {}


def prefetch_locality() -> int:
    """PREFETCH_LOCALITY for this CPU's kind."""
    if torch.cpu._is_amx_tile_supported():
        return PREFETCH_LOCALITY["avx512_bf16_amx"]
    return PREFETCH_LOCALITY["avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "other"]


def load_decode_kernel(
    dtype: torch.dtype, group: int, head_dim: int, extra_flags: tuple[str, ...] = ()
) -> DecodeKernel | None:
    """The kernel for this shape, built on first use; None (with a warning saying why) where it
    cannot be: no compiler, a dtype it does not read, or a head_dim that is not a multiple of 16.

    extra_flags reach the compiler (tests pass -mno-avx512f to run the AVX2 code path, and
    -DNO_AMX the vector path on a CPU with AMX tiles).
    """
    locality = prefetch_locality()
    key = (dtype, group, head_dim, extra_flags, locality)
    if key in _loaded:
        return _loaded[key]
    kernel = None
    if dtype not in _DTYPE_MACROS or head_dim % 16 or group < 1:
        log.warning("no CPU decode kernel for %s, group %d, head_dim %d; using torch", dtype, group, head_dim)
    else:
        defines = [f"-D{_DTYPE_MACROS[dtype]}", f"-DGROUP={group}", f"-DHEAD_DIM={head_dim}"]
        defines.append(f"-DPREFETCH_LOCALITY={locality}")
        flags = [*_FLAGS, *extra_flags, *defines]
        library = load_c_library("decode", SOURCE, flags, "CPU decode kernel unavailable, using torch")
        if library is not None:
            function = library.decode_attention
            function.restype = ctypes.c_int
            p = ctypes.c_void_p
            function.argtypes = [p, p, p, p, p, ctypes.c_float, ctypes.c_int, p, p]
            kernel = DecodeKernel(function, library, dtype, group, head_dim)
    _loaded[key] = kernel
    return kernel
