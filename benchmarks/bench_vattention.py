"""Benchmark the vattention layout (a script, not a test).

    python benchmarks/bench_vattention.py [--quick]

1. decode attention time per layer against context length and batch, for the token- and
   head-major orders, the contiguous baseline and per-sequence calls (no batching);
2. map overhead per step in an engine-like decode loop (SmolLM2-135M shapes, sequences
   finishing and arriving), background mapper and deferred reclamation on and off;
3. page size 64 KiB vs 2 MiB and token- vs head-major in the same loop;
4. how many mappings (VMAs) a large configuration needs, against vm.max_map_count.

Comparisons run A B A B (configurations interleaved, several rounds) and report medians.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from vmkv.contiguous import ContiguousKVCache
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

SMOL = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
Q_HEADS = 9
SCALE = 1 / math.sqrt(64)
KIB, MIB = 1 << 10, 1 << 20


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """A B A B: every round runs each configuration once, alternating the order; medians."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(runs[name]())
    return {name: statistics.median(v) for name, v in samples.items()}


def count_vmas(cache: VAttentionKVCache) -> int:
    """Read-write mappings (VMAs) inside the cache's reservations."""
    ranges = sorted({(r.base, r.end) for r, _ in cache.mapping.placed})
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start = int(span.split("-")[0], 16)
            if perms.startswith("rw") and any(a <= start < b for a, b in ranges):
                count += 1
    return count


# ------------------------------------------------------------- 1. attention
def decode_cache(kind: str, batch: int, context: int) -> KVCache:
    """One layer's cache with `batch` sequences of `context` tokens; per-sequence = head-major, unbatched."""
    shape = KVShape(1, SMOL.num_kv_heads, SMOL.head_dim, SMOL.dtype)
    max_len = context + 1
    head_major_pages = 2 * shape.num_kv_heads * -(-max_len * shape.head_dim * 2 // (64 * KIB))  # the coarsest
    budget = int(batch * head_major_pages * 64 * KIB * 1.1) + 8 * MIB
    if kind == "contiguous":
        cache = ContiguousKVCache(shape, max_len, budget)
    else:
        order = "token" if kind == "token-major" else "head"
        padding = 0.0 if kind == "per-sequence" else 1.5
        cache = VAttentionKVCache(
            shape,
            max_len,
            budget,
            order=order,
            max_padding=padding,
            background_mapping=False,
            max_slots=batch,
        )
    for i in range(batch):
        cache.admit(i, [0] * context)
    return cache


def attend_timer(cache: KVCache, plan: object, q: torch.Tensor, kv: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        cache.attend(0, q, kv, kv, plan, SCALE)
        return (time.perf_counter() - t0) * 1e3

    return run


def bench_attention(contexts: list[int], batches: list[int], rounds: int) -> str:
    kinds = ["token-major", "head-major", "contiguous", "per-sequence"]
    rows = []
    for context in contexts:
        for batch in batches:
            caches = {k: decode_cache(k, batch, context) for k in kinds}
            steps = [SeqStep(i, context - 1, 1) for i in range(batch)]
            plans = {k: c.prepare(StepBatch.build(steps)) for k, c in caches.items()}
            q = torch.randn(batch, Q_HEADS, SMOL.head_dim, dtype=SMOL.dtype)
            kv = torch.randn(batch, SMOL.num_kv_heads, SMOL.head_dim, dtype=SMOL.dtype)
            runs = {k: attend_timer(caches[k], plans[k], q, kv) for k in kinds}
            for run in runs.values():  # warm up: kernel init, first touch
                run()
            med = interleaved(runs, rounds)
            rows.append([context, batch] + [f"{med[k]:.2f}" for k in kinds])
            for c in caches.values():
                c.close()
    return table(["context", "batch"] + [f"{k} ms" for k in kinds], rows)


# ------------------------------------------------------- 2./3. decode loop
def decode_loop(cache: VAttentionKVCache, num_seqs: int, steps: int, seed: int) -> dict[str, float]:
    """Continuous batching: prompts of 32-160 tokens, 32-200 new tokens each, finished sequences
    replaced by new ones. Times the cache's share of each step's critical path: admitting new
    prompts, and growing + preparing the running ones (what the background mapper targets)."""
    rng = random.Random(seed)
    lengths: dict[int, int] = {}  # seq -> tokens written
    budgets: dict[int, int] = {}
    next_id = 0
    admit_ms, step_ms = [], []
    first: dict[str, float] = {}
    for step in range(steps):
        t0 = time.perf_counter()
        batch = []
        while len(lengths) < num_seqs:
            prompt = rng.randint(32, 160)
            cache.admit(next_id, [0] * prompt)
            batch.append(SeqStep(next_id, 0, prompt))
            lengths[next_id], budgets[next_id] = 0, rng.randint(32, 200)
            next_id += 1
        t1 = time.perf_counter()
        for sid in lengths:
            if lengths[sid]:
                cache.grow(sid, [0])
                batch.append(SeqStep(sid, lengths[sid], 1))
        plan = cache.prepare(StepBatch.build(batch))
        admit_ms.append((t1 - t0) * 1e3)
        step_ms.append((time.perf_counter() - t1) * 1e3)
        tokens = sum(s.num_new for s in batch)
        q = torch.randn(tokens, Q_HEADS, SMOL.head_dim, dtype=SMOL.dtype)
        kv = torch.randn(tokens, SMOL.num_kv_heads, SMOL.head_dim, dtype=SMOL.dtype)
        for layer in range(SMOL.num_layers):
            cache.attend(layer, q, kv, kv, plan, SCALE)
        cache.finish_step(plan)
        for s in batch:
            lengths[s.seq_id] = s.context_len
            if s.num_new == 1:
                budgets[s.seq_id] -= 1
                if budgets[s.seq_id] == 0:
                    cache.free(s.seq_id)
                    del lengths[s.seq_id], budgets[s.seq_id]
        if step == 0:  # the first step's prompts could not have been mapped ahead: count from here
            first = cache.stats()
    c = cache.stats()
    later = steps - 1
    return {
        "step_ms": statistics.median(step_ms),
        "step_p90_ms": sorted(step_ms)[int(0.9 * len(step_ms))],
        "admit_ms": statistics.mean(admit_ms),
        "maps_critical": (c.map_calls_critical - first.map_calls_critical) / later,
        "maps_background": (c.map_calls_background - first.map_calls_background) / later,
        "faults": (c.minor_faults - first.minor_faults) / later,
        "frag_mib": cache.memory().fragmentation_bytes / MIB,
        "vmas": count_vmas(cache),
    }


def loop_runs(configs: dict[str, dict], num_seqs: int, steps: int, rounds: int) -> dict[str, dict]:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}

    def one(name: str) -> Callable[[], float]:
        def run() -> float:
            options = configs[name]
            page_set = (
                options.get("page_size", 64 * KIB)
                * 2
                * SMOL.num_layers
                * (SMOL.num_kv_heads if options.get("order") == "head" else 1)
            )
            budget = max(int(num_seqs * 400 * SMOL.bytes_per_token * 1.6), int(num_seqs * 1.25 * page_set))
            cache = VAttentionKVCache(SMOL, 1024, budget, max_slots=2 * num_seqs, **options)
            try:
                results[name].append(decode_loop(cache, num_seqs, steps, seed=len(results[name])))
            finally:
                cache.close()
            return 0.0

        return run

    interleaved({name: one(name) for name in configs}, rounds)
    return {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}


def loop_table(results: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            name,
            f"{r['step_ms']:.2f}",
            f"{r['step_p90_ms']:.2f}",
            f"{r['admit_ms']:.2f}",
            f"{r['maps_critical']:.1f}",
            f"{r['maps_background']:.1f}",
            f"{r['faults']:.0f}",
            f"{r['frag_mib']:.1f}",
            int(r["vmas"]),
        ]
        for name, r in results.items()
    ]
    return table(
        [
            "config",
            "grow+prepare ms (median)",
            "p90",
            "admit ms/step (mean)",
            "critical maps/step*",
            "background maps/step*",
            "minor faults/step*",
            "fragmentation MiB",
            "VMAs",
        ],
        rows,
    )


# ------------------------------------------------------------------ 4. VMAs
def bench_vmas(num_seqs: int, length: int) -> str:
    """Sequences grown one token at a time, round robin: the worst case for mapping merges."""
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    rows = []
    for order in ("token", "head"):
        budget = num_seqs * (length + 1024) * SMOL.bytes_per_token
        cache = VAttentionKVCache(
            SMOL,
            length + 512,
            budget,
            max_slots=num_seqs,
            background_mapping=False,
            populate=False,
            order=order,
        )
        try:
            for i in range(num_seqs):
                cache.admit(i, [0])
            for _ in range(length - 1):
                for i in range(num_seqs):
                    cache.grow(i, [0])
            rows.append(
                [
                    f"{order}-major",
                    f"{num_seqs} x {length}",
                    int(cache.stats().pages_mapped),
                    num_seqs * cache.geometry.units,
                    count_vmas(cache),
                    limit,
                ]
            )
        finally:
            cache.close()
    return table(
        [
            "order",
            "sequences x tokens",
            "pages mapped",
            "columns (slots x tensors x columns)",
            "VMAs",
            "vm.max_map_count",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small sweep that runs in a few minutes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        contexts, batches, rounds, seqs, steps, loop_rounds, vma = (
            [128, 512, 2048],
            [1, 16, 64],
            5,
            16,
            96,
            2,
            128,
        )
    else:
        contexts, batches, rounds, seqs, steps, loop_rounds, vma = (
            [128, 512, 2048, 8192],
            [1, 4, 16, 64],
            9,
            32,
            240,
            3,
            256,
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, SmolLM2-135M KV shapes (bf16)\n")
    print("## Decode attention per layer (ms, median)\n")
    print(bench_attention(contexts, batches, rounds), "\n")
    print(f"## Map overhead per step ({seqs} sequences, 30 layers, 64 KiB pages, token-major)\n")
    token = {"order": "token"}  # 170 tokens per page: decodes cross pages often enough to matter
    optim = {
        "mapper + deferred": token,
        "mapper only": {**token, "deferred_reclamation": False},
        "deferred only": {**token, "background_mapping": False},
        "neither": {**token, "background_mapping": False, "deferred_reclamation": False},
    }
    print(loop_table(loop_runs(optim, seqs, steps, loop_rounds)))
    print("\n\\* after the first step, whose prompts nothing could map ahead.\n")
    print("## Page size and order (mapper + deferred reclamation, pages faulted on first touch)\n")
    lazy = {"populate": False}  # 2 MiB pages pre-faulted would take GiBs for a few sequences
    pages = {
        "64 KiB token-major": {**lazy, "order": "token"},
        "64 KiB head-major": {**lazy, "order": "head"},
        "2 MiB token-major": {**lazy, "page_size": 2 * MIB, "order": "token"},
        "2 MiB head-major": {**lazy, "page_size": 2 * MIB, "order": "head"},
    }
    print(loop_table(loop_runs(pages, seqs, steps, loop_rounds)), "\n")
    print("## Mappings in a large configuration (64 KiB pages)\n")
    print(bench_vmas(vma, 1024))


if __name__ == "__main__":
    main()
