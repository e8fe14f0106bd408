"""Routes an unmodified transformers model's attention calls to the KV cache of the running step.

`vmkv_attention` is registered with transformers' AttentionInterface, so every attention
layer of a model loaded with attn_implementation="vmkv" calls it with q/k/v after RoPE. The
step's cache and plan travel through a module-level context set around the forward, because
the model code passes no engine state down to attention.

Under torch.compile the call goes through the custom op `vmkv::attention` instead: the
compiler sees one opaque node with a known output shape (its fake implementation), so the
graph does not break at every layer, and inside the op the cache's `attend` runs exactly as
in eager mode, whatever the layout and whatever kernel the layout uses. On the CPU the op is
C++ (native_attention.py): in a step the decode kernel runs alone (`KVCache.kernel_step`) it
calls the kernel itself, eager or compiled; otherwise it calls `attend` here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from vmkv.engine import native_attention
from vmkv.kv_cache import KVCache

ATTENTION_NAME = "vmkv"


@dataclass
class _StepContext:
    cache: KVCache | None = None
    plan: object = None
    native: bool = False  # the native op runs this step's layers (a kernel step)


_step = _StepContext()


@contextmanager
def step_context(cache: KVCache, plan: object) -> Iterator[None]:
    """Make `cache` and its plan the target of every attention call inside the block."""
    kernel_step = cache.kernel_step(plan)
    native = kernel_step is not None and native_attention.load()
    _step.cache, _step.plan, _step.native = cache, plan, native
    try:
        with native_attention.kernel_step_scope(kernel_step) if native else nullcontext():
            yield
    finally:
        _step.cache, _step.plan, _step.native = None, None, False


def attend_in_step(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] through the current step's cache."""
    if _step.cache is None:
        raise RuntimeError("vmkv attention called outside an engine step")
    return _step.cache.attend(layer, q, k, v, _step.plan, scale)


def _attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    out = attend_in_step(layer, q, k, v, scale)
    # an operator's output may not alias its inputs; a layout that returns q's buffer pays a copy
    return out.clone() if out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() else out


def _attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# `vmkv::attention`: `attend_in_step` as one opaque graph node. It writes k/v into the cache's
# own storage, which no graph tensor aliases, so a schema with no mutated arguments is accurate.
# Defined with a plain Library rather than torch.library.custom_op: the latter's Python wrapper
# costs ~10 µs more per call, 30 times per decode step of the default model. The native op
# registers its CPU kernel over this one and reaches `attend_in_step` as `vmkv::cache_attention`.
_SCHEMA = "(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor"
_LIBRARY = torch.library.Library("vmkv", "FRAGMENT")
for _name in ("attention", "cache_attention"):
    _LIBRARY.define(_name + _SCHEMA)
    _LIBRARY.impl(_name, _attention_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"vmkv::{_name}", _attention_fake, lib=_LIBRARY)
attention_op = torch.ops.vmkv.attention.default


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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if torch.compiler.is_compiling() or _step.native:
        out = attention_op(q, k, v, module.layer_idx, scale)
    else:  # eager: skip the custom op's dispatch, about 10 µs per layer
        out = attend_in_step(module.layer_idx, q, k, v, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, vmkv_attention)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)  # causality lives in the cache
