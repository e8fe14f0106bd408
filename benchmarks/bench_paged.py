"""Paged decode attention per layer, against context length, batch and block size, with the
vAttention layout's figure from the same run next to it.

Every configuration builds its caches once, then runs rounds in which each path attends the
same decode step once (A B A B ...), so that drift on a shared machine hits all columns
alike; the table shows medians in milliseconds per layer call (Python overhead included:
the engine makes one such call per layer per step). The model shape is SmolLM2-135M's
(3 KV heads, 9 query heads, head_dim 64, bf16).

    python benchmarks/bench_paged.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from vmkv.paging import PagedKVCache
from vmkv.paging.attention import BatchedAttention, PagedAttentionPath, ReferenceAttention

from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch

try:
    from vmkv.vattention import VAttentionKVCache
except ImportError:
    VAttentionKVCache = None

KV_HEADS, Q_HEADS, HEAD_DIM, DTYPE = 3, 9, 64, torch.bfloat16
SCALE = HEAD_DIM**-0.5
PATHS: dict[str, Callable[[], PagedAttentionPath]] = {
    "paged reference": ReferenceAttention,
    "paged torch": lambda: BatchedAttention(use_kernel=False),
    "paged cpu_kernel": lambda: BatchedAttention(use_kernel=True, require_kernel=True),
}


def shape() -> KVShape:
    # two layers, layer 0 timed: the last layer's call also records computed blocks
    return KVShape(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE)


def decode_step(cache: KVCache, lens: list[int], shuffle: bool) -> StepBatch:
    """Admit one sequence per context length and grow it by one token: a decode step."""
    if shuffle and isinstance(cache, PagedKVCache):
        cache.pool.scatter(0)  # blocks scattered as after a long run without run-keeping
    for i, n in enumerate(lens):
        cache.admit(i, list(range(1000 * i, 1000 * i + n - 1)))
        cache.grow(i, [7])
    return StepBatch.build([SeqStep(i, n - 1, 1) for i, n in enumerate(lens)])


def make_runners(
    lens: list[int], block_size: int, paths: list[str]
) -> tuple[dict[str, Callable[[], None]], list[KVCache]]:
    """One callable per column, each doing one layer-0 attend of the same decode step, and the
    caches to close afterwards."""
    budget = (sum(lens) + block_size * len(lens)) * shape().bytes_per_token
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(lens), Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    kv = torch.randn(len(lens), KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    runners: dict[str, Callable[[], None]] = {}
    paged = PagedKVCache(shape(), max(lens), budget, block_size=block_size, enable_prefix_caching=False)
    paged.kv.normal_()
    batch = decode_step(paged, lens, shuffle=True)
    for name in (p for p in paths if p in PATHS):
        paged.attention = PATHS[name]()
        plan = paged.prepare(batch)
        runners[name] = lambda plan=plan, path=paged.attention: _attend(paged, path, plan, q, kv)
    caches: list[KVCache] = [paged]
    if "vattention" in paths:
        va = VAttentionKVCache(shape(), max(lens), 2 * budget + (64 << 20))
        va_plan = va.prepare(decode_step(va, lens, shuffle=False))
        runners["vattention"] = lambda: va.attend(0, q, kv, kv, va_plan, SCALE)
        caches.append(va)
    return runners, caches


def _attend(cache: PagedKVCache, path: PagedAttentionPath, plan: object, q, kv) -> None:
    cache.attention = path
    cache.attend(0, q, kv, kv, plan, SCALE)


def measure(lens: list[int], block_size: int, paths: list[str], rounds: int) -> dict[str, float]:
    runners, caches = make_runners(lens, block_size, paths)
    try:
        return interleaved_medians(runners, rounds)
    finally:
        for cache in caches:
            cache.close()


def interleaved_medians(runners: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    for run in runners.values():  # warm-up (first calls build the kernel, fault pages in)
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def columns() -> list[str]:
    cols = list(PATHS)
    if VAttentionKVCache is not None:
        cols.append("vattention")
    return cols


def sweep_context_batch(contexts: list[int], batches: list[int], rounds: int) -> None:
    cols = columns()
    rows = []
    for b in batches:
        for n in contexts:
            paths = cols if b * n <= 64 * 2048 else [c for c in cols if c != "paged reference"]
            med = measure([n] * b, 16, paths, rounds)
            rows.append([str(b), str(n), *(f"{med[c]:.3f}" if c in med else "-" for c in cols)])
    table("Decode attention per layer call (ms), block size 16", ["batch", "context", *cols], rows)


def sweep_block_size(block_sizes: list[int], batch: int, context: int, rounds: int) -> None:
    cols = [c for c in columns() if c != "paged reference"]
    rows = []
    for bs in block_sizes:
        med = measure([context] * batch, bs, cols, rounds)
        rows.append([str(bs), *(f"{med[c]:.3f}" for c in cols)])
    title = f"Block size, batch {batch}, context {context} (ms per layer call; vattention has no blocks)"
    table(title, ["block size", *cols], rows)


def engine_step(rounds: int) -> None:
    """The engine's hot case: 64 decoding sequences of 256-384 tokens, one call per layer."""
    rng = random.Random(1)
    lens = [rng.randint(256, 384) for _ in range(64)]
    cols = columns()
    med = measure(lens, 16, cols, rounds)
    rows = [[c, f"{med[c]:.3f}", f"{30 * med[c]:.1f}"] for c in cols]
    table(
        "Engine-shaped step: 64 sequences, 256-384 tokens", ["path", "ms per layer", "ms per 30 layers"], rows
    )


def layout_gather(rounds: int) -> None:
    """Why blocks are token-major: the torch path gathers per-(token, head) rows from them into
    SDPA's head-major layout about as fast as whole blocks gather from a head-major pool."""
    b, n, bs = 64, 320, 16
    nblk = n // bs
    num_blocks = b * nblk
    gen = torch.Generator().manual_seed(0)
    tm = torch.randn(num_blocks, bs, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    hm = tm.transpose(1, 2).contiguous()
    table_ = torch.randperm(num_blocks, generator=gen).view(b, nblk)
    q = torch.randn(b, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    slots = (table_[:, :, None] * bs + torch.arange(bs)).flatten(1)
    rows = (slots[:, None, :] * KV_HEADS + torch.arange(KV_HEADS)[None, :, None]).flatten()
    head_blocks = (table_[:, None, :] * KV_HEADS + torch.arange(KV_HEADS)[None, :, None]).flatten()

    def token_major_rows() -> None:
        k = tm.view(-1, HEAD_DIM).index_select(0, rows).view(b, KV_HEADS, n, HEAD_DIM)
        F.scaled_dot_product_attention(q, k, k, scale=SCALE)

    def token_major_blocks() -> None:
        k = tm.index_select(0, table_.flatten()).view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        F.scaled_dot_product_attention(q, k, k, scale=SCALE)

    def head_major_blocks() -> None:
        k = hm.view(-1, bs, HEAD_DIM).index_select(0, head_blocks).view(b, KV_HEADS, n, HEAD_DIM)
        F.scaled_dot_product_attention(q, k, k, scale=SCALE)

    runners = {
        "token-major, row gather": token_major_rows,
        "token-major, block gather + transposed view": token_major_blocks,
        "head-major, block gather": head_major_blocks,
    }
    med = interleaved_medians(runners, rounds)
    rows_ = [[name, f"{t:.3f}"] for name, t in med.items()]
    table(f"Layout for gather + SDPA (batch {b}, context {n}, K gathered twice)", ["layout", "ms"], rows_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short sweep (about a minute)")
    args = parser.parse_args()
    rounds = 7 if args.quick else 15
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} interleaved rounds")
    if VAttentionKVCache is None:
        print("vattention layout unavailable (vmkv.vattention not importable): its column is left out")
    if args.quick:
        sweep_context_batch([128, 512, 2048], [1, 16, 64], rounds)
        sweep_block_size([16, 32, 64, 128, 256], 16, 1024, rounds)
    else:
        sweep_context_batch([128, 512, 2048, 8192], [1, 4, 16, 64], rounds)
        sweep_block_size([16, 32, 64, 128, 256], 64, 1024, rounds)
    engine_step(rounds)
    layout_gather(rounds)


if __name__ == "__main__":
    main()
