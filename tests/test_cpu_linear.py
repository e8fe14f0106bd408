"""Which GEMM a half-precision model's linears run on the CPU, and that prepacked oneDNN
GEMMs give the same values as plain ones."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine import cpu_linear, gemv_kernel
from vmkv.engine.config import EngineConfig
from vmkv.engine.cpu_linear import pack_linears, wants_fp32_gemm, wants_packed_gemm


@pytest.mark.parametrize("native", [False, True])
def test_native_bf16_cpus_get_packed_gemms_and_the_others_fp32_ones(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(cpu_linear, "has_native_half_gemm", lambda dtype: native)
    bf16 = EngineConfig(dtype="bfloat16")
    assert wants_fp32_gemm(bf16) is not native
    assert wants_packed_gemm(bf16, wants_fp32_gemm(bf16)) is native
    fp32 = EngineConfig(dtype="float32")
    assert not wants_fp32_gemm(fp32) and not wants_packed_gemm(fp32, False)  # fp32 models are left alone
    forced = EngineConfig(dtype="bfloat16", fp32_gemm=True)
    assert wants_fp32_gemm(forced) and not wants_packed_gemm(forced, True)


def test_the_bench_picks_the_dtype_the_engine_runs_natively() -> None:
    from vmkv.engine.args import auto_dtype

    native = cpu_linear.has_native_half_gemm(torch.bfloat16)
    assert auto_dtype() == ("bfloat16" if native else "float32")
    assert wants_fp32_gemm(EngineConfig(dtype="bfloat16")) is not native


@pytest.mark.skipif(
    not cpu_linear.has_native_half_gemm(torch.bfloat16), reason="this CPU has no native bf16 GEMM"
)
def test_native_linears_compute_what_a_bf16_gemm_computes() -> None:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).to(
        torch.bfloat16
    )
    x = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        first = model[0](x[0, :1])
        pack_linears(model)
        got = model(x)
        strided = model(x.transpose(0, 1)).transpose(0, 1)
        few_rows = model[0](x[0, :1])
    assert torch.equal(got, expected)  # 10 rows: oneDNN, prepacked
    assert torch.equal(strided, expected)
    # one row: the GEMV kernel where it runs, the same sums in another order
    assert torch.allclose(few_rows.float(), first.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="this CPU has no AVX512-BF16")
def test_the_gemv_kernel_rounds_fp32_sums_once() -> None:
    if not gemv_kernel.register():
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 576, generator=gen).to(torch.bfloat16)  # 1000: a partial last block
    bias = torch.randn(1000, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(3, 1152, generator=gen).to(torch.bfloat16)[:, :576]  # rows 1152 apart
    exact = x.double() @ weight.double().t() + bias.double()
    got = torch.ops.vmkv.packed_linear(x, weight, packed, bias)
    # within one bf16 rounding of the exact sum (plus fp32 summation error)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    # more rows than the kernel takes: oneDNN's GEMM on the packed weight, torch's values exactly
    many = torch.randn(2, 5, 576, generator=gen).to(torch.bfloat16)
    assert torch.equal(
        torch.ops.vmkv.packed_linear(many, weight, packed, bias),
        torch.nn.functional.linear(many, weight, bias),
    )
