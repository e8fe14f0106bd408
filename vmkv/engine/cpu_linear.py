"""How a half-precision model's linear layers run on the CPU: native GEMMs where the CPU has
them, fp32 GEMMs of the same values where it has not.

- With native bf16/fp16 instructions (AVX512-BF16 or AMX for bf16) every Linear keeps its
  values and runs through oneDNN with its weight prepacked once at load. oneDNN's plain
  path re-lays the weight out on every call: prepacked, a batch-1 [1, 576] x [576, 1536]
  bf16 GEMM took 144 µs against 242 µs on one core of an AVX512-BF16 EPYC, and the
  49,152-row vocabulary projection 4.2 ms against 6.8 ms, with bit-identical outputs.
  Every call is the C++ operator `vmkv::packed_linear` (gemv_kernel.py): calls of a few rows
  (decode) run its bf16 GEMV kernel where the CPU has AVX512-BF16, the rest oneDNN's GEMM.
  Under torch.compile it stays one opaque node (inductor lowers oneDNN's op only for
  frozen constant weights).
- Without them torch's fallback bf16 GEMM is several times slower than fp32 (on a 2-core AVX2
  CPU, 7.8 against 52.6 GFLOP/s: `benchmarks/bench_gemm.py`), so each Linear's weight
  is held in fp32 (the same values) and computes `linear(x.float(), W).to(bf16)`: a bf16
  GEMM's arithmetic (fp32 accumulation, one rounding of the output) through the fp32 kernel.
- float32 models and GPUs are left alone.
"""

from __future__ import annotations

from functools import partial

import torch

from vmkv.engine import gemv_kernel
from vmkv.engine.config import EngineConfig


def wants_fp32_gemm(config: EngineConfig) -> bool:
    """Whether half-precision Linears run as fp32 GEMMs: config.fp32_gemm, else exactly on
    CPUs without a native GEMM for the model's dtype."""
    if config.fp32_gemm is not None:
        return config.fp32_gemm
    if config.torch_dtype == torch.float32 or torch.device(config.device).type != "cpu":
        return False
    return not has_native_half_gemm(config.torch_dtype)


def has_native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` with its own instructions: bf16 with AVX512-BF16 or
    AMX, fp16 with AVX512-FP16 or AMX-FP16 (oneDNN's check). The instruction sets, not
    oneDNN's bf16 check: that one also says yes on plain AVX-512, where bf16 is emulated."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def wants_packed_gemm(config: EngineConfig, fp32_gemm: bool) -> bool:
    """Prepacked oneDNN GEMMs: a half-precision model on a CPU with native kernels for it."""
    return (
        not fp32_gemm
        and torch.device(config.device).type == "cpu"
        and config.torch_dtype != torch.float32
        and has_native_half_gemm(config.torch_dtype)
    )


def run_linears_in_fp32(model: torch.nn.Module) -> None:
    """Hold each half-precision Linear's weight in fp32 (exactly the same values) and compute
    in fp32, rounding the output back. Embeddings stay in half precision; a tied lm_head
    gets its own fp32 copy."""
    for module in _half_linears(model):
        module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(module.bias.detach().float(), requires_grad=False)
        module.forward = partial(_fp32_linear, module)


def pack_linears(model: torch.nn.Module) -> None:
    """Give each half-precision Linear oneDNN's prepacked layout of its weight, next to the
    original (which the decode GEMV kernel reads, and a tied lm_head shares with the
    embedding): about one more copy of the linear weights, for the fastest GEMM at every size."""
    gemv_kernel.register()
    for module in _half_linears(model):
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
        module.forward = partial(_packed_linear, module)


def _half_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.float32]


def _fp32_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), module.weight, module.bias).to(x.dtype)


def _packed_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.vmkv.packed_linear.default(x, module.weight, module.packed_weight, module.bias)
