"""Runs an unmodified transformers decoder over one packed (varlen) step.

Every scheduled sequence's new tokens are concatenated into a single [1, T] batch with
their true positions, so prefill chunks and decode tokens share one forward. The model's
attention layers call `vmkv_attention` (registered with transformers' attention
interface), which hands each layer's q/k/v to the KV cache together with the step's plan;
the plan travels through a module-level context because the model code passes no
engine state down. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import chain

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from vmkv.engine.config import EngineConfig
from vmkv.engine.scheduler import ScheduledSeq
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.model.store import load_model

ATTENTION_NAME = "vmkv"
LOGIT_SLICE = 1024  # vocabulary rows per lm_head GEMM on the CPU


@dataclass
class _StepContext:
    cache: KVCache | None = None
    plan: object = None


_step = _StepContext()


def vmkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query (1, Hq, T, D), key/value (1, Hkv, T, D), RoPE applied -> ((1, T, Hq, D), None).

    The [T, H, D] views are free: q/k/v were produced as [1, T, H, D] and only transposed.
    The cache copies k/v into its own storage, so they need not be contiguous.
    """
    if _step.cache is None:
        raise RuntimeError("vmkv attention called outside an engine step")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _step.cache.attend(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        _step.plan,
        scale,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, vmkv_attention)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)  # causality lives in the cache


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.device = torch.device(config.device)
        self.model = load_model(model_path, dtype=config.torch_dtype, attn_implementation=ATTENTION_NAME)
        window = getattr(self.model.config, "sliding_window", None)
        if window is not None and window < config.max_model_len:
            # every layout attends over the whole context; past the window that would be wrong
            raise ValueError(
                f"{model_path} attends over a sliding window of {window} tokens, which vmkv does not "
                f"implement; set max_model_len <= {window} (it is {config.max_model_len})"
            )
        self.model.to(self.device)
        self.fp32_gemm = _wants_fp32_gemm(config)
        if self.fp32_gemm:
            _run_linears_in_fp32(self.model)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        hf = self.model.config
        self.vocab_size = hf.vocab_size
        self.kv_shape = KVShape(
            num_layers=hf.num_hidden_layers,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            dtype=config.torch_dtype,
        )
        self.max_position_embeddings = getattr(hf, "max_position_embeddings", None)
        self._positions = torch.arange(config.max_num_batched_tokens, device=self.device)

    @torch.inference_mode()
    def execute(self, cache: KVCache, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; returns float32 logits [S, V] for the scheduled rows that sample, in order."""
        steps = [SeqStep(s.seq.seq_id, s.seq.num_computed, s.num_new) for s in scheduled]
        batch = StepBatch.build(steps, self.device)
        num_tokens = int(batch.query_start[-1])
        input_ids = torch.tensor(
            list(
                chain.from_iterable(
                    s.seq.token_ids[s.seq.num_computed : s.seq.num_computed + s.num_new] for s in scheduled
                )
            ),
            dtype=torch.long,
            device=self.device,
        )
        # position of packed row r = r - (first row of its sequence) + (its sequence's num_cached)
        offsets = torch.repeat_interleave(batch.num_cached - batch.query_start[:-1], batch.query_start.diff())
        positions = self._positions[:num_tokens] + offsets

        _step.cache, _step.plan = cache, cache.prepare(batch)
        try:
            hidden = self.decoder(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            ).last_hidden_state[0]
        finally:
            _step.cache, _step.plan = None, None
        last_rows = [i for i, s in enumerate(scheduled) if s.samples]
        rows = batch.query_start[1:][last_rows] - 1
        return self._logits(hidden[rows])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on the sampling rows, as float32 [S, V]; on the CPU through linear_in_slices."""
        if self.device.type != "cpu" or not isinstance(self.lm_head, torch.nn.Linear):
            return self.lm_head(hidden).float()
        weight, bias = self.lm_head.weight, self.lm_head.bias
        x = hidden.to(weight.dtype)
        out = linear_in_slices(
            x, weight, torch.empty(len(x), weight.shape[0], dtype=weight.dtype, device=x.device)
        )
        if bias is not None:
            out += bias
        return out.to(hidden.dtype).float()  # a half-precision model rounds its logits, as the model would


def linear_in_slices(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T, LOGIT_SLICE rows of weight per GEMM; returns out.

    For the vocabulary projection on the CPU: a slice's output stays in cache, and MKL runs
    [64, 576] x [576, 49152] about 1.7x faster this way (benchmarks/bench_engine.py lm-head).
    Each output is the same dot product either way.
    """
    for start in range(0, weight.shape[0], LOGIT_SLICE):
        rows = slice(start, start + LOGIT_SLICE)
        torch.mm(x, weight[rows].t(), out=out[:, rows])
    return out


def _wants_fp32_gemm(config: EngineConfig) -> bool:
    if config.fp32_gemm is not None:
        return config.fp32_gemm
    if config.torch_dtype == torch.float32 or torch.device(config.device).type != "cpu":
        return False
    if config.torch_dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _run_linears_in_fp32(model: torch.nn.Module) -> None:
    """Hold each half-precision Linear's weight in fp32 (exactly the same values) and compute
    in fp32, rounding the output back: one fp32 GEMM per layer instead of a slow half one.
    Embeddings stay in half precision; a tied lm_head gets its own fp32 copy."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.detach().float(), requires_grad=False)
            module.forward = partial(_fp32_linear, module)


def _fp32_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), module.weight, module.bias).to(x.dtype)
