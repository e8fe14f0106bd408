"""Data parallelism on one machine: prefix-aware routing against round-robin, and two
one-thread replicas against one engine with every core.

    python benchmarks/bench_data_parallel.py                       # default model, 2 rounds
    python benchmarks/bench_data_parallel.py --tenants 8 --requests 64 --rounds 3

The workload: `tenants` system prompts of `prefix_len` random tokens, each request one of
them (in a shuffled order) plus its own short question, all submitted at once through the
async front end (no HTTP). Per target it reports the prefix-cache hit rate (prompt tokens
found cached / looked up, summed over replicas) and output tokens per second. Targets run
in turn each round (A B C A B C) and each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable

from vmkv.engine import AsyncProcessLLM, DataParallelLLM, EngineConfig, SamplingParams
from vmkv.engine.args import auto_dtype


def workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 30000) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    prompts = [
        systems[i % args.tenants] + [rng.randrange(100, 30000) for _ in range(args.question_len)]
        for i in range(args.requests)
    ]
    rng.shuffle(prompts)
    return prompts


async def serve_all(llm: AsyncProcessLLM | DataParallelLLM, prompts: list[list[int]], output_len: int) -> int:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        outputs = [out async for out in llm.generate(prompt, params)]
        return len(outputs[-1].outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def measure(
    build: Callable[[], AsyncProcessLLM | DataParallelLLM], prompts: list[list[int]], output_len: int
) -> dict:
    llm = build()
    try:
        start = time.perf_counter()
        tokens = asyncio.run(serve_all(llm, prompts, output_len))
        seconds = time.perf_counter() - start
        stats = llm.stats()
    finally:
        llm.shutdown()
    return {
        "tok_s": tokens / seconds,
        "hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--kv-mode", default="paged")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU multiplies it natively")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    config = EngineConfig(model=args.model, kv_mode=args.kv_mode, dtype=dtype, max_num_seqs=64)
    targets: dict[str, Callable[[], AsyncProcessLLM | DataParallelLLM]] = {
        "DP=1, all cores": lambda: AsyncProcessLLM(config),
        "DP=2, prefix routing": lambda: DataParallelLLM(config, 2, "prefix"),
        "DP=2, round-robin": lambda: DataParallelLLM(config, 2, "round-robin"),
    }
    results: dict[str, list[dict]] = {name: [] for name in targets}
    for round_index in range(args.rounds):
        prompts = workload(args, seed=round_index)
        for name, build in targets.items():
            results[name].append(measure(build, prompts, args.output_len))
            print(f"[round {round_index}] {name}: {results[name][-1]}", flush=True)
    print(
        f"\n{args.requests} requests over {args.tenants} system prompts of {args.prefix_len} tokens, "
        f"{args.question_len}-token questions, {args.output_len} output tokens, {args.kv_mode}, "
        f"medians of {args.rounds} rounds\n"
    )
    print("| target | prefix-cache hit rate | output tok/s |")
    print("|---|---|---|")
    for name, runs in results.items():
        hit = statistics.median(r["hit_rate"] for r in runs)
        tok_s = statistics.median(r["tok_s"] for r in runs)
        print(f"| {name} | {hit:.1%} | {tok_s:.1f} |")


if __name__ == "__main__":
    main()
