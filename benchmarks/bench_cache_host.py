"""The KV cache's host work per step, per layout, with no model: what the step thread spends in
admit, grow, prepare, finish_step and free, and what vattention's mapper thread spends beside it.

Each wave is the at-once serving workload's bookkeeping (64 prompts of 256 tokens admitted 8 per
step, then 127 decode steps of one token each, then every sequence freed) in a 1 GiB cache of
SmolLM2-135M's KV shape (bf16) with prefix caching on. Waves follow each other in the same cache,
so from the second on it is full of kept pages and cached chunks, as a server's is: new pages
then come from reclaiming them. A short sleep per step stands for the model's compute, which
the mapper overlaps. Layouts interleave wave by wave; the table shows medians of the waves after
the first.

    python benchmarks/bench_cache_host.py [--waves 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from vmkv.paging import PagedKVCache

from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

SMOL = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
BUDGET, MAX_LEN = 1 << 30, 2048
SEQS, PROMPT, DECODES, PER_STEP = 64, 256, 127, 8
COMPUTE_S = 0.02  # stands for the model's step (~75 ms at batch 64 here), which the mapper overlaps


def make(kind: str) -> KVCache:
    if kind == "paged":
        return PagedKVCache(SMOL, MAX_LEN, BUDGET, block_size=16, enable_prefix_caching=True, model_id="m")
    order = kind.split()[-1]
    return VAttentionKVCache(SMOL, MAX_LEN, BUDGET, model_id="m", prefix_caching=True, order=order)


def mapper_cpu(cache: KVCache) -> float:
    return cache.stats().mapper_cpu_seconds or 0.0  # None: a layout without a mapper


def wave(cache: KVCache, first_id: int, rng: random.Random) -> dict[str, float]:
    """One wave's step-thread seconds (the sleeps left out) and the mapper's CPU seconds."""
    ids = range(first_id, first_id + SEQS)
    prompts = {i: [rng.randrange(100, 40_000) for _ in range(PROMPT)] for i in ids}
    cpu = mapper_cpu(cache)
    start = time.perf_counter()
    for k in range(0, SEQS, PER_STEP):
        group = ids[k : k + PER_STEP]
        for i in group:
            cache.admit(i, prompts[i])
        cache.finish_step(cache.prepare(StepBatch.build([SeqStep(i, 0, PROMPT) for i in group])))
        time.sleep(COMPUTE_S)
    for step in range(DECODES):
        for i in ids:
            cache.grow(i, [rng.randrange(100, 40_000)])
        cache.finish_step(cache.prepare(StepBatch.build([SeqStep(i, PROMPT + step, 1) for i in ids])))
        time.sleep(COMPUTE_S)
    for i in ids:
        cache.free(i)
    steps = SEQS // PER_STEP + DECODES
    return {"step": time.perf_counter() - start - steps * COMPUTE_S, "mapper": mapper_cpu(cache) - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=5)
    args = parser.parse_args()
    kinds = ["paged", "vattention packed", "vattention head"]
    caches = {k: make(k) for k in kinds}
    rng = random.Random(0)
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    try:
        for w in range(args.waves):
            for k in kinds if w % 2 == 0 else kinds[::-1]:
                samples[k].append(wave(caches[k], w * SEQS, rng))
    finally:
        for c in caches.values():
            c.close()
    steps = SEQS // PER_STEP + DECODES
    print(f"{SEQS} x {PROMPT}/{DECODES + 1} per wave, {steps} steps; medians of waves 2..{args.waves}\n")
    print("| layout | step thread, ms per step | mapper thread CPU, ms per step | first wave, step thread |")
    print("|---|---:|---:|---:|")
    for k in kinds:
        later = samples[k][1:] or samples[k]
        step = statistics.median(s["step"] for s in later) / steps * 1e3
        mapper = statistics.median(s["mapper"] for s in later) / steps * 1e3
        print(f"| {k} | {step:.2f} | {mapper:.2f} | {samples[k][0]['step'] / steps * 1e3:.2f} |")


if __name__ == "__main__":
    main()
