"""The GEMM paths cpu_linear.py chooses between, on this machine, A B A B, medians:

1. one bf16 Linear through torch's bf16 GEMM (native with AVX512-BF16/AMX, a generic fallback
   without) against the fp32 GEMM of the same values;
2. the default model's linears as a step runs them: 30 layers of its weight shapes (q/k/v and
   gate/up fused, as cpu_linear.py groups them) and the vocabulary projection, from memory (the
   ~270 MB of bf16 weights; the projection on at most 64 rows, those a step samples), through
   `vmkv::packed_linear` with each packing this CPU offers:
   "pairs" (vmkv's GEMM), "onednn" (oneDNN's prepacked GEMM, the GEMV up to its row limit) and
   "fp32".

The figures quoted in cpu_linear.py and docs/engine.md come from this script, with the CPU they
ran on.

    python benchmarks/bench_gemm.py [--rows 1 64 512] [--model-rows 1 4 12 16 32 64 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmkv.engine import gemv_kernel
from vmkv.engine.cpu_linear import has_native_half_gemm, pack_linears, packed_logits

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M's MLP up-projection
# the default model's linears per layer as cpu_linear.py runs them: (out, in) features
LAYER_SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
LAYERS, VOCAB = 30, 49152
SAMPLED_ROWS = 64  # the vocabulary projection's rows: one per sequence sampled (a prefill samples one)


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


def packings() -> list[str]:
    """The packings linear_packing can give a bf16 model on this CPU."""
    native = has_native_half_gemm(torch.bfloat16)
    return [*(["pairs"] if gemv_kernel.pairs_gemm() else []), *(["onednn"] if native else []), "fp32"]


@torch.inference_mode()
def model_table(rows_list: list[int], rounds: int) -> None:
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
        cells = [f"{name} {t:7.2f} ms ({flops / t / 1e6:4.0f} GFLOP/s)" for name, t in ms.items()]
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
    model_table(args.model_rows, args.rounds)


if __name__ == "__main__":
    main()
