"""Rotary cos/sin computed once per forward under torch.compile, by the model's own module.

A transformers decoder computes its rotary embedding once per forward (`rotary_emb`: cos and
sin of position x frequency) and hands it to every layer. Inductor inlines those few
pointwise ops on position_ids into each layer's kernel that applies them, so every layer
evaluates sin and cos again for each of its q and k elements. On a 2-core AMX Xeon that fused
kernel took 1.8 ms per layer of a 2,048-token prefill step (54 ms of ~440; torch profiler with
inductor's kernel profiling). Inside the opaque op `vmkv::rotary_embedding`, the module's own
forward runs eagerly, once, and the layers' kernels read its two small outputs. The model code
stays unmodified: the op calls the module's forward, so the values are the eager ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Rotary:
    forward: weakref.WeakMethod  # the module's own forward; weak, so a closed engine's model goes
    dim: int  # last dimension of cos and sin


_rotaries: list[_Rotary] = []  # the op's `key` indexes this


def _rotary_kernel(
    x: torch.Tensor, position_ids: torch.Tensor, key: int
) -> tuple[torch.Tensor, torch.Tensor]:
    forward = _rotaries[key].forward()
    if forward is None:
        raise RuntimeError("the rotary embedding module of this compiled decoder no longer exists")
    cos, sin = forward(x, position_ids)
    return cos.contiguous(), sin.contiguous()


def _rotary_fake(x: torch.Tensor, position_ids: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*position_ids.shape, _rotaries[key].dim)
    return x.new_empty(shape), x.new_empty(shape)


_LIBRARY = torch.library.Library("vmkv", "FRAGMENT")
_LIBRARY.define("rotary_embedding(Tensor x, Tensor position_ids, int key) -> (Tensor, Tensor)")
_LIBRARY.impl("rotary_embedding", _rotary_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("vmkv::rotary_embedding", _rotary_fake, lib=_LIBRARY)
rotary_op = torch.ops.vmkv.rotary_embedding.default


def route_rotary_embedding(decoder: torch.nn.Module) -> bool:
    """Make `decoder.rotary_emb` run as one opaque op while compiling (eagerly as before);
    False, changing nothing, where the decoder has no such module or its forward does not
    return (cos, sin) of the input's dtype, one row per position."""
    module = getattr(decoder, "rotary_emb", None)
    if not isinstance(module, torch.nn.Module):
        return False
    original = module.forward
    probe = torch.zeros(1, 1, 1, dtype=torch.float32)
    try:
        with torch.inference_mode():
            out = original(probe, torch.zeros(1, 1, dtype=torch.long))
    except Exception:  # noqa: BLE001 - an unusual rotary module keeps its own forward
        return False
    pair = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    if not pair or any(t.dim() != 3 or t.shape[:2] != (1, 1) or t.dtype != probe.dtype for t in out):
        return False
    key = len(_rotaries)
    _rotaries.append(_Rotary(weakref.WeakMethod(original), out[0].shape[-1]))
    module.forward = _routed(original, key)
    return True


def _routed(original: Callable, key: int) -> Callable:
    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return rotary_op(x, position_ids, key)
        return original(x, position_ids)

    return forward
