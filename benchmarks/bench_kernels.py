"""Decode and prefill attention per layer on both layouts, against the memory roofline.

The roofline of a decode call is the K/V bytes it must read (batch x context x 768 B per
layer for SmolLM2-135M's 3 KV heads x 64 x bf16, K and V) divided by this machine's copy
bandwidth (2 x bytes / time of a 256 MiB tensor copy, the STREAM convention), measured in the
same rounds as the kernels. Every column runs once per round, rounds interleave (A B A B ...)
so drift on a shared machine hits all columns alike, and the tables show medians. A decode
sample attends as many layers in turn as read at least 96 MiB (so K/V comes from memory, not
from a cache that held the previous call's, as in an engine step), one `attend` call each
(Python overhead included: the engine makes one per layer per step), and is divided by that
number of layers. Columns:

- vattention kernel (head-/token-major/layer-packed): the CPU decode kernel on the virtual
  slots; layer-packed (vattention's default order) holds all 30 layers of a token together,
  so a layer's rows of consecutive tokens are 23 KB apart;
- vattention sdpa: stock SDPA on the same virtual memory (attention="sdpa", head-major);
- paged kernel / paged torch: the CPU decode kernel through the block table, and
  gather + SDPA (blocks scattered as after a long run: the pool's worst case);
- paged kernel, blocks in runs: the kernel on the pool's own placement (each sequence's
  blocks consecutive, as the pool keeps them while it has free runs).

The paged pool is private memory that asks for huge pages (zeros_on_huge_pages); the header says
whether the OS grants them (transparent_hugepage/enabled).

Read floor (second table): each kernel column again, on its own cache of the same layout, with
the kernel built with -DREAD_ONLY: the same work items, cursors and prefetches, every K and V
row loaded, no arithmetic. What a layout's access pattern costs on this machine (pages, DRAM
rows, prefetch) is then told apart from the compute the kernel does not hide behind it.
`--against FLAGS` puts another build of the kernel there instead (e.g. `--against=-DNO_AMX`:
the vector scores on a CPU whose kernel scores on AMX tiles), for an A/B in one run.

Prefill: one new 1,000-token prompt, and the second 500-token chunk of one, per layout.
Prepare: host time of prepare() for a batch-64 decode step at two contexts (it should not
grow with the context).

    python benchmarks/bench_kernels.py --quick [--batch 1] [--against=-DNO_AMX]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from vmkv.drivers import DEFAULT_PAGE_SIZE, anon_huge_pages, huge_page_size, shmem_huge_pages
from vmkv.paging import PagedKVCache

from vmkv.decode_kernel import load_decode_kernel
from vmkv.engine.cpu_linear import has_native_half_gemm
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

KV_HEADS, Q_HEADS, HEAD_DIM, DTYPE = 3, 9, 64, torch.bfloat16
SCALE = HEAD_DIM**-0.5
MODEL_LAYERS = 30  # SmolLM2-135M's: the layer-packed order's token holds all of them


def l3_bytes() -> int:
    """This machine's last-level cache (Linux sysfs); 32 MiB where it cannot be read."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 32 << 20
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)


# Every sample reads well past the L3, so both the copy and the kernels stream from memory
# (a 2-core Xeon here reports a 480 MiB L3: at the old fixed 96 MiB its samples were L3 hits)
L3_BYTES = l3_bytes()
COPY_BYTES = min(max(256 << 20, 2 * L3_BYTES), 1 << 30)
DECODE_READ_BYTES = min(max(96 << 20, 3 * L3_BYTES), 1 << 30)  # per sample


def shape(num_layers: int = 1) -> KVShape:
    return KVShape(num_layers=num_layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE)


def make_cache(
    kind: str, max_len: int, tokens: int, num_layers: int = 1, page_size: int = DEFAULT_PAGE_SIZE
) -> KVCache:
    """A cache for `tokens` tokens of num_layers layers (MODEL_LAYERS for the layer-packed order,
    whose geometry depends on them); vattention's pages are page_size bytes."""
    layers = MODEL_LAYERS if "packed" in kind else num_layers
    kv_shape = shape(layers)
    budget = 2 * (tokens + 64 * max_len // 16) * kv_shape.bytes_per_token + (64 << 20)
    if kind.startswith("paged"):
        attention = "torch" if kind == "paged torch" else "cpu_kernel"
        cache = PagedKVCache(kv_shape, max_len, budget, enable_prefix_caching=False, attention=attention)
        cache.kv.normal_()
        if "runs" not in kind:
            cache.pool.scatter(0)
        return cache
    order = next((o for o in ("token", "packed") if o in kind), "head")
    # each sequence's ranges (one per K/V, layer and head, per layer, or one) end in a partial page
    ranges = {"head": 2 * layers * KV_HEADS, "token": 2 * layers, "packed": 1}[order]
    budget += -(-tokens // max_len) * ranges * page_size
    attention = "sdpa" if "sdpa" in kind else "cpu_kernel"
    return VAttentionKVCache(kv_shape, max_len, budget, order=order, attention=attention, page_size=page_size)


def admit_all(cache: KVCache, lens: list[int], num_new: int) -> StepBatch:
    """Sequences of lens[i] tokens whose last num_new this step writes: a decode (admitted, then
    grown by one token), a new prompt, or a later chunk of one."""
    for i, n in enumerate(lens):
        cache.admit(i, list(range(n - 1 if num_new == 1 else n)))
        if num_new == 1:
            cache.grow(i, [7])
    return StepBatch.build([SeqStep(i, n - num_new, num_new) for i, n in enumerate(lens)])


def attend_runner(cache: KVCache, batch: StepBatch, layers: int = 1) -> Callable[[], None]:
    """One call per layer 0..layers-1, as a step makes them."""
    gen = torch.Generator().manual_seed(0)
    t = batch.num_tokens
    q = torch.randn(t, Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    plan = cache.prepare(batch)

    def run() -> None:
        for layer in range(layers):
            cache.attend(layer, q, k, k, plan, SCALE)

    return run


@contextmanager
def kernels_built_with(flags: tuple[str, ...]) -> Iterator[None]:
    """Caches that load their decode kernel inside this get the build with these extra flags."""

    def load(dtype: torch.dtype, group: int, head_dim: int, extra_flags: tuple[str, ...] = ()):
        return load_decode_kernel(dtype, group, head_dim, (*extra_flags, *flags))

    with mock.patch("vmkv.decode_kernel.load_decode_kernel", load):
        yield


def built_runner(cache: KVCache, batch: StepBatch, layers: int, flags: tuple[str, ...]) -> Callable[[], None]:
    """attend_runner with the kernel built with `flags`: loaded by its first call, kept by the cache."""
    with kernels_built_with(flags):
        run = attend_runner(cache, batch, layers)
        run()
    return run


def copy_runner() -> Callable[[], None]:
    src = torch.ones(COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def interleaved_medians(runners: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Seconds per call, median over rounds; one warm-up call each (kernel build, page faults)."""
    for run in runners.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


DECODE = [
    "vattention kernel (head-major)",
    "vattention kernel (token-major)",
    "vattention kernel (layer-packed)",
    "vattention sdpa",
    "paged kernel",
    "paged kernel, blocks in runs",
]
VATTENTION_KERNELS = DECODE[:3]
PAGED_KERNELS = ["paged kernel", "paged kernel, blocks in runs"]


def decode_table(
    batch: int, contexts: list[int], rounds: int, with_torch: bool, page_size: int, against: tuple[str, ...]
) -> None:
    """The second table times each kernel column again, built with `against` (extra compiler
    flags) on its own cache of the same layout; by default -DREAD_ONLY, the read floor."""
    kinds = DECODE + (["paged torch"] if with_torch else [])
    kernels = (*VATTENTION_KERNELS, *PAGED_KERNELS)
    second = against or ("-DREAD_ONLY",)
    label = "floor" if not against else f"[{' '.join(against)}]"
    header = ["context", "layers read", "K/V MB per layer", "copy GB/s", "roofline ms"]
    header += [f"{k} ms" for k in kinds]
    header += [
        "kernel / roofline (head, token, packed, paged, paged in runs)",
        "best vattention kernel vs paged kernel",
    ]
    second_header = ["context", "roofline ms", *(f"{k} {label} ms" for k in kernels)]
    second_header += [f"{label} / roofline", f"kernel / {label}"]
    rows, second_rows = [], []
    for context in contexts:
        lens = [context] * batch
        layer_bytes = batch * context * shape().bytes_per_token
        layers = min(MODEL_LAYERS, -(-DECODE_READ_BYTES // layer_bytes))
        caches = {k: make_cache(k, context, batch * context, layers, page_size) for k in kinds}
        seconds = {k: make_cache(k, context, batch * context, layers, page_size) for k in kernels}
        try:
            runners = {"copy": copy_runner()}
            runners |= {k: attend_runner(c, admit_all(c, lens, 1), layers) for k, c in caches.items()}
            for k, c in seconds.items():
                runners[f"{k} {label}"] = built_runner(c, admit_all(c, lens, 1), layers, second)
            t = interleaved_medians(runners, rounds)
        finally:
            for c in (*caches.values(), *seconds.values()):
                c.close()
        per_layer = {k: v / layers for k, v in t.items()}
        bandwidth = 2 * COPY_BYTES / t["copy"]
        roof = layer_bytes / bandwidth
        ratios = ", ".join(f"{per_layer[k] / roof:.2f}x" for k in kernels)
        speedup = per_layer["paged kernel"] / min(per_layer[k] for k in VATTENTION_KERNELS)
        sizes = [str(context), str(layers), f"{layer_bytes / 1e6:.1f}", f"{bandwidth / 1e9:.1f}"]
        rows.append(
            [*sizes, f"{roof * 1e3:.3f}"]
            + [f"{per_layer[k] * 1e3:.3f}" for k in kinds]
            + [ratios, f"{speedup:.2f}x"]
        )
        other = {k: per_layer[f"{k} {label}"] for k in kernels}
        second_rows.append(
            [str(context), f"{roof * 1e3:.3f}"]
            + [f"{other[k] * 1e3:.3f}" for k in kernels]
            + [", ".join(f"{other[k] / roof:.2f}x" for k in kernels)]
            + [", ".join(f"{per_layer[k] / other[k]:.2f}x" for k in kernels)]
        )
    threads = torch.get_num_threads()
    print_table(f"Decode attention per layer, batch {batch}, {threads} threads", header, rows)
    if against:
        title = f"The kernel built with {' '.join(against)}, per layer, batch {batch}"
    else:
        title = f"Read floor per layer (the kernel's walk without its arithmetic), batch {batch}"
    print_table(title, second_header, second_rows)


def prefill_table(prompt: int, rounds: int) -> None:
    kinds = [*VATTENTION_KERNELS, "paged kernel"]
    header = ["step", *(f"{k} ms" for k in kinds), "paged / vattention (head-major)"]
    rows = []
    for name, num_new in (
        (f"new {prompt}-token prompt", prompt),
        (f"chunk 2: {prompt // 2} new", prompt // 2),
    ):
        caches = {k: make_cache(k, 2 * prompt, prompt) for k in kinds}
        try:
            runners = {k: attend_runner(c, admit_all(c, [prompt], num_new)) for k, c in caches.items()}
            t = interleaved_medians(runners, rounds)
        finally:
            for c in caches.values():
                c.close()
        rows.append([name, *(f"{t[k] * 1e3:.2f}" for k in kinds), f"{t['paged kernel'] / t[kinds[0]]:.2f}x"])
    print_table("Prefill attention per layer (one sequence)", header, rows)


def prepare_table(batch: int, contexts: list[int], rounds: int) -> None:
    kinds = ["vattention kernel (head-major)", "paged kernel"]
    rows = []
    for context in contexts:
        caches = {k: make_cache(k, context, batch * context) for k in kinds}
        try:
            batches = {k: admit_all(c, [context] * batch, 1) for k, c in caches.items()}
            t = interleaved_medians(
                {k: lambda c=c, b=batches[k]: c.prepare(b) for k, c in caches.items()}, rounds
            )
        finally:
            for c in caches.values():
                c.close()
        rows.append([str(context), *(f"{t[k] * 1e6:.0f}" for k in kinds)])
    print_table(f"prepare() host time per step, batch {batch} (us)", ["context", *kinds], rows)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 320 and 2048, 5 rounds")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--with-torch", action="store_true", help="add the paged gather + SDPA column")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="vattention's, in bytes")
    parser.add_argument(
        "--against",
        default="",
        help="compiler flags of a second decode-kernel build timed beside the default one, e.g. -DNO_AMX",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 9)
    contexts = [320, 2048] if args.quick else [320, 1024, 2048, 4096]
    bf16 = has_native_half_gemm(torch.bfloat16)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, native bf16: {bf16}, medians of {rounds}")
    pages = f"vattention pages of {args.page_size >> 10} KiB"
    huge = huge_page_size()
    if huge and args.page_size % huge == 0:
        never = "collapsed once per page (shmem_enabled says never)"
        how = "granted at the fault" if shmem_huge_pages() else never
        pages += ", huge pages asked, " + how
    elif huge and huge % args.page_size == 0:
        pages += f", layer-packed runs of {huge >> 20} MiB collapsed into huge pages where the kernel can"
    print(pages)
    granted = "granted" if anon_huge_pages() else "not granted (transparent_hugepage/enabled)"
    print(f"paged pool: huge pages asked, {granted}" if huge_page_size() else "paged pool: no huge pages")
    decode_table(args.batch, contexts, rounds, args.with_torch, args.page_size, tuple(args.against.split()))
    prefill_table(1000, rounds)
    prepare_table(args.batch, [contexts[0], contexts[-1]], rounds)


if __name__ == "__main__":
    main()
