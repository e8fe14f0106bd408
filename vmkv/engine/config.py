"""Engine configuration: one dataclass, validated once, shared by every part of the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.engine.speculative import SpeculativeConfig
from vmkv.vattention.geometry import ORDERS

KV_MODES = ("vattention", "paged", "contiguous")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_ORDERS = ("auto", *ORDERS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What compile_model=None becomes where compiling is supported (one rank).
COMPILE_BY_DEFAULT = True


@dataclass
class EngineConfig:
    """What the engine serves and under which limits.

    kv_budget_bytes bounds the KV cache (the CPU analogue of a GPU memory fraction).
    max_num_batched_tokens is the per-step token budget that chunks long prompts, so a
    long prefill never stalls running decodes for more than one step's worth of tokens.
    """

    model: str = "SmolLM2-135M-Instruct"
    kv_mode: str = "vattention"
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_budget_bytes: int = 1 << 30
    max_model_len: int = 2048
    max_num_seqs: int = 64
    # vLLM's CPU server default. On a 2-core AMX Xeon, 64 prompts of 256 tokens at once (128 out):
    # served 475-537 against 447-503 out tok/s at 1,024 (four alternated waves, vattention), with
    # lower TPOT in each; offline paged 683-701 against 627-642, vattention 575-610 against 561;
    # 4,096 was no faster (docs/engine.md, "Scheduler policy")
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    # fcfs: requests run in arrival order; priority: by each request's priority (lower first,
    # then arrival), which also decides who is preempted (vLLM's policies)
    scheduling_policy: str = "fcfs"
    block_size: int = 16  # paged layout only
    page_size: int | None = None  # vattention layout only, in bytes; None: the device's
    # vattention layout only: where a sequence's K/V rows lie in its virtual range (geometry.py).
    # "auto" with no page_size: the device's measured default (vattention.config.default_layout:
    # token-major at 16 KiB pages on CPUs with AMX tiles, else layer-packed); with a page_size,
    # layer-packed, the most sequences per budget
    kv_order: str = "auto"
    # vattention layout on the CPU only: back the whole KV budget at start, as the paged pool is,
    # instead of as pages are first mapped (docs/vattention.md, "Backing the pool up front")
    kv_preallocate: bool = False
    enable_prefix_caching: bool = True  # paged and vattention layouts
    seed: int = 0  # for requests that give no seed of their own
    # torch's intra-op threads for the engine's process; None leaves torch's default (one per core)
    num_threads: int | None = None
    # On the CPU, run bf16/fp16 linear layers as fp32 GEMMs of the same values, rounding outputs
    # back: the arithmetic of a half-precision GEMM (fp32 accumulation), for CPUs that lack one
    # natively, where torch's fallback is several times slower (benchmarks/bench_gemm.py); decode
    # calls of a few rows still read the bf16 weights (engine/cpu_linear.py). None: only where
    # no native kernel exists.
    fp32_gemm: bool | None = None
    # Run the decoder under torch.compile (inductor), compiled once at start; eager if off or if
    # compiling fails. None: on wherever it is supported (one rank). It costs ~30 s at start and
    # gains 1.3-1.5x offline throughput (docs/engine.md); False for short-lived engines.
    compile_model: bool | None = None
    # Ranks the model is split over (its attention heads and MLP columns): this process and
    # tensor_parallel_size - 1 workers (vmkv/distributed). kv_budget_bytes is the whole
    # engine's; each rank holds 1/N of it. docs/scale-out.md.
    tensor_parallel_size: int = 1
    # How many ranks run on this machine (this process and the workers it starts); the others
    # are started on other machines with the rendezvous variables. None: all of them.
    tensor_parallel_local_ranks: int | None = None
    # Seconds without a heartbeat after which a rank that has not exited (stopped, frozen) is
    # taken as hung: the engine fails its requests and stops, as for a rank that died.
    tensor_parallel_timeout: float = 10.0
    # Custom logits processors, "package.module:Class" each (vmkv.engine.logits_processors),
    # made once at start in the engine's process; requests opt in through their extra_args.
    logits_processors: tuple[str, ...] = ()
    # LoRA adapters (vmkv.engine.lora): requests may name one; every linear layer of the decoder
    # then adds its adapters' terms to their rows. max_loras: distinct adapters in one step;
    # max_lora_rank: the largest rank an adapter may have; max_cpu_loras: adapters kept loaded.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # Speculative decoding by n-gram prompt lookup (vmkv.engine.speculative): vLLM's
    # speculative_config, as a SpeculativeConfig, its dict or its JSON text; None: off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in (
            "kv_budget_bytes",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int)
            or isinstance(self.num_threads, bool)
            or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be a positive integer or None, got {self.num_threads!r}")
        if self.kv_order not in KV_ORDERS:
            raise ValueError(f"kv_order must be one of {KV_ORDERS}, got {self.kv_order!r}")
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise ValueError(f"page_size must be a positive integer or None, got {self.page_size!r}")
        local = self.tensor_parallel_local_ranks
        whole = isinstance(local, int) and not isinstance(local, bool)
        if local is not None and not (whole and 1 <= local <= self.tensor_parallel_size):
            raise ValueError(
                f"tensor_parallel_local_ranks must be None or 1..tensor_parallel_size "
                f"({self.tensor_parallel_size}), got {local!r}"
            )
        timeout = self.tensor_parallel_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be a positive number of seconds, got {timeout!r}")
        self.logits_processors = tuple(self.logits_processors)
        if not all(isinstance(name, str) and name for name in self.logits_processors):
            raise ValueError(f"logits_processors must be class names, got {self.logits_processors!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        cpu_loras = self.max_cpu_loras
        if isinstance(cpu_loras, bool) or not isinstance(cpu_loras, int) or cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu_loras!r}"
            )
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1")
        if self.tensor_parallel_size > 1 and self.compile_model:
            raise ValueError("compile_model is not supported with tensor_parallel_size > 1 yet")
        if self.compile_model is None:
            self.compile_model = COMPILE_BY_DEFAULT and self.tensor_parallel_size == 1
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Decodes go first and take one token each: the budget must cover every running sequence.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
