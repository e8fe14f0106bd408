"""The GEMM paths cpu_linear.py chooses between, on this machine, A B A B, medians:

1. one bf16 Linear through torch's bf16 GEMM (native with AVX512-BF16/AMX, a generic fallback
   without) against the fp32 GEMM of the same values;
2. the default model's linears as a step runs them: 30 layers of its weight shapes (q/k/v and
   gate/up fused, as cpu_linear.py groups them) and the vocabulary projection, from memory (the
   ~270 MB of bf16 weights; the projection on at most 64 rows, those a step samples), through
   `vmkv::packed_linear` with each packing this CPU offers:
   "pairs" (vmkv's GEMM), "onednn" (oneDNN's prepacked GEMM, the GEMV up to its row limit) and
   "fp32";
3. the peak of the instruction those GEMMs multiply with on this CPU (`vdpbf16ps` with
   AVX512-BF16, else 256-bit fp32 FMAs), on every thread: independent chains of it and nothing
   else. The model table's GFLOP/s read against it say how far the GEMMs are from this CPU's
   ceiling, not from another machine's.

The figures quoted in cpu_linear.py and docs/engine.md come from this script, with the CPU they
ran on.

    python benchmarks/bench_gemm.py [--rows 1 64 512] [--model-rows 1 4 12 16 32 64 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from vmkv.engine import gemv_kernel
from vmkv.engine.cpu_linear import has_native_half_gemm, pack_linears, packed_logits
from vmkv.native_build import load_c_function

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M's MLP up-projection
# the default model's linears per layer as cpu_linear.py runs them: (out, in) features
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
LAYERS, VOCAB = 30, 49152
SAMPLED_ROWS = 64  # the vocabulary projection's rows: one per sequence sampled (a prefill samples one)

# CHAINS independent accumulators, each updated once per iteration: enough to cover the
# instruction's latency times its issue rate (vdpbf16ps: 6 cycles x 1 or 2 a cycle). The empty asm
# statement claims to change every accumulator, so the compiler can neither merge identical
# chains nor drop any (without it GCC folded 12 chains into 7, and the peak read 1.7x too high).
PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#define CHAINS 12
#ifdef __AVX512BF16__
typedef __m512 acc_t;
#define FLOPS_PER_OP 64.0 /* 16 lanes x 2 bf16 products, each a multiply and an add */
#define ZERO(i) _mm512_set1_ps(1e-3f * (i))
#define STEP(a) a = _mm512_dpbf16_ps(a, x, y)
#define SETUP const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = x
#define LANE0(a) _mm512_cvtss_f32(a)
#else
typedef __m256 acc_t;
#define FLOPS_PER_OP 16.0 /* 8 lanes, a multiply and an add */
#define ZERO(i) _mm256_set1_ps(1e-3f * (i))
#define STEP(a) a = _mm256_fmadd_ps(a, x, y)
#define SETUP const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f)
#define LANE0(a) _mm256_cvtss_f32(a)
#endif

/* flops done by `threads` threads each running `iterations` x CHAINS instructions; *sink keeps
   the results alive. */
double peak_flops(long iterations, int threads, float *sink) {
    float total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        SETUP;
        acc_t a0 = ZERO(0), a1 = ZERO(1), a2 = ZERO(2), a3 = ZERO(3), a4 = ZERO(4), a5 = ZERO(5);
        acc_t a6 = ZERO(6), a7 = ZERO(7), a8 = ZERO(8), a9 = ZERO(9), a10 = ZERO(10), a11 = ZERO(11);
        for (long i = 0; i < iterations; i++) {
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
            STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        total += LANE0(a0) + LANE0(a1) + LANE0(a2) + LANE0(a3) + LANE0(a4) + LANE0(a5) + LANE0(a6)
                 + LANE0(a7) + LANE0(a8) + LANE0(a9) + LANE0(a10) + LANE0(a11);
    }
    *sink = total;
    return (double)iterations * CHAINS * FLOPS_PER_OP * threads;
}
"""


def median_ms(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        fn()  # warm
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def model_linears(packing: str) -> tuple[list[torch.nn.Linear], torch.nn.Linear]:
    gen = torch.Generator().manual_seed(0)

    def linear(out_features: int, in_features: int) -> torch.nn.Linear:
        module = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
        module.weight.data = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        return module

    layers = torch.nn.ModuleList(linear(*shape) for _ in range(LAYERS) for shape in LAYER_SHAPES)
    lm_head = linear(VOCAB, HIDDEN)
    pack_linears(torch.nn.ModuleList([*layers, lm_head]), packing)
    return list(layers), lm_head


def peak_gflops(rounds: int) -> float | None:
    """This CPU's peak GFLOP/s in the GEMMs' instruction on torch's threads: the best of rounds of
    ~0.15 s, since a shared machine's other tenants only ever slow a round; None where the probe
    cannot be built."""
    flags = ["-O2", "-march=native", "-fopenmp", "-fPIC", "-shared"]
    argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    probe = load_c_function(
        "gemm_peak",
        PEAK_SOURCE,
        flags,
        "GEMM peak probe unavailable",
        "peak_flops",
        ctypes.c_double,
        argtypes,
    )
    if probe is None:
        return None
    sink, threads, iterations = ctypes.c_float(), torch.get_num_threads(), 40_000_000
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        flops = probe(iterations, threads, ctypes.byref(sink))
        rates.append(flops / (time.perf_counter() - start) / 1e9)
    return max(rates)


def probed_packings() -> set[str]:
    """The packings whose GEMM multiplies with the instruction peak_gflops probes here."""
    return {"pairs", "onednn"} if torch.cpu._is_avx512_bf16_supported() else {"fp32"}


def packings() -> list[str]:
    """The packings linear_packing can give a bf16 model on this CPU."""
    native = has_native_half_gemm(torch.bfloat16)
    return [*(["pairs"] if gemv_kernel.pairs_gemm() else []), *(["onednn"] if native else []), "fp32"]


@torch.inference_mode()
def model_table(rows_list: list[int], rounds: int, peak: float | None) -> None:
    names = packings()
    models = {name: model_linears(name) for name in names}
    layer_flops, logit_flops = 2 * LAYERS * sum(o * i for o, i in LAYER_SHAPES), 2 * VOCAB * HIDDEN
    print(f"\nThe default model's linears and vocabulary projection, one step's calls ({LAYERS} layers):")
    for rows in rows_list:
        x = {i: torch.randn(rows, i).to(torch.bfloat16) for i in (HIDDEN, INTERMEDIATE)}

        def step(layers: list[torch.nn.Linear], lm_head: torch.nn.Linear, x: dict = x) -> None:
            for module in layers:
                module(x[module.in_features])
            packed_logits(lm_head, x[HIDDEN][:SAMPLED_ROWS])

        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                start = time.perf_counter()
                step(*models[name])
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        flops = layer_flops * rows + logit_flops * min(rows, SAMPLED_ROWS)
        cells = [
            f"{name} {t:7.2f} ms ({flops / t / 1e6:4.0f} GFLOP/s"
            + (f", {flops / t / 1e6 / peak:.0%} of peak)" if peak and name in probed_packings() else ")")
            for name, t in ms.items()
        ]
        if len(names) > 1:
            cells.append(f"{names[0]} / {names[1]} = {ms[names[0]] / ms[names[1]]:.2f}")
        print(f"{rows:5d} rows: " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--model-rows", type=int, nargs="+", default=[1, 4, 12, 16, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"native bf16 GEMM: {has_native_half_gemm(torch.bfloat16)}, {torch.get_num_threads()} threads")
    peak = peak_gflops(args.rounds)
    if peak is not None:
        instruction = "vdpbf16ps" if torch.cpu._is_avx512_bf16_supported() else "256-bit fp32 FMA"
        used_by = ", ".join(sorted(probed_packings()))
        threads = torch.get_num_threads()
        print(f"peak of {instruction} on {threads} threads: {peak:.0f} GFLOP/s (used by {used_by})")
    weight = torch.randn(INTERMEDIATE, HIDDEN).to(torch.bfloat16)
    weight32 = weight.float()
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        bf16 = median_ms(lambda x=x: torch.nn.functional.linear(x, weight), args.rounds)
        fp32 = median_ms(
            lambda x=x: torch.nn.functional.linear(x.float(), weight32).to(torch.bfloat16), args.rounds
        )
        print(
            f"[{rows}, {HIDDEN}] x [{HIDDEN}, {INTERMEDIATE}]: bf16 {bf16:7.3f} ms, fp32 of the same values "
            f"{fp32:7.3f} ms (bf16 / fp32 = {bf16 / fp32:.2f})"
        )
    model_table(args.model_rows, args.rounds, peak)


if __name__ == "__main__":
    main()
