"""The inductor pass that moves a gated MLP's activation into its gate/up GEMM (gated_fusion.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vmkv.engine import compiled, gemv_kernel
from vmkv.engine.cpu_linear import pack_linears
from vmkv.engine.gated_fusion import FuseGatedLinears
from vmkv.model.store import load_model


def _packed_mlp(model_dir: Path) -> torch.nn.Module:
    """The tiny model's first MLP in bf16, its gate and up linears grouped into one packed call."""
    mlp = load_model(model_dir).model.layers[0].mlp.to(torch.bfloat16)
    with torch.inference_mode():
        pack_linears(mlp, "pairs" if gemv_kernel.pairs_gemm() else "fp32")
    return mlp


def _compiled(mlp: torch.nn.Module, fusion: FuseGatedLinears, x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": fusion, "fx_graph_cache": False}
    with torch.inference_mode():
        return torch.compile(mlp, dynamic=False, options=options)(x)


@pytest.mark.parametrize("tokens", [3, 20])  # rows the operator computes apart; (AMX) in one GEMM
def test_a_compiled_mlp_computes_its_activation_in_the_gemm(tiny_model_dir: Path, tokens: int) -> None:
    """In the post-grad graph of the model's unmodified MLP the pass finds silu(gate) * up behind
    the grouped gate/up call and puts one gated call in its place: eager's outputs but for a rare
    last bit."""
    mlp, fusion = _packed_mlp(tiny_model_dir), FuseGatedLinears()
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    with torch.inference_mode():
        expected = mlp(x)
    got = _compiled(mlp, fusion, x)
    assert fusion.fused == 1
    assert (got == expected).float().mean() > 0.99
    assert torch.allclose(got.float(), expected.float(), rtol=2**-6, atol=2**-6 * float(expected.abs().max()))


def test_the_pass_leaves_other_activations_alone(tiny_model_dir: Path) -> None:
    mlp, fusion = _packed_mlp(tiny_model_dir), FuseGatedLinears()
    mlp.act_fn = torch.nn.GELU(approximate="tanh")
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        expected = mlp(x)
    got = _compiled(mlp, fusion, x)
    assert fusion.fused == 0
    assert torch.allclose(got.float(), expected.float(), rtol=2**-6, atol=2**-6 * float(expected.abs().max()))


def test_decoders_compile_with_the_pass_only_where_one_gemm_computes_it(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """bf16 models on CPUs whose operator computes a gated linear in one GEMM get the pass;
    elsewhere inductor's own activation kernel stays (the operator would only add a pass over
    the GEMM's output there)."""
    seen: list[dict] = []

    def compile_stops(fn: object, **kwargs: object) -> None:
        seen.append(kwargs["options"])  # type: ignore[arg-type]
        raise RuntimeError("stop")

    monkeypatch.setattr(compiled.torch, "compile", compile_stops)
    for gated, dtype, expected in (
        (True, torch.bfloat16, True),
        (False, torch.bfloat16, False),
        (True, torch.float32, False),
    ):
        monkeypatch.setattr(gemv_kernel, "gated_gemm", lambda gated=gated: gated)
        decoder = load_model(tiny_model_dir).model.to(dtype)
        with pytest.raises(RuntimeError, match="stop"):
            compiled.compile_decoder(decoder, torch.device("cpu"))
        assert isinstance(seen[-1].get("post_grad_custom_post_pass"), FuseGatedLinears) is expected
