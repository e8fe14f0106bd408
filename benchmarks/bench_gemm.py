"""The GEMM paths cpu_linear.py chooses between, on this machine: one bf16 Linear through torch's
bf16 GEMM (native with AVX512-BF16/AMX, a generic fallback without) against the fp32 GEMM of the
same values, A B A B, medians. The figures quoted in cpu_linear.py and docs/engine.md come from
this script, with the CPU they ran on.

    python benchmarks/bench_gemm.py [--rows 1 64 512] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmkv.engine.cpu_linear import has_native_half_gemm

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M's MLP up-projection


def median_ms(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        fn()  # warm
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"native bf16 GEMM: {has_native_half_gemm(torch.bfloat16)}, {torch.get_num_threads()} threads")
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


if __name__ == "__main__":
    main()
