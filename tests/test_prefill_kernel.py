"""The CPU prefill kernel against the naive fp32 reference, on the views the layouts hand it.

K/V come as [L, Hkv, D] views with the strides of a token-major slot, a layer-packed slot
(every layer's K and V of a token between two tokens), a head-major slot, and a paged
prefill's new rows (k contiguous, v a slice of the fused projection); queries as the
packed batch's rows. Inputs are bf16, so the reference runs on the same rounded values and
only the kernel's rounding remains (P and the output rounded to bf16): 2e-2 absolute for
O(1) values, the bound the decode kernel's bf16 test uses. On a CPU without AVX512-BF16 the
kernel must decline (None) so the layouts run SDPA: that is checked on every machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_reference import reference_attention
from vmkv.paging import attention as paged_attention

from vmkv import prefill_kernel
from vmkv.dense import attention as dense_attention
from vmkv.engine import LLM, SamplingParams
from vmkv.engine.oracle import compare, reference_greedy
from vmkv.kv_cache import SeqStep
from vmkv.model.tiny import build_tiny_model
from vmkv.prefill_kernel import causal_attention, kernel_applies

NATIVE = torch.cpu._is_avx512_bf16_supported()
needs_native = pytest.mark.skipif(not NATIVE, reason="the prefill kernel needs AVX512-BF16")
TOLERANCE = 2e-2


@pytest.fixture(params=["tiles", "vector"])
def products(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once per way the kernel computes Q K^T and P V: on AMX tiles (CPUs that have
    them) and with vdpbf16ps (what AVX512-BF16 CPUs without AMX run; forced on AMX CPUs)."""
    if request.param == "tiles" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setattr(prefill_kernel, "tile_unit", lambda: request.param == "tiles")
    return request.param


def _views(layout: str, length: int, num_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V [length, num_kv, head_dim] with the strides `layout` gives them."""
    if layout == "token":
        kv = torch.randn(2, length, num_kv, head_dim)
        return kv[0].bfloat16(), kv[1].bfloat16()
    if layout == "projection":  # a paged prefill's new k/v: RoPE's output, a slice of the fused q/k/v
        fused = torch.randn(length, 3 * num_kv * head_dim).bfloat16()  # [q | k | v] columns
        k = torch.randn(length, num_kv, head_dim).bfloat16()
        return k, fused[:, -num_kv * head_dim :].view(length, num_kv, head_dim)
    if layout == "packed":  # [tokens, layers=3, K/V, heads, dim]: layer 1's K and V
        packed = torch.randn(length, 3, 2, num_kv, head_dim).bfloat16()
        return packed[:, 1, 0], packed[:, 1, 1]
    heads = torch.randn(2, num_kv, length + 5, head_dim).bfloat16()  # head-major, padded columns
    return heads[0, :, :length].transpose(0, 1), heads[1, :, :length].transpose(0, 1)


@needs_native
@pytest.mark.parametrize("layout", ["token", "projection", "packed", "head"])
@pytest.mark.parametrize(
    ("new", "cached", "num_q", "num_kv", "head_dim"),
    [
        (1, 0, 9, 3, 64),  # a one-token prompt
        (7, 0, 9, 3, 64),  # shorter than a query block
        (100, 0, 9, 3, 64),  # several query and key blocks, ragged ends
        (40, 233, 9, 3, 64),  # a chunk after cached tokens: bottom-right causal
        (300, 0, 9, 3, 64),  # tile passes of two key blocks, then one of a single block
        (33, 31, 32, 8, 128),  # Llama-3-8B heads
        (20, 0, 4, 4, 64),  # no GQA
    ],
)
def test_prefill_kernel_matches_the_reference_on_every_layout(
    products: str, layout: str, new: int, cached: int, num_q: int, num_kv: int, head_dim: int
) -> None:
    torch.manual_seed(new + cached)
    k, v = _views(layout, new + cached, num_kv, head_dim)
    q = torch.randn(new, num_q, head_dim).bfloat16()
    scale = head_dim**-0.5
    out = causal_attention(q, k, v, scale)
    assert out is not None and out.shape == q.shape and out.dtype == torch.bfloat16
    expected = reference_attention(q, [k], [v], [SeqStep(0, cached, new)], scale)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE, rtol=0)


@needs_native
def test_prefill_kernel_reads_query_rows_in_place(products: str) -> None:
    """q as a slice of a wider packed batch (the step's other sequences around it)."""
    torch.manual_seed(0)
    k, v = _views("token", 50, 3, 64)
    batch = torch.randn(80, 9, 64).bfloat16()
    q = batch[10:60]
    out = causal_attention(q, k, v, 0.125)
    assert out is not None
    expected = reference_attention(q.contiguous(), [k], [v], [SeqStep(0, 0, 50)], 0.125)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE, rtol=0)


@needs_native
def test_prefill_kernel_writes_the_callers_rows_and_nothing_else(products: str) -> None:
    """out as the sequence's rows of the step's output, heads apart by more than head_dim:
    those rows get the attention, every other element stays as it was."""
    torch.manual_seed(2)
    k, v = _views("token", 70, 3, 64)
    q = torch.randn(30, 9, 64).bfloat16()
    step_out = torch.full((50, 9, 80), 7.0, dtype=torch.bfloat16)
    rows = step_out[10:40, :, :64]
    assert causal_attention(q, k, v, 0.125, rows) is rows
    expected = reference_attention(q, [k], [v], [SeqStep(0, 40, 30)], 0.125)
    torch.testing.assert_close(rows.float(), expected, atol=TOLERANCE, rtol=0)
    untouched = torch.ones_like(step_out, dtype=torch.bool)
    untouched[10:40, :, :64] = False
    assert (step_out[untouched] == 7.0).all()


@needs_native
def test_prefill_kernel_refuses_an_out_of_another_shape() -> None:
    q, k = torch.randn(5, 2, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="out must be"):
        causal_attention(q, k, k, 0.125, torch.empty(5, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        causal_attention(q, k, k, 0.125, torch.empty(5, 2, 64))


@needs_native
def test_prefill_kernel_gives_large_scores_a_stable_softmax(products: str) -> None:
    """Scores in the hundreds (max subtracted before exp) and rows whose first block's keys
    are all far below a later block's."""
    torch.manual_seed(1)
    k, v = _views("token", 200, 3, 64)
    k = (k.float() * 8).bfloat16()
    q = (torch.randn(200, 9, 64) * 8).bfloat16()
    out = causal_attention(q, k, v, 0.125)
    assert out is not None and torch.isfinite(out.float()).all()
    expected = reference_attention(q, [k], [v], [SeqStep(0, 0, 200)], 0.125)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE, rtol=0)


def test_prefill_kernel_declines_what_it_does_not_run() -> None:
    """fp32, a head_dim not a multiple of 32, or a CPU without AVX512-BF16: None, so the
    caller runs SDPA."""
    q, k = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    assert causal_attention(q, k, k, 0.125) is None
    odd = torch.randn(4, 2, 48).bfloat16()
    assert causal_attention(odd, odd, odd, 0.125) is None
    bf = q.bfloat16(), k.bfloat16()
    assert kernel_applies(*bf) is NATIVE
    assert (causal_attention(bf[0], bf[1], bf[1], 0.125) is None) is not NATIVE


@needs_native
def test_prefill_kernel_rejects_more_queries_than_keys() -> None:
    q, k = torch.randn(5, 2, 64).bfloat16(), torch.randn(4, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="cannot attend"):
        causal_attention(q, k, k, 0.125)


@pytest.fixture(scope="module")
def wide_head_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose head_dim (64) the prefill kernel takes, with GQA."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"), hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64
    )


@needs_native
@pytest.mark.parametrize("kv_mode", ["paged", "vattention"])  # contiguous: stock SDPA only
def test_engine_prefills_through_the_kernel_like_a_bf16_forward(
    wide_head_model: Path, kv_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 40-150 tokens in chunks of at most 64 (so later chunks attend after cached
    tokens) against a bf16 no-cache forward on the same GEMM path; near-ties as in
    test_engine.py's bf16 test."""
    ran = []

    def counted(*args: object) -> torch.Tensor | None:
        out = causal_attention(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(dense_attention, "causal_attention", counted)
    monkeypatch.setattr(paged_attention, "causal_attention", counted)
    prompts = [[(7 * i + 13 * j) % 200 + 3 for j in range(40 + 22 * i)] for i in range(6)]
    reference = reference_greedy(wide_head_model, prompts, 8, torch.bfloat16)
    llm = LLM(
        str(wide_head_model),
        kv_mode=kv_mode,
        dtype="bfloat16",
        max_num_batched_tokens=64,
        max_model_len=256,
        kv_budget_bytes=1 << 24,
        enable_prefix_caching=False,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    llm.close()
    assert ran and all(ran)  # every prefill chunk went through the kernel
    report = compare(reference, [o.outputs[0].token_ids for o in outputs], tie_bf16_ulps=2)
    assert report.passed, report.mismatches
    assert report.identical + len(report.near_ties) == len(prompts)
