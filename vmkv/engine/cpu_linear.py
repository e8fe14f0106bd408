"""How a half-precision model's linear layers run on the CPU: native GEMMs where the CPU has
them, fp32 GEMMs of the same values where it has not, and a bf16 GEMV for decode either way.

Every half-precision Linear on the CPU becomes one call of the C++ operator
`vmkv::packed_linear` (gemv_kernel.py) with its weight in two forms: the original, which the
GEMV kernel streams for calls of a few rows (decode), and `packed`, which the GEMM for more
rows reads, prepared once at load (`linear_packing` says which):

- "pairs", for bf16 on AVX512-BF16 CPUs: the weight in column panels of bf16 pairs, read by
  vmkv's own GEMM (gemv_kernel.py). It takes the place of oneDNN's packed copy: no more memory.
  Without AMX it runs every row count, decode and prefill, on `vdpbf16ps`; on a 2-core Zen 4
  EPYC, over the default model's 30 layers of linears and its vocabulary projection (from
  memory, as in a step; benchmarks/bench_gemm.py) it took, against oneDNN with the GEMV up to 12
  rows: 1.00x at 1 row, 0.93-0.96x at 4-8, 0.71-0.81x at 12-32, 0.90x at 64, 0.98-0.99x at
  256-1,024. With AMX it runs past the GEMV's and the tile GEMM's rows, on the tile unit; on a
  2-core AMX Xeon, against oneDNN's GEMM there: 0.83x at 64 rows, 0.86-0.88x at 128-512, 0.76x
  at 1,024, 1.08x at 2,048.
- "onednn", with native half-precision instructions otherwise (fp16): oneDNN's
  prepacked layout. oneDNN's plain path re-lays the weight out on every call: prepacked, a
  batch-1 [1, 576] x [576, 1536] bf16 GEMM took 144 µs against 242 µs on one core of an
  AVX512-BF16 EPYC, and the 49,152-row vocabulary projection 4.2 ms against 6.8 ms, with
  bit-identical outputs. Under torch.compile the operator stays one opaque node (inductor
  lowers oneDNN's op only for frozen constant weights).
- "fp32", without them: torch's fallback bf16 GEMM is several times slower than fp32 (on a
  2-core AVX2 CPU, 7.8 against 52.6 GFLOP/s: `benchmarks/bench_gemm.py`), so the weight is
  also held in fp32 (the same values, in oneDNN's prepacked layout: 5-20% faster than MKL's
  plain fp32 GEMM from 8 rows up on a 2-core AVX2 EPYC, and 2x at the vocabulary projection)
  and more rows compute `linear(x.float(), W).to(bf16)`: a bf16 GEMM's arithmetic (fp32
  accumulation, one rounding of the output) through the fp32 kernel. The GEMV still reads the
  bf16 original: half the bytes of a pass over the weights.
- float32 models and GPUs are left alone.

The linears of a layer that read one input (q/k/v, gate/up) run as one call with one weight
(SHARED_INPUT_GROUPS); the model's code still calls its modules one by one.
"""

from __future__ import annotations

from functools import partial

import torch

from vmkv.engine import gemv_kernel
from vmkv.engine.config import EngineConfig


def linear_packing(config: EngineConfig) -> str | None:
    """ "pairs", "onednn", "fp32" or None (plain torch Linears): see the module's docstring.
    config.fp32_gemm forces "fp32" (True), or torch's own half-precision GEMM where the CPU has
    no native one (False)."""
    if config.torch_dtype == torch.float32 or torch.device(config.device).type != "cpu":
        return None
    native = has_native_half_gemm(config.torch_dtype)
    if config.fp32_gemm if config.fp32_gemm is not None else not native:
        return "fp32"
    if not native:
        return None
    return "pairs" if config.torch_dtype == torch.bfloat16 and gemv_kernel.pairs_gemm() else "onednn"


def has_native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` with its own instructions: bf16 with AVX512-BF16 or
    AMX, fp16 with AVX512-FP16 or AMX-FP16 (oneDNN's check). The instruction sets, not
    oneDNN's bf16 check: that one also says yes on plain AVX-512, where bf16 is emulated."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


# Linears of one layer that read the same input, by transformers' names for them: each group
# runs as one GEMM (vLLM's QKVParallelLinear and MergedColumnParallelLinear do the same by
# rewriting the model; here the model's code calls its three or two modules as before). On a
# 2-core AVX2 EPYC, [64, 576] x [576, 960] took 0.74 ms against 0.97 for q, k and v apart
# (gate/up: level). Default model, compiled, an engine with and one without the groups
# alternated in one process, medians of 10 rounds: a paged decode step of 64 sequences at ~300
# tokens 211.7 -> 204.7 ms; batch-1 steps within the run's noise (paged 24.4 -> 23.3 ms,
# vattention 20.8 -> 21.6).
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_linears(model: torch.nn.Module, packing: str) -> None:
    """Give each half-precision Linear the `packed` form of its weight (`linear_packing`) next
    to the original, which the GEMV kernel reads and a tied lm_head shares with the embedding:
    one more copy of the linear weights ("onednn"), or one of twice their size ("fp32").
    The linears of a SHARED_INPUT_GROUPS group get one packed weight and one call for all."""
    gemv_kernel.register()
    grouped: set[torch.nn.Linear] = set()
    for parent in model.modules():
        for names in SHARED_INPUT_GROUPS:
            group = [getattr(parent, name, None) for name in names]
            if _can_share_input(group):
                _pack_group(group, packing)
                grouped.update(group)
    for module in _half_linears(model):
        if module not in grouped:
            module.packed_weight = pack_weight(module.weight.detach(), packing)
            module.forward = partial(_packed_linear, module)


def _half_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.float32]


def pack_weight(weight: torch.Tensor, packing: str) -> torch.Tensor:
    """`weight` [out, in] in the form the GEMM of `packing` reads (linear_packing)."""
    if packing == "pairs" and weight.shape[1] % 2 == 0:  # an odd input width keeps oneDNN's form
        return gemv_kernel.in_pairs(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.float() if packing == "fp32" else weight)


def _packed_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.vmkv.packed_linear.default(x, module.weight, module.packed_weight, module.bias)


def _can_share_input(group: list[object]) -> bool:
    first = group[0]
    return all(
        isinstance(m, torch.nn.Linear)
        and m.weight.dtype == first.weight.dtype != torch.float32
        and m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        for m in group
    )


def _pack_group(group: list[torch.nn.Linear], packing: str) -> None:
    """One weight for the group, rows in group order; each module's weight (and bias) becomes
    a view of its rows, so the bf16 weights are held once."""
    sizes = [m.out_features for m in group]
    weight = torch.cat([m.weight.detach() for m in group])
    bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group])
    shared = _SharedInput(weight, pack_weight(weight, packing), bias, sizes)
    biases = bias.split(sizes) if bias is not None else [None] * len(group)
    for index, (module, rows, rows_bias) in enumerate(zip(group, weight.split(sizes), biases, strict=True)):
        module.weight.data = rows
        if rows_bias is not None:
            module.bias.data = rows_bias
        module.forward = partial(shared.output, index)


class _SharedInput:
    """The linears of one group as one operator call: the first module called runs it for all
    and keeps the outputs (views of one tensor), the others take theirs.

    Outputs are kept for the input they were computed from, compared by identity: a call with
    any other tensor computes again, so any order of calls is correct. (The reference held to
    that input keeps its identity from being reused; the model must not change it in place
    between the calls, which transformers' attention and MLP never do.) They are released when
    the last module takes its output. Under torch.compile dynamo traces this like the model's
    own code: the graph has one call per group."""

    def __init__(
        self, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
    ) -> None:
        self.weight, self.packed, self.bias, self.sizes = weight, packed, bias, sizes
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:
            out = torch.ops.vmkv.packed_linear.default(x, self.weight, self.packed, self.bias)
            self._input, self._outputs = x, out.split(self.sizes, dim=-1)
        out = self._outputs[index]
        if index == len(self.sizes) - 1:
            self._input, self._outputs = None, ()
        return out


def packed_logits(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A packed Linear's output as fp32 (the vocabulary projection): the values `module(x)`
    gives, rounded to its half precision, without a half-precision tensor in between."""
    return torch.ops.vmkv.packed_logits.default(x, module.weight, module.packed_weight, module.bias)


def packed_slots(model: torch.nn.Module) -> list[tuple[object, str]]:
    """Where the packed weights pack_linears made are held, in module order: (holder, attribute)
    pairs, for the engine's sleep mode to let go of and refill them (sleep.py)."""
    slots: list[tuple[object, str]] = []
    shared_seen: set[int] = set()
    for module in model.modules():
        if "packed_weight" in module.__dict__:
            slots.append((module, "packed_weight"))
        forward = module.__dict__.get("forward")
        shared = getattr(getattr(forward, "func", None), "__self__", None)
        if isinstance(shared, _SharedInput) and id(shared) not in shared_seen:
            shared_seen.add(id(shared))
            slots += [(shared, "weight"), (shared, "packed"), (shared, "bias")]
    return slots
