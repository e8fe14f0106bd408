"""`vmkv::attention` on the CPU in C++: a decode step that the CPU decode kernel runs alone
makes its per-layer calls without Python.

Why: in a batch-1 decode step every layer's attention went C++ wrapper -> dispatcher -> the
op's Python kernel -> the cache's `attend` (argument checks, the plan, the kernel through
ctypes). Inside a step that Python runs on cold caches (each layer's linears stream ~7 MB of
weights through a 2 MiB L2 first), so on a 2-core AMX Xeon a layer's attention took ~80-100 µs
where the kernel alone took ~17 µs warm and ~30 µs cold: ~3 ms of a ~20 ms step.

How: before the forward of a step for which the cache returns a `KernelStep` (a whole-batch
decode step on the kernel path: `KVCache.kernel_step`), `set_step` hands the C function's
address, the step's plan and every layer's K/V base to this operator, per thread; each layer
then checks its arguments (the same errors as the Python path: IndexError, ValueError,
TypeError) and calls the kernel. Every other step (prefills, mixed batches, other devices,
SDPA) reaches the Python implementation, `vmkv::cache_attention`, through the dispatcher.
Where this cannot be built (no C++ compiler) the Python implementation backs `vmkv::attention`
directly, as before.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from vmkv.decode_kernel import KernelStep
from vmkv.native_build import build_failure, build_torch_library

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace {

/* decode_attention() of vmkv/decode_kernel_source.py */
using decode_fn = int (*)(const void *plan, const void *q, void *k, void *v, void *out, float scale,
                          int num_threads, const void *k_new, const void *v_new);

/* The running step's kernel calls; per thread, as each engine steps on its own thread. */
struct KernelStep {
    decode_fn fn = nullptr;
    const void *plan = nullptr;
    std::vector<int64_t> k_bases, v_bases;
    int64_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0, threads = 1;
    at::ScalarType dtype = at::kBFloat16;
};
thread_local KernelStep step;

void set_kernel_step(int64_t fn, int64_t plan, std::vector<int64_t> k_bases, std::vector<int64_t> v_bases,
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                     at::ScalarType dtype, int64_t threads) {
    TORCH_CHECK_VALUE(fn != 0 && plan != 0, "a kernel step needs the kernel and its plan");
    TORCH_CHECK_VALUE(!k_bases.empty() && k_bases.size() == v_bases.size(), "one K and one V base per layer");
    step = KernelStep{reinterpret_cast<decode_fn>(fn), reinterpret_cast<const void *>(plan),
                      std::move(k_bases), std::move(v_bases), tokens, q_heads, kv_heads, head_dim,
                      threads, dtype};
}

void clear_kernel_step() { step = KernelStep{}; }

at::Tensor attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                     double scale) {
    if (step.fn == nullptr) {
        static const auto python = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("vmkv::cache_attention", "")
                                       .typed<at::Tensor(const at::Tensor &, const at::Tensor &,
                                                         const at::Tensor &, int64_t, double)>();
        return python.call(q, k, v, layer, scale);
    }
    const int64_t layers = static_cast<int64_t>(step.k_bases.size());
    TORCH_CHECK_INDEX(0 <= layer && layer < layers, "layer ", layer, " is outside [0, ", layers, ")");
    const std::vector<int64_t> kv_shape{step.tokens, step.kv_heads, step.head_dim};
    TORCH_CHECK_VALUE(k.sizes().equals(kv_shape) && v.sizes().equals(kv_shape), "k and v must be ",
                      c10::IntArrayRef(kv_shape), ", got ", k.sizes(), " and ", v.sizes());
    const std::vector<int64_t> q_shape{step.tokens, step.q_heads, step.head_dim};
    TORCH_CHECK_VALUE(q.sizes().equals(q_shape), "q must be ", c10::IntArrayRef(q_shape), ", got ",
                      q.sizes());
    const bool dtypes = q.scalar_type() == step.dtype && k.scalar_type() == step.dtype &&
                        v.scalar_type() == step.dtype;
    TORCH_CHECK_TYPE(dtypes, "q, k and v must be ", step.dtype, ", got ", q.scalar_type(), ", ",
                     k.scalar_type(), ", ", v.scalar_type());
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    const int status = step.fn(step.plan, qc.data_ptr(), reinterpret_cast<void *>(step.k_bases[layer]),
                               reinterpret_cast<void *>(step.v_bases[layer]), out.data_ptr(),
                               static_cast<float>(scale), static_cast<int>(step.threads), kc.data_ptr(),
                               vc.data_ptr());
    TORCH_CHECK(status == 0, "the CPU decode kernel could not allocate its work list");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vmkv, m) {
    m.def("set_kernel_step(int fn, int plan, int[] k_bases, int[] v_bases, int tokens, int q_heads, "
          "int kv_heads, int head_dim, ScalarType dtype, int threads) -> ()",
          &set_kernel_step);
    m.def("clear_kernel_step() -> ()", &clear_kernel_step);
}
TORCH_LIBRARY_IMPL(vmkv, CPU, m) { m.impl("attention", &attention); }
"""
_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared")


@cache
def load() -> bool:
    """Build (first use, ~10 s; cached on disk) and load the operator, once per process; False,
    after a warning saying why, where it cannot be: the Python implementation then serves."""
    try:
        torch.ops.load_library(str(build_torch_library("native_attention", SOURCE, _FLAGS)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("native attention op unavailable, attention runs through Python: %s", build_failure(e))
        return False
    return True


@contextmanager
def kernel_step_scope(step: KernelStep) -> Iterator[None]:
    """Around one step's forward on this thread: every layer's `vmkv::attention` runs `step`."""
    kernel = step.kernel
    torch.ops.vmkv.set_kernel_step(
        step.function_address,
        step.plan_address,
        step.k_bases,
        step.v_bases,
        step.num_tokens,
        step.num_kv_heads * kernel.group,
        step.num_kv_heads,
        kernel.head_dim,
        kernel.dtype,
        torch.get_num_threads(),
    )
    try:
        yield
    finally:
        torch.ops.vmkv.clear_kernel_step()
