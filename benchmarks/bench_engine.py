"""Engine benchmark and correctness oracle.

throughput: N requests of P random prompt tokens and O output tokens (ignore_eos), all
submitted at once, in every kv mode and in transformers' own continuous batching
(`generate_batch`, sdpa attention over its paged cache) on the same requests, modes interleaved over
rounds. Reports output tokens/s, KV bytes reserved / peak allocated / peak used, the peak
number of running sequences and preemptions.

oracle: greedy decoding of the 16 chat prompts, batched, in every kv mode (with and
without forced preemption) against transformers' generate(), in float32 (identical up to
near-ties) and bfloat16 (share of prompts agreeing over the first 32 tokens).

    python benchmarks/bench_engine.py throughput [--requests 64 --prompt-len 256 --output-len 128]
    python benchmarks/bench_engine.py oracle [--compile]
    python benchmarks/bench_engine.py lm-head   # why the runner slices the vocabulary projection
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from vmkv.engine import EngineConfig, EngineStats, LLMEngine, SamplingParams
from vmkv.engine.model_runner import LOGIT_SLICE, linear_in_slices
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids, compare, reference_greedy
from vmkv.kv_cache import KVMemory
from vmkv.model.store import load_model, load_tokenizer, resolve_model

MODES = ("vattention", "paged", "contiguous")
MIB = 1 << 20


@dataclass
class Run:
    target: str
    seconds: float
    output_tokens: int
    steps: int = 0
    peak_running: int = 0
    preemptions: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_used: int = 0
    ttft_median: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    preempted_before = engine.scheduler.num_preemptions
    engine.peak_running_seqs = 0
    peak = KVMemory(0, 0, 0)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first_tokens, tokens, steps = [], 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        memory = engine.cache.memory()
        peak = KVMemory(
            memory.reserved_bytes,
            max(peak.allocated_bytes, memory.allocated_bytes),
            max(peak.used_bytes, memory.used_bytes),
        )
        for out in outputs:
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                first_tokens.append(out.metrics.first_token_time - out.metrics.arrival_time)
    seconds = time.perf_counter() - start
    return Run(
        target=engine.config.kv_mode,
        seconds=seconds,
        output_tokens=tokens,
        steps=steps,
        peak_running=engine.peak_running_seqs,
        preemptions=engine.scheduler.num_preemptions - preempted_before,
        reserved=peak.reserved_bytes,
        peak_allocated=peak.allocated_bytes,
        peak_used=peak.used_bytes,
        ttft_median=statistics.median(first_tokens),
    )


def run_transformers(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int, config: EngineConfig
) -> Run:
    """transformers' continuous batching under the same KV budget and batch limits."""
    bytes_per_token = kv_bytes_per_token(config.model, config.dtype)
    page_tokens = 256
    generation = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(
        page_size=page_tokens,
        num_blocks=config.kv_budget_bytes // (page_tokens * bytes_per_token),
        max_batch_tokens=config.max_num_batched_tokens,
        max_requests_per_batch=config.max_num_seqs,
    )
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts, generation_config=generation, continuous_batching_config=batching, warmup=False
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return Run("transformers", seconds, tokens, reserved=batching.num_blocks * page_tokens * bytes_per_token)


def throughput(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    path = str(resolve_model(args.model))
    base = {
        "model": path,
        "dtype": args.dtype,
        "kv_budget_bytes": args.kv_budget_mib * MIB,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "preemption_mode": args.preemption_mode,
        "fp32_gemm": args.fp32_gemm,
        "compile_model": args.compile,
    }
    engines = {mode: LLMEngine(EngineConfig(kv_mode=mode, **base)) for mode in args.modes}
    vocab = next(iter(engines.values())).runner.vocab_size
    prompts = random_prompts(args.requests, args.prompt_len, vocab)
    # The peer may compute in another dtype (fp32 where this CPU has no bf16 GEMM); it gets
    # as many KV tokens as the engines, so a wider dtype does not starve it of memory.
    peer_dtype = args.transformers_dtype or args.dtype
    peer_tokens = base["kv_budget_bytes"] // kv_bytes_per_token(path, args.dtype)
    peer_config = EngineConfig(
        **{**base, "dtype": peer_dtype, "kv_budget_bytes": peer_tokens * kv_bytes_per_token(path, peer_dtype)}
    )
    hf_model = (
        None
        if args.skip_transformers
        else load_model(path, dtype=peer_config.torch_dtype, attn_implementation="sdpa")
    )
    for engine in engines.values():  # warm up allocators and kernels outside the timed runs
        run_engine(engine, prompts[:2], 2, "warm")
    runs: list[Run] = []
    for r in range(args.rounds):
        for engine in engines.values():
            runs.append(run_engine(engine, prompts, args.output_len, f"r{r}"))
            print(_line(runs[-1]), flush=True)
        if hf_model is not None:
            runs.append(run_transformers(hf_model, prompts, args.output_len, peer_config))
            print(_line(runs[-1]), flush=True)
    print(
        f"\n{args.requests} requests x {args.prompt_len} prompt / {args.output_len} output tokens, "
        f"{args.dtype} (transformers {peer_dtype}), KV budget {args.kv_budget_mib} MiB, "
        f"max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"fp32 GEMM {next(iter(engines.values())).runner.fp32_gemm}, {torch.get_num_threads()} threads, "
        f"best of {args.rounds} round(s):"
    )
    best: dict[str, Run] = {}
    for run in runs:
        if run.target not in best or run.tokens_per_s > best[run.target].tokens_per_s:
            best[run.target] = run
    reference = best.get("transformers")
    for run in best.values():
        ratio = f"  {run.tokens_per_s / reference.tokens_per_s:.1f}x transformers" if reference else ""
        print(_line(run) + ratio)
    for engine in engines.values():
        engine.close()


def _line(run: Run) -> str:
    kv = (
        f"KV reserved {run.reserved / MIB:7.1f} MiB peak allocated {run.peak_allocated / MIB:6.1f} "
        f"peak used {run.peak_used / MIB:6.1f} MiB  peak running {run.peak_running:3d}  "
        f"preemptions {run.preemptions:3d}  steps {run.steps:4d}  median TTFT {run.ttft_median:5.1f} s"
        if run.target != "transformers"
        else f"KV reserved {run.reserved / MIB:7.1f} MiB"
    )
    return f"{run.target:12s} {run.tokens_per_s:7.1f} output tok/s ({run.seconds:6.1f} s)  {kv}"


def oracle(args: argparse.Namespace) -> None:
    path = str(resolve_model(args.model))
    prompts = chat_prompt_ids(load_tokenizer(path), CHAT_PROMPTS[: args.prompts])
    print(f"{len(prompts)} chat prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, greedy")
    ok = True
    if "float32" in args.dtypes:
        ok &= oracle_fp32(args, path, prompts)
    if "bfloat16" in args.dtypes:
        ok &= oracle_bf16(args, path, prompts)
    print("PASS" if ok else "FAIL")
    if not ok:
        sys.exit(1)


def oracle_fp32(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> bool:
    """Token-identical to transformers up to near-ties, with ample memory and under preemption."""
    reference = reference_greedy(path, prompts, args.max_tokens, torch.float32)
    # The small budget holds a few sequences' worth of tokens: the prompts grow into it and
    # preempt each other (4 KiB vattention pages, so its page sets are that small too).
    small = args.small_budget_tokens * kv_bytes_per_token(path, "float32")
    ok = True
    for mode in args.modes:
        for name, budget, preemption in (
            ("ample", 256 * MIB, "recompute"),
            ("small/recompute", small, "recompute"),
            ("small/swap", small, "swap"),
        ):
            outputs, stats = run_greedy(
                path, mode, "float32", budget, preemption, args, prompts, args.max_tokens
            )
            report = compare(reference, outputs)
            ok &= report.passed
            ties = [(d.prompt, d.step, f"{d.margin:.1e}") for d in report.near_ties]
            print(
                f"fp32 {mode:10s} {name:15s} identical {report.identical:2d}/{len(prompts)}  "
                f"near-ties {len(report.near_ties)} {ties}  mismatches {len(report.mismatches)} "
                f"{report.mismatches}  preemptions {stats.num_preemptions}  "
                f"peak running {stats.peak_running_seqs}",
                flush=True,
            )
    return ok


def oracle_bf16(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> bool:
    """The bf16 policy: at least 95% of prompts agree with transformers over their first 32 tokens,
    where agreeing means identical, or first differing at a bf16 tie: the reference's top two
    logits within one bf16 rounding step of each other. Exact agreement is reported too."""
    first = 32
    reference = reference_greedy(path, prompts, first, torch.bfloat16)
    ok = True
    for mode in args.modes:
        outputs, _ = run_greedy(path, mode, "bfloat16", 256 * MIB, "recompute", args, prompts, first)
        report = compare(reference, outputs, first=first, tie_bf16_ulps=1)
        share = (report.identical + len(report.near_ties)) / len(prompts)
        ok &= share >= 0.95
        ties = [(d.prompt, d.step, f"{d.margin:.3f}@{d.top:.1f}") for d in report.near_ties]
        print(
            f"bf16 {mode:10s} first {first} tokens: identical {report.identical:2d}/{len(prompts)}, "
            f"bf16 ties {len(report.near_ties)} (prompt, step, margin@top logit) {ties}, "
            f"mismatches {len(report.mismatches)} {report.mismatches} -> agree {share:.0%}",
            flush=True,
        )
    return ok


def run_greedy(
    path: str,
    mode: str,
    dtype: str,
    budget: int,
    preemption: str,
    args: argparse.Namespace,
    prompts: list[list[int]],
    max_tokens: int,
) -> tuple[list[list[int]], EngineStats]:
    config = EngineConfig(
        model=path,
        kv_mode=mode,
        dtype=dtype,
        kv_budget_bytes=budget,
        max_model_len=args.max_model_len,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        preemption_mode=preemption,
        page_size=4096,
        fp32_gemm=args.fp32_gemm,
        compile_model=args.compile,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    stats = engine.stats()
    engine.close()
    return [done[str(i)] for i in range(len(prompts))], stats


def kv_bytes_per_token(path: str, dtype: str) -> int:
    hf = AutoConfig.from_pretrained(path, local_files_only=True)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return (
        2
        * hf.num_hidden_layers
        * hf.num_key_value_heads
        * head_dim
        * EngineConfig(dtype=dtype).torch_dtype.itemsize
    )


def lm_head(args: argparse.Namespace) -> None:
    """The vocabulary projection as one GEMM against LOGIT_SLICE-row slices, A B A B, medians."""
    hf = AutoConfig.from_pretrained(resolve_model(args.model))
    weight = torch.randn(hf.vocab_size, hf.hidden_size)
    for rows in args.rows:
        x, out = torch.randn(rows, hf.hidden_size), torch.empty(rows, hf.vocab_size)

        def whole(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            torch.mm(x, weight.t(), out=out)

        def sliced(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            linear_in_slices(x, weight, out)

        times: dict[str, list[float]] = {"whole": [], "sliced": []}
        for _ in range(args.rounds):
            for name, fn in (("whole", whole), ("sliced", sliced)):
                fn()  # warm
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        a, b = (statistics.median(times[k]) * 1e3 for k in ("whole", "sliced"))
        print(
            f"[{rows}, {hf.hidden_size}] x [{hf.hidden_size}, {hf.vocab_size}] fp32: one GEMM {a:6.1f} ms, "
            f"{LOGIT_SLICE}-row slices {b:6.1f} ms ({a / b:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--fp32-gemm",
        type=lambda s: {"auto": None, "on": True, "off": False}[s],
        default=None,
        help="auto | on | off: half-precision linears as fp32 GEMMs (EngineConfig.fp32_gemm)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="run the engines compiled (EngineConfig.compile_model)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--requests", type=int, default=64)
    t.add_argument("--prompt-len", type=int, default=256)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--kv-budget-mib", type=int, default=1024)
    t.add_argument("--max-model-len", type=int, default=2048)
    t.add_argument("--max-num-seqs", type=int, default=64)
    t.add_argument("--max-num-batched-tokens", type=int, default=1024)
    t.add_argument("--preemption-mode", default="recompute")
    t.add_argument("--rounds", type=int, default=1)
    t.add_argument("--skip-transformers", action="store_true")
    t.add_argument(
        "--transformers-dtype",
        default=None,
        help="dtype of the transformers peer (default: --dtype); float32 on CPUs without bf16 GEMMs",
    )
    o = sub.add_parser("oracle")
    o.add_argument("--prompts", type=int, default=16)
    o.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    o.add_argument("--max-tokens", type=int, default=64)
    o.add_argument("--max-model-len", type=int, default=256)
    o.add_argument("--small-budget-tokens", type=int, default=640)
    h = sub.add_parser("lm-head")
    h.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 128])
    h.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    {"throughput": throughput, "oracle": oracle, "lm-head": lm_head}[args.command](args)


if __name__ == "__main__":
    main()
