"""Split an unmodified Llama / Qwen2 / Mistral decoder over tensor-parallel ranks (Megatron style).

Each rank keeps 1/N of the attention heads (q, k and v projections by output rows, the
output projection by input columns) and 1/N of the MLP (gate and up by rows, down by
columns); an all-reduce after the output and down projections sums the ranks' partial
results, so every rank holds the full hidden states between layers. Embeddings, norms and
lm_head stay whole (only rank 0 runs lm_head). The model code is not touched: its attention
infers the head count from the projection's output size (`view(..., -1, head_dim)`), and the
KV cache is built for the rank's KV heads.

Why not transformers' `tp_plan="auto"`: it leaves DTensor parameters, which the engine's CPU
linears (fp32 copies, oneDNN prepacking in cpu_linear.py) cannot take, and it gathers
lm_head on every rank, while only rank 0 samples (docs/scale-out.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from vmkv.distributed.errors import TensorParallelConfigError, TensorParallelError
from vmkv.engine.config import EngineConfig
from vmkv.kv_cache import KVCache, KVShape
from vmkv.vattention import VAttentionKVCache

ATTENTION_ROWS = ("q_proj", "k_proj", "v_proj")
MLP_ROWS = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    # rank 0: which rank is gone, if one is, for the error a failed all-reduce raises
    failure_reason: Callable[[], str | None] | None = None


def check_divides(hf_config: object, world_size: int) -> None:
    """Refuse a split that would cut a head (or the GQA grouping, or an MLP column block) in two."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    mlp = hf_config.intermediate_size
    if heads % world_size or kv_heads % world_size or mlp % world_size:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {world_size} must divide the model's {heads} attention heads, "
            f"{kv_heads} KV heads and {mlp} MLP columns"
        )


def rank_kv_shape(shape: KVShape, world_size: int) -> KVShape:
    """What one rank's cache stores: its share of the KV heads."""
    return replace(shape, num_kv_heads=shape.num_kv_heads // world_size)


def rank_config(config: EngineConfig) -> EngineConfig:
    """The config one rank builds its cache from: kv_budget_bytes is the engine's, split evenly,
    so every rank's cache has as many blocks (or slots) as one cache of the whole budget."""
    return replace(config, kv_budget_bytes=config.kv_budget_bytes // config.tensor_parallel_size)


def kv_storage_bytes(cache: KVCache) -> int:
    """The physical bytes a rank's cache holds for KV: its page pool (vattention, whose
    reservation is address space only), else the storage it allocated up front."""
    if isinstance(cache, VAttentionKVCache):
        return cache.pool.num_sets * cache.geometry.page_set_bytes
    return cache.memory().reserved_bytes


def shard_model(model: torch.nn.Module, shard: Shard) -> None:
    """Keep this rank's part of every decoder layer's projections, in place; installs the all-reduces."""
    check_divides(model.config, shard.world_size)
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in ATTENTION_ROWS:
            _keep_rows(_linear(attention, name), shard)
        for name in MLP_ROWS:
            _keep_rows(_linear(mlp, name), shard)
        _keep_columns(_linear(attention, "o_proj"), shard)
        _keep_columns(_linear(mlp, "down_proj"), shard)


def _linear(parent: torch.nn.Module, name: str) -> torch.nn.Linear:
    module = getattr(parent, name, None)
    if not isinstance(module, torch.nn.Linear):
        raise TensorParallelConfigError(
            f"tensor parallelism splits Llama/Qwen2/Mistral-style layers; {type(parent).__name__} "
            f"has no Linear {name}"
        )
    return module


def _part(size: int, shard: Shard) -> slice:
    step = size // shard.world_size
    return slice(shard.rank * step, (shard.rank + 1) * step)


def _keep_rows(linear: torch.nn.Linear, shard: Shard) -> None:
    rows = _part(linear.out_features, shard)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: torch.nn.Linear, shard: Shard) -> None:
    columns = _part(linear.in_features, shard)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=False)
    if linear.bias is not None and shard.rank != 0:
        linear.bias = None  # the sum over ranks adds rank 0's bias once
    linear.in_features = linear.weight.shape[1]
    linear.register_forward_hook(_sum_over_ranks(shard))


def _sum_over_ranks(shard: Shard) -> Callable[..., torch.Tensor]:
    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(output, group=shard.group)
        except RuntimeError as error:  # a rank is gone (gloo and NCCL name only its address)
            reason = shard.failure_reason() if shard.failure_reason is not None else None
            raise TensorParallelError(reason or f"an all-reduce between the ranks failed: {error}") from error
        return output

    return hook
