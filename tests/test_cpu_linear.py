"""Which GEMM a half-precision model's linears run on the CPU, and that prepacked oneDNN
GEMMs give the same values as plain ones."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine import cpu_linear
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
    from vmkv.bench.cli import auto_dtype

    native = cpu_linear.has_native_half_gemm(torch.bfloat16)
    assert auto_dtype() == ("bfloat16" if native else "float32")
    assert wants_fp32_gemm(EngineConfig(dtype="bfloat16")) is not native


@pytest.mark.skipif(
    not cpu_linear.has_native_half_gemm(torch.bfloat16), reason="this CPU has no native bf16 GEMM"
)
def test_prepacked_linears_are_bit_identical_to_plain_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).to(
        torch.bfloat16
    )
    x = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        pack_linears(model)
        got = model(x)
        one_row = model(x[0, :1])
        strided = model(x.transpose(0, 1)).transpose(0, 1)
    assert torch.equal(got, expected)
    assert torch.equal(one_row, expected[0, :1])
    assert torch.equal(strided, expected)
