"""`vmkv bench`: capacity, kernel matrix, offline and online A/B runs, then the report.

The short default is sized to finish in under ten minutes on a 2-core CPU; `--full`
runs every workload, a wider rate sweep and a larger kernel grid. Any explicit flag
overrides the profile's value.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig

from vmkv.bench.capacity import KIB, MIB, CapacityScenario, measure_capacity
from vmkv.bench.decode_speed import DecodeSpeed, measure_decode_speed
from vmkv.bench.kernels import AttentionShape, kernel_matrix
from vmkv.bench.metrics import SLO
from vmkv.bench.offline import Round, RunResult, Target, engine_targets, run_interleaved
from vmkv.bench.online import ServerProcess, parse_peer_urls, url_target, warm_up
from vmkv.bench.peers import transformers_target
from vmkv.bench.report import BenchResults, group_runs, latency_table, write_report
from vmkv.bench.workloads import (
    WORKLOADS,
    TokenRange,
    WorkloadSpec,
    arrival_times,
    make_workload,
    parse_rates,
    rate_label,
    read_trace,
    trace_workload,
)
from vmkv.engine import EngineConfig
from vmkv.engine.args import AUTO_DTYPE, add_engine_arguments, check_device, engine_config, positive_int
from vmkv.engine.config import KV_MODES
from vmkv.kv_cache import KVShape
from vmkv.model.store import DEFAULT_MODEL, load_tokenizer, resolve_model
from vmkv.vattention.config import device_page_size

SECTIONS = ("capacity", "kernels", "offline", "online")


@dataclass(frozen=True)
class Profile:
    workloads: tuple[str, ...]
    offline_requests: int
    online_requests: int
    repeats: int
    online_repeats: int
    max_prompt: int | None
    max_output: int | None
    offline_rates: tuple[float, ...]
    online_rates: tuple[float, ...]
    kernel_contexts: tuple[int, ...]
    kernel_batches: tuple[int, ...]
    page_sizes: tuple[int, ...]


SHORT = Profile(
    workloads=("chat",),
    offline_requests=12,
    online_requests=8,
    repeats=2,
    online_repeats=1,
    max_prompt=512,
    max_output=48,
    offline_rates=(math.inf,),
    online_rates=(2.0, math.inf),
    kernel_contexts=(128, 512, 2048),
    kernel_batches=(1, 8, 32),
    page_sizes=(16 * KIB, 64 * KIB, 2 * MIB),  # 16 KiB: the default token-major page on AMX CPUs
)
FULL = Profile(
    workloads=tuple(WORKLOADS),
    offline_requests=64,
    online_requests=64,
    repeats=3,
    online_repeats=2,
    max_prompt=None,
    max_output=None,
    offline_rates=(math.inf,),
    online_rates=(1.0, 2.0, 4.0, 8.0, math.inf),
    kernel_contexts=(128, 512, 2048, 8192),
    kernel_batches=(1, 8, 32, 64),
    page_sizes=(4 * KIB, 16 * KIB, 64 * KIB, 2 * MIB),
)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _choices(allowed: Sequence[str]) -> callable:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(i.strip() for i in text.split(",") if i.strip())
        bad = [i for i in items if i not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return items

    return parse


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(parse_rates(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo(text: str) -> SLO:
    try:
        return SLO.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# engine fields the benchmark sets from its own flags: --model, --modes, --seed, --threads
BENCH_SET = ("model", "kv_mode", "seed", "num_threads")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("benchmark")
    run.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint directory")
    run.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for results.json, report.md, plots/ and server logs",
    )
    run.add_argument(
        "--full", action="store_true", help="every workload, a wider rate sweep, a larger kernel grid"
    )
    run.add_argument(
        "--sections",
        type=_choices(SECTIONS),
        default=SECTIONS,
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    run.add_argument("--modes", type=_choices(KV_MODES), default=KV_MODES, help="KV modes to compare")
    run.add_argument(
        "--workloads",
        type=_choices(tuple(WORKLOADS)),
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: chat; --full: all)",
    )
    run.add_argument("--num-requests", type=positive_int, default=None, help="requests per run")
    run.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="engine processes behind each online server (vmkv serve --data-parallel-size)",
    )
    run.add_argument(
        "--repeats", type=positive_int, default=None, help="A B A B rounds per workload and rate"
    )
    run.add_argument("--max-prompt", type=positive_int, default=None, help="clip prompt lengths (short: 512)")
    run.add_argument("--max-output", type=positive_int, default=None, help="clip output lengths (short: 48)")
    run.add_argument(
        "--rates", type=_rates, default=None, help="offline arrival rates in req/s, e.g. 1,4,inf"
    )
    run.add_argument(
        "--online-rates", type=_rates, default=None, help="online sweep in req/s, e.g. 1,2,4,inf"
    )
    run.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="gamma shape of the gaps between arrivals (1 = Poisson, < 1 burstier)",
    )
    run.add_argument(
        "--slo",
        type=_slo,
        default=SLO(ttft_ms=10_000, tpot_ms=500),
        help="goodput objectives in ms (default ttft:10000,tpot:500: generous, for CPUs)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)"
    )

    trace = parser.add_argument_group("trace replay (added to the offline and online runs)")
    trace.add_argument(
        "--trace", type=Path, default=None, help="CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens"
    )
    trace.add_argument(
        "--trace-time-scale",
        type=_positive_float,
        default=1.0,
        help="multiply trace times by this (0.01 plays 100 s in 1 s)",
    )
    trace.add_argument("--trace-max-prompt", type=positive_int, default=1024, help="clip prompt lengths")
    trace.add_argument("--trace-max-output", type=positive_int, default=256, help="clip output lengths")
    trace.add_argument("--trace-limit", type=positive_int, default=None, help="replay only the first N rows")

    peers = parser.add_argument_group("peers")
    peers.add_argument(
        "--peer-url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an OpenAI-compatible server to measure with the same client (repeatable)",
    )
    peers.add_argument("--peer-api-key", default=None, help="bearer key for the peer servers")

    engine = parser.add_argument_group("engine (the same for every mode and peer)")
    defaults = EngineConfig(kv_budget_bytes=512 * MIB)
    add_engine_arguments(engine, defaults, skip=BENCH_SET, default_dtype=AUTO_DTYPE)


class Progress:
    """One tqdm bar over every unit of work; a unit ends when the next one starts."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, unit="task", dynamic_ncols=True, file=sys.stderr)
        self._open = False

    def __call__(self, label: str) -> None:
        if self._open:
            self.bar.update()
        self.bar.set_description(label[:60])
        self._open = True

    def close(self) -> None:
        if self._open:
            self.bar.update()
        self.bar.close()


@dataclass(frozen=True)
class Variant:
    """Offline or online: how many requests, how many A B A B rounds, at which rates."""

    requests: int
    repeats: int
    rates: tuple[float, ...]


@dataclass(frozen=True)
class Plan:
    sections: tuple[str, ...]
    profile: Profile
    workloads: tuple[str, ...]
    max_prompt: int | None
    max_output: int | None
    offline: Variant
    online: Variant


def make_plan(args: argparse.Namespace) -> Plan:
    p = FULL if args.full else SHORT
    return Plan(
        sections=args.sections,
        profile=p,
        workloads=args.workloads or p.workloads,
        max_prompt=args.max_prompt or p.max_prompt,
        max_output=args.max_output or p.max_output,
        offline=Variant(
            args.num_requests or p.offline_requests, args.repeats or p.repeats, args.rates or p.offline_rates
        ),
        online=Variant(
            args.num_requests or p.online_requests,
            args.repeats or p.online_repeats,
            args.online_rates or p.online_rates,
        ),
    )


def build_rounds(args: argparse.Namespace, plan: Plan, tokens: TokenRange, variant: Variant) -> list[Round]:
    """Every (workload, rate, repeat) with its own seed: fresh prompts each round, identical for every
    target within it, so a long-lived server never finds an earlier round's prompts in its prefix cache."""
    rounds = []
    for w, name in enumerate(plan.workloads):
        for r, rate in enumerate(variant.rates):
            for repeat in range(variant.repeats):
                seed = args.seed + 10_000 * w + 100 * r + repeat
                spec = WorkloadSpec(
                    variant.requests, tokens, args.max_model_len, seed, plan.max_prompt, plan.max_output
                )
                times = arrival_times(variant.requests, rate, args.burstiness, seed)
                workload = make_workload(name, spec).with_arrivals(times, rate_label(rate))
                rounds.append(Round(workload, rate, repeat))
    if args.trace is not None:
        rows = read_trace(args.trace)
        for repeat in range(variant.repeats):
            workload = trace_workload(
                rows,
                tokens,
                args.max_model_len,
                args.trace_time_scale,
                args.trace_max_prompt,
                args.trace_max_output,
                args.trace_limit,
                args.seed + repeat,
            )
            span = workload.requests[-1].arrival
            rate = len(workload.requests) / span if span > 0 else math.inf
            rounds.append(Round(workload, rate, repeat))
    return rounds


def token_range(model_path: Path) -> TokenRange:
    """Ordinary tokens only: prompts never contain a special (chat-template, end-of-sequence) token."""
    tokenizer = load_tokenizer(model_path)
    return TokenRange(max(tokenizer.all_special_ids, default=-1) + 1, len(tokenizer))


def _decode_speed(shape: KVShape, num_q_heads: int, config: EngineConfig) -> list[DecodeSpeed]:
    """Each vattention order's decode attention at 2k context, batch 8: on a CPU by
    the C kernel and by stock SDPA, on a GPU by the cache's own path at the driver's 2 MiB pages."""
    device = torch.device(config.device)
    cuda = device.type == "cuda"
    return measure_decode_speed(
        shape,
        context=2048,
        attentions=("auto",) if cuda else ("cpu_kernel", "sdpa"),
        page_size=device_page_size(device.type),
        device=device,
        num_q_heads=num_q_heads,
    )


def model_shapes(model_path: Path, dtype: torch.dtype, block_size: int) -> tuple[KVShape, AttentionShape]:
    hf = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return (
        KVShape(hf.num_hidden_layers, kv_heads, head_dim, dtype),
        AttentionShape(hf.num_attention_heads, kv_heads, head_dim, dtype, block_size, hf.num_hidden_layers),
    )


def _meta(args: argparse.Namespace, plan: Plan, config: EngineConfig) -> dict[str, object]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return {
        "command": "vmkv bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} at start",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "model": args.model,
        "engine": f"{config.dtype}{' (auto)' if args.dtype == 'auto' else ''}, "
        f"KV budget {args.kv_budget_mib} MiB, "
        f"max_model_len {config.max_model_len}, "
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"paged blocks of {config.block_size}, preemption by {config.preemption_mode}",
        "workloads": f"{', '.join(plan.workloads)}, prompts clipped to {plan.max_prompt or 'no limit'}, "
        f"outputs to {plan.max_output or 'no limit'}; offline {plan.offline.requests} requests x "
        f"{plan.offline.repeats} round(s), online {plan.online.requests} x {plan.online.repeats}; "
        f"arrival burstiness {args.burstiness}",
        "goodput SLO": args.slo.describe(),
    }


def _run_online(
    args: argparse.Namespace, config: EngineConfig, rounds: list[Round], progress: Progress
) -> list[RunResult]:
    """Our server per mode (child processes, started together) plus every peer URL, one client."""
    peers = parse_peer_urls(args.peer_url)
    with ExitStack() as stack:
        servers = []
        for mode in args.modes:
            server = ServerProcess(
                dataclasses.replace(config, kv_mode=mode),
                args.out / "logs" / f"server-{mode}.log",
                data_parallel_size=args.data_parallel_size,
            )
            server.start()
            stack.callback(server.stop)
            servers.append(server)
        targets: list[Target] = []
        for server in servers:
            progress(f"start {server.config.kv_mode} server")
            server.wait_healthy()
            warm_up(server.url)
            targets.append(url_target(server.config.kv_mode, server.url))
        for name, url in peers:
            warm_up(url, args.peer_api_key)
            targets.append(url_target(name, url, args.peer_api_key))
        return run_interleaved(targets, rounds, args.slo, progress)


def device_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Engine fields the device decides: on a GPU "auto" dtype is bfloat16 (every GPU the engine
    supports multiplies it natively; auto_dtype reads CPU flags). Refuses a device torch cannot use
    before anything is built."""
    device = check_device(args.device)
    return {"dtype": "bfloat16"} if device.type == "cuda" and args.dtype == AUTO_DTYPE else {}


def bench_main(args: argparse.Namespace) -> None:
    """Run the selected sections and write the report under args.out."""
    overrides = device_overrides(args)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the server processes
    plan = make_plan(args)
    model_path = resolve_model(args.model)
    config = engine_config(args, model=str(model_path), seed=args.seed, num_threads=args.threads, **overrides)
    kv_shape, attention_shape = model_shapes(model_path, config.torch_dtype, args.block_size)
    tokens = token_range(model_path)
    offline_rounds = build_rounds(args, plan, tokens, plan.offline)
    online_rounds = build_rounds(args, plan, tokens, plan.online)
    offline_targets = [*engine_targets(config, args.modes), transformers_target(config)]
    online_targets = len(args.modes) + len(args.peer_url)
    units = {
        "capacity": 1,
        "kernels": len(plan.profile.kernel_contexts) * len(plan.profile.kernel_batches),
        "offline": len(offline_rounds) * len(offline_targets),
        "online": len(args.modes) + len(online_rounds) * online_targets,
    }
    results = BenchResults(_meta(args, plan, config))
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(sum(units[s] for s in plan.sections))
    try:
        if "capacity" in plan.sections:
            progress("capacity")
            # In bf16, the dtype models are served in: no arithmetic runs, only memory is counted.
            bf16 = dataclasses.replace(kv_shape, dtype=torch.bfloat16)
            scenario = CapacityScenario(bf16, max_len=args.max_model_len, seed=args.seed)
            results.capacity = measure_capacity(scenario, args.block_size, plan.profile.page_sizes)
            results.meta["capacity"] = (
                f"sequences of a {scenario.prompt_len}-token prompt plus an answer of "
                f"{scenario.answer_range[0]}-{scenario.answer_range[1]} tokens, max_len {scenario.max_len}, "
                f"KV in bf16 ({bf16.bytes_per_token:,} bytes per token)"
            )
            results.decode_speed = _decode_speed(bf16, attention_shape.num_q_heads, config)
        if "kernels" in plan.sections:
            results.kernels = kernel_matrix(
                attention_shape,
                plan.profile.kernel_contexts,
                plan.profile.kernel_batches,
                device=config.device,
                progress=lambda key: progress(f"kernels {key}"),
            )
        if "offline" in plan.sections:
            results.offline = run_interleaved(offline_targets, offline_rounds, args.slo, progress)
        if "online" in plan.sections:
            results.online = _run_online(args, config, online_rounds, progress)
    finally:
        progress.close()
        written = write_report(results, args.out)
    for section, runs in (("offline", results.offline), ("online", results.online)):
        if runs:
            print(f"\n{section}:")
            print("\n".join(latency_table(group_runs(runs), with_rate=True)))
    print(f"report: {written[1]}")
