"""Engine settings on the command line: the one place that maps EngineConfig fields to flags.

Every command that builds an engine (`vmkv serve`, `vmkv bench`) adds these flags and builds
its EngineConfig from them; the bench turns a config back into the same flags for the
servers it starts. Every EngineConfig field has a flag, named after the field (kv_budget_bytes
is given in MiB, compile_model is --compile, enable_prefix_caching is --prefix-caching).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Collection

import torch

from vmkv.engine import gemv_kernel
from vmkv.engine.config import (
    DTYPES,
    KV_MODES,
    KV_ORDERS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from vmkv.engine.cpu_linear import has_native_half_gemm
from vmkv.model.store import DEFAULT_MODEL

MIB = 1 << 20
AUTO_DTYPE = "auto"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def auto_dtype() -> str:
    """bfloat16 wherever a decode step reads bf16 weights: with native GEMMs (AVX512-BF16, AMX)
    or, without them, through the AVX2 GEMV kernel next to fp32 GEMMs of the same values
    (vmkv.engine.cpu_linear); float32 elsewhere. On a 2-core AVX2 EPYC bf16 took 0.40-0.45x
    fp32's batch-1 decode time, 0.86x its batch-64 step and 0.92x its 1,000-token prefill
    (docs/engine.md)."""
    native = has_native_half_gemm(torch.bfloat16)
    return "bfloat16" if native or gemv_kernel.gemv_isa() is not None else "float32"


def add_engine_arguments(
    group: argparse._ActionsContainer,
    defaults: EngineConfig | None = None,
    skip: Collection[str] = (),
    default_dtype: str | None = None,
) -> None:
    """Add a flag for every EngineConfig field but those in `skip` (set by the caller instead).

    default_dtype may be "auto" (see auto_dtype); it defaults to defaults.dtype.
    """
    d = defaults or EngineConfig()
    named: set[str] = set()

    def add(field: str, flag: str, **options: object) -> None:
        named.add(field)
        if field not in skip:
            group.add_argument(flag, **{"dest": field, **options})

    add("model", "--model", default=DEFAULT_MODEL, help="model name or local checkpoint directory")
    add("kv_mode", "--kv-mode", choices=KV_MODES, default=d.kv_mode)
    add(
        "dtype",
        "--dtype",
        choices=[AUTO_DTYPE, *DTYPES],
        default=default_dtype or d.dtype,
        help=f"{AUTO_DTYPE}: bfloat16 where a decode step reads bf16 weights natively or through "
        "the AVX2 GEMV kernel, else float32",
    )
    add("device", "--device", default=d.device)
    add(
        "kv_budget_bytes",
        "--kv-budget-mib",
        dest="kv_budget_mib",
        type=positive_int,
        default=d.kv_budget_bytes // MIB,
        help="KV cache size in MiB",
    )
    add(
        "max_model_len",
        "--max-model-len",
        type=positive_int,
        default=d.max_model_len,
        help="longest prompt + generation, in tokens",
    )
    add("max_num_seqs", "--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    add(
        "max_num_batched_tokens",
        "--max-num-batched-tokens",
        type=positive_int,
        default=d.max_num_batched_tokens,
    )
    add("preemption_mode", "--preemption-mode", choices=PREEMPTION_MODES, default=d.preemption_mode)
    add(
        "scheduling_policy",
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=d.scheduling_policy,
        help="fcfs: arrival order; priority: each request's priority (lower first), then arrival",
    )
    add(
        "block_size",
        "--block-size",
        type=positive_int,
        default=d.block_size,
        help="tokens per block (paged mode)",
    )
    add(
        "page_size",
        "--page-size",
        type=positive_int,
        default=d.page_size,
        help="bytes per page (vattention mode; default: the device's, 2 MiB on a GPU; on a CPU 16 KiB "
        "token-major where it has AMX tiles, else 64 KiB)",
    )
    add(
        "kv_order",
        "--kv-order",
        choices=KV_ORDERS,
        default=d.kv_order,
        help="where vattention lays a sequence's K/V rows: packed (every layer per token, the most "
        "sequences per budget), token or head (a range per layer's K and V); auto: token at 16 KiB "
        "pages on a CPU with AMX tiles (faster there), else packed",
    )
    add(
        "kv_preallocate",
        "--kv-preallocate",
        action=argparse.BooleanOptionalAction,
        default=d.kv_preallocate,
        help="back vattention's whole KV budget at start, as the paged pool is (CPU), instead of "
        "as pages are first mapped; memory is then never given back to the OS",
    )
    add(
        "enable_prefix_caching",
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV of cached prompt prefixes (paged and vattention modes)",
    )
    add("seed", "--seed", type=int, default=d.seed, help="sampling seed of requests that give none")
    add(
        "num_threads",
        "--num-threads",
        type=positive_int,
        default=d.num_threads,
        help="torch threads of the engine (default: one per core; fewer where other work keeps a core busy)",
    )
    add(
        "fp32_gemm",
        "--fp32-gemm",
        action=argparse.BooleanOptionalAction,
        default=d.fp32_gemm,
        help="run half-precision linears as fp32 GEMMs (default: only where no native half GEMM exists)",
    )
    add(
        "compile_model",
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,  # EngineConfig resolves it: on where supported
        help="run the model under torch.compile, compiled once at start (default: on without tensor "
        "parallelism, which does not compile yet; docs/engine.md)",
    )
    add(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        type=positive_int,
        default=d.tensor_parallel_size,
        help="ranks the model is split over, each with 1/N of its heads and KV",
    )
    add(
        "tensor_parallel_local_ranks",
        "--tensor-parallel-local-ranks",
        type=positive_int,
        default=d.tensor_parallel_local_ranks,
        help="ranks started on this machine (default: all); the rest join from others (docs/scale-out.md)",
    )
    add(
        "tensor_parallel_timeout",
        "--tensor-parallel-timeout",
        type=float,
        default=d.tensor_parallel_timeout,
        help="seconds without a heartbeat after which a rank is taken as hung and the engine stops",
    )
    add(
        "logits_processors",
        "--logits-processors",
        nargs="*",
        default=list(d.logits_processors),
        metavar="MODULE:CLASS",
        help="custom logits processors (vmkv.engine.LogitsProcessor subclasses), made at start; "
        "requests opt in with vllm_xargs (docs/engine.md)",
    )
    add(
        "enable_lora",
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=d.enable_lora,
        help='serve LoRA adapters: requests may name one (docs/engine.md, "LoRA adapters")',
    )
    add(
        "max_loras",
        "--max-loras",
        type=positive_int,
        default=d.max_loras,
        help="distinct adapters in one step",
    )
    add(
        "max_lora_rank",
        "--max-lora-rank",
        type=positive_int,
        default=d.max_lora_rank,
        help="the largest rank an adapter may have",
    )
    add(
        "max_cpu_loras",
        "--max-cpu-loras",
        type=positive_int,
        default=d.max_cpu_loras,
        help="adapters kept loaded, least recently used let go of first (default: --max-loras)",
    )
    add(
        "speculative_config",
        "--speculative-config",
        default=d.speculative_config,
        metavar="JSON",
        help='speculative decoding by n-gram prompt lookup, as vLLM takes it: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; drafts are cut to the tokens that pay '
        'at the batch size unless "adaptive_length": false (docs/engine.md)',
    )
    missing = {f.name for f in dataclasses.fields(EngineConfig)} - named
    assert not missing, f"EngineConfig fields without a flag: {missing}"


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The EngineConfig of parsed engine flags; `overrides` set the skipped fields (or replace any)."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "kv_budget_bytes" and hasattr(args, "kv_budget_mib"):
            values[f.name] = args.kv_budget_mib * MIB
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    values.update(overrides)
    if values.get("dtype") == AUTO_DTYPE:
        values["dtype"] = auto_dtype()
    if "device" in values:
        check_device(str(values["device"]))
    try:
        return EngineConfig(**values)
    except (TypeError, ValueError) as error:  # flags each fine alone, wrong together
        raise SystemExit(f"vmkv: error: {error}") from error


# Flags only vattention's cache reads.
VATTENTION_ONLY_FLAGS = {
    "page_size": "--page-size",
    "kv_order": "--kv-order",
    "kv_preallocate": "--kv-preallocate",
}


def ignored_flags(config: EngineConfig) -> list[str]:
    """The vattention-only flags set for another KV mode, which does not read them. Worth a
    warning, not an error: one set of flags with only --kv-mode changed is how modes are compared."""
    if config.kv_mode == "vattention":
        return []
    unset = EngineConfig()
    return [
        flag for name, flag in VATTENTION_ONLY_FLAGS.items() if getattr(config, name) != getattr(unset, name)
    ]


def check_device(text: str) -> torch.device:
    """--device as torch reads it, refused before anything is built where torch cannot use it
    (else the engine fails deep in its start with torch's own assertion)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SystemExit(f"vmkv: error: --device must be cpu or cuda[:N], got {text}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"vmkv: error: --device {text}: this torch sees no CUDA GPU")
    return device


def engine_flags(config: EngineConfig) -> list[str]:
    """The flags add_engine_arguments parses back into `config` (for a `vmkv serve` child)."""
    if config.kv_budget_bytes % MIB:
        raise ValueError(f"the KV budget flag is in MiB; {config.kv_budget_bytes} bytes is not whole MiB")
    out = [
        "--model", config.model,
        "--kv-mode", config.kv_mode,
        "--dtype", config.dtype,
        "--device", config.device,
        "--kv-budget-mib", str(config.kv_budget_bytes // MIB),
        "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--preemption-mode", config.preemption_mode,
        "--block-size", str(config.block_size),
        "--kv-order", config.kv_order,
        "--kv-preallocate" if config.kv_preallocate else "--no-kv-preallocate",
        "--seed", str(config.seed),
        "--prefix-caching" if config.enable_prefix_caching else "--no-prefix-caching",
        "--compile" if config.compile_model else "--no-compile",
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--tensor-parallel-timeout", str(config.tensor_parallel_timeout),
    ]  # fmt: skip
    if config.page_size is not None:
        out += ["--page-size", str(config.page_size)]
    if config.num_threads is not None:
        out += ["--num-threads", str(config.num_threads)]
    if config.tensor_parallel_local_ranks is not None:
        out += ["--tensor-parallel-local-ranks", str(config.tensor_parallel_local_ranks)]
    if config.fp32_gemm is not None:
        out.append("--fp32-gemm" if config.fp32_gemm else "--no-fp32-gemm")
    if config.logits_processors:
        out += ["--logits-processors", *config.logits_processors]
    if config.enable_lora:
        out += [
            "--enable-lora",
            "--max-loras",
            str(config.max_loras),
            "--max-lora-rank",
            str(config.max_lora_rank),
        ]
        out += ["--max-cpu-loras", str(config.max_cpu_loras)]
    if config.speculative_config is not None:
        out += ["--speculative-config", json.dumps(config.speculative_config.as_dict())]
    return out
