"""The GPU path's checks, one JSON file per part under --out, for benchmarks/gpu_check.sh.

    python benchmarks/gpu_driver_check.py versions --out DIR
    python benchmarks/gpu_driver_check.py probe --out DIR     # CudaDriver against the real driver
    python benchmarks/gpu_driver_check.py matrix --out DIR    # kernel-compatibility matrix, both layouts
    python benchmarks/gpu_driver_check.py ab --out DIR        # vattention against paged, engine level
    python benchmarks/gpu_driver_check.py report --out DIR    # gpu_check.json + gpu_check.md

--dry-run runs the same code on the CPU (HostDriver, a 2-layer model, tiny grids) in seconds,
so the script itself is checked on machines without a GPU. Each part records failures in its
JSON instead of dying, so one failing part never hides the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import random
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vmkv.drivers import CudaDriver, HostDriver, MemoryDriver

MiB = 1024 * 1024
PAGE = 2 * MiB


def _device(dry_run: bool) -> torch.device:
    return torch.device("cpu" if dry_run else "cuda", None if dry_run else 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {out / name}.json")


# ------------------------------------------------------------------ versions
def versions(dry_run: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"dry_run (CPU)": dry_run, "python": platform.python_version()}
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    for package in ("transformers", "cuda-bindings", "cuda-python", "triton", "flash-attn"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if not dry_run and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = list(torch.cuda.get_device_capability(0))
        try:
            from cuda.bindings import driver as cu

            cu.cuInit(0)
            err, version = cu.cuDriverGetVersion()
            info["cuda_driver"] = f"{version // 1000}.{version % 1000 // 10}"
        except Exception as e:  # the version is informative only
            info["cuda_driver"] = f"unknown ({e})"
    from vmkv.flash_support import flash_unusable_reason

    info["flash_attn_usable"] = flash_unusable_reason(_device(dry_run), torch.bfloat16, 64) or "yes"
    return info


# --------------------------------------------------------------------- probe
@dataclasses.dataclass
class Check:
    name: str
    ok: bool = False
    detail: str = ""
    seconds: float = 0.0


def _run_check(checks: list[Check], name: str, fn: Callable[[], str]) -> None:
    check = Check(name)
    t0 = time.perf_counter()
    try:
        check.detail = fn()
        check.ok = True
    except Exception as e:
        check.detail = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    check.seconds = time.perf_counter() - t0
    checks.append(check)
    print(f"{'ok  ' if check.ok else 'FAIL'} {name}: {check.detail}")


def _make_driver(device: torch.device, num_pages: int) -> MemoryDriver:
    if device.type == "cuda":
        return CudaDriver(num_pages, PAGE, device=device.index or 0)
    return HostDriver(num_pages, PAGE)


def probe(dry_run: bool, pages: int) -> dict[str, Any]:
    """View before map, map from a thread with no current context, write/read back, aliasing,
    unmap right after an asynchronous kernel, then the raw call times."""
    device = _device(dry_run)
    checks: list[Check] = []
    drv = _make_driver(device, 6)
    n = PAGE // 4
    res = drv.reserve(4 * PAGE)
    state: dict[str, Any] = {}

    def view_before_map() -> str:
        state["view"] = drv.view(res, torch.float32, (4 * n,))
        return f"view of {4 * PAGE // MiB} MiB on {state['view'].device} before any page is mapped"

    def map_from_fresh_thread() -> str:
        errors: list[BaseException] = []
        pages_ = drv.alloc(2)

        def work() -> None:
            try:
                drv.map(res, 0, pages_)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=work, name="fresh-thread")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return "mapped 2 pages from a thread that never touched CUDA"

    def write_read_back() -> str:
        view = state["view"]
        view[: 2 * n].fill_(1.25)
        _sync(device)
        again = drv.view(res, torch.float32, (2 * n,))
        if not bool(torch.all(again == 1.25)):
            raise AssertionError("a fresh view does not read what the first one wrote")
        return "wrote through the early view, read back through a new one"

    def aliasing() -> str:
        extra = drv.alloc(1)
        drv.map(res, 2 * PAGE, extra)
        drv.view(res, torch.float32, (n,), offset=2 * PAGE).fill_(7.0)
        drv.unmap(res, 0)
        drv.map(res, 0, extra)  # the same physical page at offsets 0 and 2 pages
        first = drv.view(res, torch.float32, (n,))
        if not bool(torch.all(first == 7.0)):
            raise AssertionError("a page mapped at two offsets does not alias")
        return "one physical page at two offsets reads the same"

    def unmap_after_async_kernel() -> str:
        view = drv.view(res, torch.float32, (n,), offset=PAGE)
        a = torch.randn(2048, 2048, device=device)
        for _ in range(20):  # a few ms of queued work ahead of the read
            a = torch.tanh(a @ a)
        total = view.sum()  # queued behind the matmuls; the unmap must wait for it
        t0 = time.perf_counter()
        drv.unmap(res, PAGE)
        waited = time.perf_counter() - t0
        if float(total) != 1.25 * n:
            raise AssertionError(f"the kernel read {float(total)}, not {1.25 * n}")
        return f"unmap returned after {waited * 1e3:.2f} ms, having waited for the queued read"

    for name, fn in [
        ("view before map", view_before_map),
        ("map from a thread with no current context", map_from_fresh_thread),
        ("write and read back", write_read_back),
        ("one page at two offsets", aliasing),
        ("unmap right after an async kernel", unmap_after_async_kernel),
    ]:
        _run_check(checks, name, fn)
    stats = dataclasses.asdict(drv.stats)
    drv.close()
    times: dict[str, dict[str, float]] = {}
    if not dry_run:
        from cuda.bindings import driver as cu  # importable: CudaDriver just used it

        torch.cuda.set_device(device)  # the raw timings run in this device's primary context
        raw = time_raw_calls(cu, device.index or 0, pages)
        times = {k: {"median_us": statistics.median(v) * 1e6, "max_us": max(v) * 1e6} for k, v in raw.items()}
    return {"checks": [dataclasses.asdict(c) for c in checks], "driver_stats": stats, "raw_call_times": times}


def time_raw_calls(cu: Any, device: int, count: int) -> dict[str, list[float]]:
    """Seconds per call of each VMM step, one 2 MiB page at a time, in the current context."""

    def ok(result: tuple) -> Any:
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA call failed: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    base = int(ok(cu.cuMemAddressReserve(count * PAGE, 0, 0, 0)))
    calls = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap")
    times: dict[str, list[float]] = {name: [] for name in calls}

    def timed(name: str, call: Callable, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = call(*args)
        times[name].append(time.perf_counter() - t0)
        return ok(out)

    handles = [timed("cuMemCreate", cu.cuMemCreate, PAGE, prop, 0) for _ in range(count)]
    for i, handle in enumerate(handles):
        timed("cuMemMap", cu.cuMemMap, base + i * PAGE, PAGE, 0, handle, 0)
        timed("cuMemSetAccess", cu.cuMemSetAccess, base + i * PAGE, PAGE, [access], 1)
    for i in range(count):
        timed("cuMemUnmap", cu.cuMemUnmap, base + i * PAGE, PAGE)
    for handle in handles:
        ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(base, count * PAGE))
    return times


# -------------------------------------------------------------------- matrix
def matrix(dry_run: bool) -> dict[str, Any]:
    from vmkv.bench.kernels import AttentionShape, kernel_matrix

    device = _device(dry_run)
    if dry_run:
        shape = AttentionShape(dtype=torch.float32)
        result = kernel_matrix(shape, contexts=(64,), batches=(1, 2), device=device, min_seconds=0.01)
    else:
        shape = AttentionShape(dtype=torch.bfloat16)
        result = kernel_matrix(shape, contexts=(512, 4096), batches=(1, 32), device=device, min_seconds=0.02)
    return dataclasses.asdict(result)


# ------------------------------------------------------------------------ A/B
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 64


SMOLLM2_SHAPE = ModelSpec("SmolLM2-135M shape", 30, 576, 9, 3, 1536)
LLAMA_1B_SHAPE = ModelSpec("Llama 1B shape", 16, 2048, 32, 8, 8192)
DRY_SHAPE = ModelSpec("tiny", 2, 64, 4, 2, 128, head_dim=16)


def build_model(spec: ModelSpec, path: Path, device: torch.device) -> Path:
    """A random-weight Llama of spec's shape with the tiny tokenizer (no network: nothing downloaded);
    initialised on `device` (seconds for 1B on a GPU), saved in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vmkv.model.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def default_model(spec_dir: Path, device: torch.device) -> tuple[str, Path]:
    """The default model where it was pulled before (no network here), else a random one of its shape."""
    from vmkv.model.store import default_model_dir, is_checkpoint

    path = default_model_dir()
    if is_checkpoint(path):
        return "SmolLM2-135M-Instruct", path
    return SMOLLM2_SHAPE.name + " (random weights)", build_model(SMOLLM2_SHAPE, spec_dir, device)


def _targets() -> list[tuple[str, str, bool]]:
    """(label, kv_mode, background mapper): vattention with and without its mapper, then paged."""
    return [
        ("vattention", "vattention", True),
        ("vattention, no background mapper", "vattention", False),
        ("paged", "paged", True),
    ]


def _build_llm(model: Path, kv_mode: str, background: bool, device: torch.device, dtype: str, **config: Any):
    """An LLM; without the background mapper for vattention when asked (the engine has no flag for
    it, so the cache factory is wrapped for this one construction)."""
    import vmkv.engine.kv_factory as factory
    from vmkv import LLM

    if kv_mode != "vattention" or background:
        return LLM(str(model), kv_mode=kv_mode, device=str(device), dtype=dtype, **config)
    original = factory.VAttentionKVCache

    def no_mapper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, background_mapping=False, **kwargs)

    factory.VAttentionKVCache = no_mapper
    try:
        return LLM(str(model), kv_mode=kv_mode, device=str(device), dtype=dtype, **config)
    finally:
        factory.VAttentionKVCache = original


def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    b, a = before.present(), after.present()
    keys = ("map_calls_critical", "map_calls_background", "map_seconds_critical", "map_seconds_background")
    out = {k: a[k] - b[k] for k in keys if k in a}
    for gauge in ("units_peak", "pages_mapped", "units_total"):
        if gauge in a:
            out[gauge] = a[gauge]
    return out


def measure(llm: Any, batch: int, context: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Prefill tokens/s (max_tokens=1) and decode TPOT (median over requests) of batch random prompts."""
    from vmkv import SamplingParams

    rng = random.Random(seed)
    vocab = len(llm.tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]
    cache = llm.engine.cache
    before = cache.stats()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - t0
    steps_before = cache.stats()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    after = cache.stats()
    tpots = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (new_tokens - 1)
        for o in outs
        if o.metrics.finished_time is not None and o.metrics.first_token_time is not None
    ]
    decode = _stats_delta(steps_before, after)
    calls = decode.get("map_calls_critical", 0) + decode.get("map_calls_background", 0)
    map_s = decode.get("map_seconds_critical", 0.0) + decode.get("map_seconds_background", 0.0)
    return {
        "batch": batch,
        "context": context,
        "prefill_tokens_per_s": batch * context / prefill_s,
        "decode_tpot_ms": statistics.median(tpots) * 1e3 if tpots else None,
        "decode_map_ms_per_step": map_s * 1e3 / new_tokens,
        "decode_map_calls": calls,
        "prefill_stats": _stats_delta(before, steps_before),
        "decode_stats": decode,
    }


def ab(dry_run: bool, out: Path, which: list[str]) -> dict[str, Any]:
    """vattention (with and without the background mapper) against paged, one grid point at a time
    with the targets interleaved, so drift touches all alike."""
    device = _device(dry_run)
    work = out / "models"
    # each model is built when its turn comes, so a run cut off early still has the first one's rows
    models: list[Callable[[], tuple[str, Path]]]
    if dry_run:
        models = [lambda: ("tiny (random weights)", build_model(DRY_SHAPE, work / "tiny", device))]
        grid, new_tokens, budget, dtype = [(1, 16), (4, 32)], 4, 64 * MiB, "float32"
    else:
        models = []
        if "default" in which:
            models.append(lambda: default_model(work / "smollm2-shape", device))
        if "1b" in which:
            models.append(
                lambda: (
                    LLAMA_1B_SHAPE.name + " (random weights)",
                    build_model(LLAMA_1B_SHAPE, work / "1b", device),
                )
            )
        grid, new_tokens, budget, dtype = (
            [(1, 512), (16, 512), (64, 512), (1, 4096), (16, 2048)],
            32,
            16 << 30,
            "bfloat16",
        )
    meta = {"device": str(device), "new_tokens": new_tokens, "kv_budget_bytes": budget}
    max_batch = max(b for b, _ in grid)
    max_len = max(c for _, c in grid) + new_tokens + 16
    results: list[dict[str, Any]] = []
    for build in models:
        label, path = build()
        llms = {}
        for name, kv_mode, background in _targets():
            llms[name] = _build_llm(
                path,
                kv_mode,
                background,
                device,
                dtype,
                kv_budget_bytes=budget,
                max_model_len=max_len,
                max_num_seqs=max_batch,
                max_num_batched_tokens=max(8192, max_batch) if not dry_run else 256,
                enable_prefix_caching=False,
            )
            measure(llms[name], 1, 8, 2, seed=-1)  # warm-up: kernels, allocator, first pages
        for i, (batch, context) in enumerate(grid):
            for name in llms if i % 2 == 0 else reversed(list(llms)):
                row = {
                    "model": label,
                    "target": name,
                    **measure(llms[name], batch, context, new_tokens, seed=i),
                }
                results.append(row)
                print(json.dumps(row, default=str))
                _write(out, "ab", {**meta, "rows": results, "complete": False})  # kept if cut off
        for llm in llms.values():
            llm.close()
        del llms
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**meta, "rows": results, "complete": True}


# --------------------------------------------------------------------- report
def report(out: Path) -> dict[str, Any]:
    """Merge the parts' JSON into gpu_check.json and write gpu_check.md beside it."""
    parts = {}
    for name in ("versions", "probe", "matrix", "ab", "stages"):
        path = out / f"{name}.json"
        parts[name] = json.loads(path.read_text()) if path.exists() else None
    lines = ["# GPU check", ""]
    if parts["versions"]:
        lines += ["| what | version |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in parts["versions"].items()]
        lines.append("")
    if parts["stages"]:
        lines += ["| stage | exit status | seconds |", "|---|---|---|"]
        lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']} |" for s in parts["stages"]["stages"]]
        lines.append("")
    if parts["probe"]:
        lines += ["## Driver probe", "", "| check | ok | detail |", "|---|---|---|"]
        lines += [
            f"| {c['name']} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |"
            for c in parts["probe"]["checks"]
        ]
        for call, t in parts["probe"]["raw_call_times"].items():
            lines.append(f"- {call}: median {t['median_us']:.1f} µs, max {t['max_us']:.1f} µs per 2 MiB page")
        lines.append("")
    if parts["matrix"]:
        lines += [
            "## Kernel matrix",
            "",
            "| kernel | layout | status | max error | times ms |",
            "|---|---|---|---|---|",
        ]
        for c in parts["matrix"]["cells"]:
            times = ", ".join(f"{k}: {v:.3f}" for k, v in c["times_ms"].items())
            err = "" if c["max_error"] is None else f"{c['max_error']:.2e}"
            lines.append(f"| {c['kernel']} | {c['layout']} | {c['status']} {c['note']} | {err} | {times} |")
        lines.append("")
    if parts["ab"]:
        lines += [
            "## vattention against paged",
            "",
            "| model | target | batch | context | prefill tok/s | decode TPOT ms | map ms/step | map calls |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in parts["ab"]["rows"]:
            tpot = "" if r["decode_tpot_ms"] is None else f"{r['decode_tpot_ms']:.2f}"
            lines.append(
                f"| {r['model']} | {r['target']} | {r['batch']} | {r['context']} | "
                f"{r['prefill_tokens_per_s']:,.0f} | {tpot} | {r['decode_map_ms_per_step']:.3f} | "
                f"{r['decode_map_calls']} |"
            )
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps(parts, indent=2, default=str) + "\n")
    print(f"wrote {out / 'gpu_check.md'} and {out / 'gpu_check.json'}")
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("versions", "probe", "matrix", "ab", "report"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny sizes")
    parser.add_argument("--pages", type=int, default=64, help="probe: pages timed per raw call")
    parser.add_argument("--models", default="default,1b", help="ab: default and/or 1b")
    args = parser.parse_args()
    if args.part == "report":
        report(args.out)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch; use --dry-run on a CPU", file=sys.stderr)
        return 2
    if args.part == "versions":
        _write(args.out, "versions", versions(args.dry_run))
    elif args.part == "probe":
        data = probe(args.dry_run, args.pages)
        _write(args.out, "probe", data)
        return 0 if all(c["ok"] for c in data["checks"]) else 1
    elif args.part == "matrix":
        _write(args.out, "matrix", matrix(args.dry_run))
    else:
        _write(args.out, "ab", ab(args.dry_run, args.out, args.models.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
