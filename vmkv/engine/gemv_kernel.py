"""`vmkv::packed_linear`, a half-precision CPU linear as one C++ torch operator, with a bf16
matrix-vector kernel for decode steps of a few rows on CPUs with AVX512-BF16.

At one to a few rows a linear layer is a pass over its weight, so its speed is the memory
bandwidth it reaches. oneDNN (prepacked) read a [1536, 576] bf16 weight at 12 GB/s on one
core of an AVX512-BF16 EPYC whose plain sum reads 18 GB/s. The kernel streams the original
row-major weight once, one row at a time: `vdpbf16ps` on the raw bf16 values into fp32
sums, the bias added in fp32, one round-to-nearest-even to bf16, so it computes what a bf16
GEMM computes, summed in another order (0.07% of outputs one bf16 step apart from torch's
in a [1536, 576] test). Output columns are split over torch's threads. More rows go to
oneDNN's GEMM on the weight prepacked at load.

Why C++ and not a Python function: a decode step of the default model makes 210 linear
calls. Through a Python `torch.library.custom_op` each cost ~20 µs beyond the kernel
(~4 ms of a ~21 ms step); registered in C++ the dispatcher reaches the kernel in ~3 µs,
eager or compiled (inductor calls the operator from its generated code).

Built with the system C++ compiler against torch's headers (~10 s) on first use and cached
per source, flags and torch version (vmkv/native_build.py).
Where it cannot be built or the CPU lacks AVX512-BF16, `register()` defines the same
operator in Python over oneDNN alone, so callers never see the difference.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path

import torch

from vmkv.native_build import build_failure, build_library

log = logging.getLogger(__name__)

MAX_ROWS = 4  # more rows than this reuse a weight enough for oneDNN's blocked GEMM to win
SCHEMA = "packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias) -> Tensor"
_FLAGS = (
    "-O3",
    "-std=c++17",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

constexpr int64_t MAX_ROWS = 4;
constexpr int64_t BLOCK = 16; /* output columns per work item: one masked 16-lane bf16 store */

inline __m512 dot(const uint16_t *x, const uint16_t *w, int64_t k_len) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_len; k += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32),
                              (__m512bh)_mm512_loadu_si512(w + k + 32));
    }
    if (k < k_len) /* k_len is a multiple of 32 */
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    return _mm512_add_ps(a0, a1);
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for m < rows; w row-major [n_len, k_len]. */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t rows,
               int64_t n_len, int64_t k_len, int64_t x_stride) {
    at::parallel_for(0, (n_len + BLOCK - 1) / BLOCK, 1, [&](int64_t begin, int64_t end) {
        for (int64_t block = begin; block < end; block++) {
            int64_t n0 = block * BLOCK;
            int64_t width = n_len - n0 < BLOCK ? n_len - n0 : BLOCK;
            __mmask16 mask = (__mmask16)((1u << width) - 1);
            __m512 b = _mm512_setzero_ps();
            if (bias)
                b = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
            for (int64_t m = 0; m < rows; m++) { /* later rows find this block of w in cache */
                float sums[BLOCK] = {0};
                for (int64_t j = 0; j < width; j++)
                    sums[j] = _mm512_reduce_add_ps(dot(x + m * x_stride, w + (n0 + j) * k_len, k_len));
                __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums), b);
                _mm256_mask_storeu_epi16(y + m * n_len + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    });
}

using OptionalTensor = std::optional<at::Tensor>;
using Scalars = c10::List<std::optional<at::Scalar>>;

at::Tensor onednn_linear(const at::Tensor &x, const at::Tensor &packed, const OptionalTensor &bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const OptionalTensor &,
                                           c10::string_view, Scalars, std::optional<c10::string_view>)>();
    return op.call(x, packed, bias, "none", Scalars(), std::nullopt);
}

bool gemv_takes(const at::Tensor &x, const at::Tensor &weight, const OptionalTensor &bias) {
    const int64_t k_len = x.size(-1);
    return x.numel() <= MAX_ROWS * k_len && k_len % 32 == 0 && x.scalar_type() == at::kBFloat16 &&
           weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
           (!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()));
}

/* x [..., K] (any strides) @ weight [N, K].T (+ bias) -> [..., N] */
at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &packed,
                         const OptionalTensor &bias) {
    if (!gemv_takes(x, weight, bias)) return onednn_linear(x, packed, bias);
    const int64_t k_len = x.size(-1), n_len = weight.size(0);
    at::Tensor rows = x.reshape({-1, k_len});
    if (rows.size(0) > 1 && rows.stride(1) != 1) rows = rows.contiguous();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n_len;
    at::Tensor out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
    gemv_bf16(static_cast<const uint16_t *>(rows.const_data_ptr()),
              static_cast<const uint16_t *>(weight.const_data_ptr()),
              bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr,
              static_cast<uint16_t *>(out.mutable_data_ptr()), rows.size(0), n_len, k_len,
              rows.size(0) > 1 ? rows.stride(0) : k_len);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vmkv, m) { m.def("SCHEMA"); }
TORCH_LIBRARY_IMPL(vmkv, CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }
""".replace("SCHEMA", SCHEMA)


_LIBRARIES: list[torch.library.Library] = []


@cache
def register() -> bool:
    """Define `vmkv::packed_linear`, once per process; True if the C++ kernel backs it, False
    if the Python fallback (oneDNN for every row count) does."""
    native = torch.cpu._is_avx512_bf16_supported() and _load_native()
    if not native:
        library = torch.library.Library("vmkv", "FRAGMENT")
        library.define(SCHEMA)
        library.impl("packed_linear", _onednn_linear, "CompositeExplicitAutograd")
        _LIBRARIES.append(library)  # the registration lives as long as the Library object
    torch.library.register_fake("vmkv::packed_linear")(_fake)
    return native


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fake(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _load_native() -> bool:
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("bf16 GEMV kernel unavailable, decode linears use oneDNN: %s", build_failure(e))
        return False
    return True


def _compile_command(source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension  # ~120 ms to import; only a build needs it

    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise FileNotFoundError("no C++ compiler found (install one or set CXX)")
    torch_lib = Path(torch.__file__).parent / "lib"
    return [
        compiler,
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        "-o",
        str(target),
        str(source),
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
    ]


def _build() -> Path:
    """Compile the source, or reuse an earlier build of the same source, flags and torch."""
    depends_on = [" ".join(_FLAGS), torch.__version__]
    return build_library("packed_linear", SOURCE, ".cpp", depends_on, _compile_command)
