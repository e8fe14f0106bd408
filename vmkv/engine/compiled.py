"""The decoder under torch.compile (inductor), compiled once at start for every token count.

The model code stays unmodified: attention reaches the KV cache through the custom op
`vmkv::attention` (attention_hook.py), which inductor treats as an opaque call with a known
output shape, so the whole decoder is one graph per shape class instead of breaking at each
of its layers, and the cache's own kernels run inside the op as in eager mode.

Shapes: the packed batch is [1, T]. `dynamic=True` compiles T symbolically, and dynamo
specialises T == 1 on its own, so two warm-up forwards (T = 1 and T = 2) compile the two
graphs every later step uses: batch-1 decode, and any other step (prefill chunks of any
length, decode batches). Later steps run under the "eager_on_recompile" stance: a shape the
guards did not foresee runs that step eagerly instead of stalling it for a compile.

Guards: dynamo checks ~5,400 of them before each call (the model's modules, parameters and
globals): 2.0 ms of a ~17 ms batch-1 step on two cores, and still ~1.0 ms when only the
guards telling the two graphs apart were evaluated. The engine calls one decoder the same way
every step with only T varying, so the compiled graphs keep only the guards on the inputs
(their shapes, hence the choice between the two graphs) and on global state such as grad
mode: ~0.1 ms. What makes that safe is the entry point: dynamo keeps compiled graphs per code
object, and each engine compiles a function with a code object of its own around its decoder,
so no call of another engine (another model, another dtype) can match these graphs.
Inductor caches generated code on disk (torch's FX graph and AOTAutograd caches), so another
engine compiling the same model mostly pays dynamo's tracing.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vmkv.engine import gemv_kernel
from vmkv.engine.attention_hook import step_context
from vmkv.engine.gated_fusion import FuseGatedLinears
from vmkv.engine.rotary_hook import route_rotary_embedding

if TYPE_CHECKING:
    from torch._dynamo.types import GuardFilterEntry

logger = logging.getLogger(__name__)

WARMUP_TOKEN_COUNTS = (1, 2)  # T == 1 is its own graph; T == 2 compiles the symbolic one
# The generated code checks every extern call's output sizes and strides in Python: ~780
# checks per decode step of the default model at ~0.45 µs each: ~0.35 ms of a ~16 ms step.
COMPILE_OPTIONS = {"size_asserts": False}
# On the CPU the generated wrapper, which calls the graph's ~15 kernels and extern ops per layer,
# is C++ instead of Python. On a 2-core AVX2 EPYC, batch-1 decode at 300 tokens of context: the
# graph's own time 1.5-2.2 ms per step instead of 3.2-4.0 (steps 17-21 ms instead of 19-24,
# three processes each, alternating), ~3 ms less per batch-64 step. The wrapper is compiled
# apart from the kernels, so its compile adds seconds, not minutes: a first start with an empty
# cache took 173 s instead of 166 (one file for both: ~440 s).
CPU_COMPILE_OPTIONS = {**COMPILE_OPTIONS, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}
INPUTS = ("input_ids", "position_ids", "use_cache")  # the entry point's arguments


class _WarmupAttention:
    """Stands in for a KV cache while compiling: causal attention over the step's own tokens.

    Only the graph around the opaque attention op is being compiled, so its values do not matter."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object, scale: float
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1).contiguous()

    def kernel_step(self, plan: object) -> None:
        """No decode kernel: every layer goes through attend()."""
        return None


def _entry_point(decoder: torch.nn.Module) -> Callable[..., object]:
    """`decoder` called through a function whose code object is new, so dynamo's cache of
    compiled graphs (kept per code object) holds this engine's graphs and no other's."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool) -> object:
        return decoder(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    code = forward.__code__.replace()  # equal, but a distinct object
    return types.FunctionType(code, forward.__globals__, forward.__name__, None, forward.__closure__)


def _input_guards(guards: Sequence[GuardFilterEntry]) -> list[bool]:
    """Keep the guards on the entry point's arguments and on global state (unnamed); drop
    those on the model's modules, parameters and globals, which never change under an engine."""
    return [not g.name or g.name.split(".")[0].split("[")[0] in INPUTS for g in guards]


def compile_decoder(decoder: torch.nn.Module, device: torch.device) -> Callable[..., object] | None:
    """Compile `decoder` and run the warm-up forwards; None (with a warning naming the cause)
    if torch.compile cannot handle it, so the caller keeps the eager decoder."""
    options = CPU_COMPILE_OPTIONS if device.type == "cpu" else COMPILE_OPTIONS
    bf16 = next(decoder.parameters()).dtype == torch.bfloat16
    if device.type == "cpu" and bf16 and gemv_kernel.gated_gemm():
        options = {**options, "post_grad_custom_post_pass": FuseGatedLinears()}
    route_rotary_embedding(decoder)  # cos/sin once per forward, not in every layer's kernel
    compiled = torch.compile(
        _entry_point(decoder), dynamic=True, options={**options, "guard_filter_fn": _input_guards}
    )
    logger.info("compiling the decoder with torch.compile (inductor) for every token count ...")
    start = time.monotonic()
    try:
        # Python floats of the model (RMSNorm's epsilon, a power of 2) as constants: made
        # symbolic, dynamo failed to turn them into tensors and traced each graph again. On a
        # 2-core AVX2 EPYC, with inductor's cache warm, the compile took 22 s instead of 75-88.
        with (
            torch._dynamo.config.patch(specialize_float=True),
            torch.inference_mode(),
            step_context(_WarmupAttention(), None),  # type: ignore[arg-type]
        ):
            for num_tokens in WARMUP_TOKEN_COUNTS:
                positions = torch.arange(num_tokens, device=device)[None]
                compiled(input_ids=torch.zeros_like(positions), position_ids=positions, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: serve eagerly
        logger.warning("torch.compile failed, running the model eagerly: %s: %s", type(exc).__name__, exc)
        return None
    logger.info("compiled the decoder in %.1f s", time.monotonic() - start)
    return compiled


def compiled_stance() -> AbstractContextManager[None]:
    """Around each compiled step: a shape outside the compiled guards runs eagerly, never
    recompiles."""
    return torch.compiler.set_stance("eager_on_recompile")
