"""Which GEMM a half-precision model's linears run on the CPU, that prepacked oneDNN GEMMs
give the same values as plain ones, and that the GEMV kernel (AVX512-BF16 or AVX2) and the GEMM
on weights in pairs (AVX512-BF16) compute what a bf16 GEMM computes."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch

from vmkv.engine import cpu_linear, gemv_kernel
from vmkv.engine.config import EngineConfig
from vmkv.engine.cpu_linear import linear_packing, pack_linears
from vmkv.model.store import load_model


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_native_bf16_cpus_get_packed_gemms_and_the_others_fp32_ones(
    monkeypatch: pytest.MonkeyPatch, native: bool, pairs: bool
) -> None:
    monkeypatch.setattr(cpu_linear, "has_native_half_gemm", lambda dtype: native)
    monkeypatch.setattr(gemv_kernel, "pairs_gemm", lambda: pairs)
    packed = ("pairs" if pairs else "onednn") if native else "fp32"
    assert linear_packing(EngineConfig(dtype="bfloat16")) == packed
    assert linear_packing(EngineConfig(dtype="float16")) == ("onednn" if native else "fp32")  # pairs: bf16
    assert linear_packing(EngineConfig(dtype="float32")) is None  # fp32 models are left alone
    assert linear_packing(EngineConfig(dtype="bfloat16", fp32_gemm=True)) == "fp32"
    # torch's own bf16 GEMM where forced and not native
    assert linear_packing(EngineConfig(dtype="bfloat16", fp32_gemm=False)) == (packed if native else None)


def test_pairs_are_the_gemm_of_avx512_bf16_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX or without (the tile unit or vdpbf16ps); without AVX512-BF16 there is no pairs kernel."""
    monkeypatch.setattr(gemv_kernel, "register", lambda: True)
    for isa, amx, expected in [
        ("avx512_bf16", False, True),
        ("avx512_bf16", True, True),
        ("avx2", False, False),
    ]:
        monkeypatch.setattr(gemv_kernel, "gemv_isa", lambda isa=isa: isa)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert gemv_kernel.pairs_gemm() is expected, (isa, amx)


def test_a_weight_in_pairs_holds_each_column_s_k_pairs_in_panels() -> None:
    weight = torch.arange(50 * 6, dtype=torch.float32).view(50, 6).to(torch.bfloat16)
    pairs = gemv_kernel.in_pairs(weight)
    panel = gemv_kernel.PAIRS_PANEL
    assert pairs.shape == (2, 3, panel, 2)  # 50 columns: a second panel, partly zeros
    for n, k in [(0, 0), (0, 5), (31, 2), (32, 3), (49, 5)]:
        assert pairs[n // panel, k // 2, n % panel, k % 2] == weight[n, k]
    assert not pairs[1, :, 50 - panel :].any()


def test_python_fallback_computes_linears_whose_weight_is_in_pairs() -> None:
    """Where the C++ operator is missing, its Python stand-in still gives the linear's values."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    got = gemv_kernel._python_linear(x, weight, gemv_kernel.in_pairs(weight), None)
    assert torch.equal(got, torch.nn.functional.linear(x, weight))


def _pairs_gemm_or_skip() -> None:
    if not gemv_kernel.pairs_gemm():
        pytest.skip("no GEMM on weights in pairs here (needs AVX512-BF16 and a C++ compiler)")


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 37, 64, 300])
def test_linears_in_pairs_round_fp32_sums_once(rows: int) -> None:
    """Every row count (decode and prefill) runs the pairs GEMM: within one bf16 rounding of the
    exact sum, and oneDNN's bf16 GEMM's values but for a rare last-bit difference of sum order."""
    _pairs_gemm_or_skip()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(2500, 576, generator=gen).to(torch.bfloat16)  # 2500: a partial last panel
    bias = torch.randn(2500, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 1152, generator=gen).to(torch.bfloat16)[:, :576]  # rows 1152 apart
    linear = torch.nn.Linear(576, 2500).to(torch.bfloat16)
    linear.weight.data, linear.bias.data = weight, bias
    with torch.inference_mode():
        pack_linears(linear, "pairs")
        got = linear(x)
        strided = linear(x[:, None].transpose(0, 1)).transpose(0, 1)[:, 0]
        logits = cpu_linear.packed_logits(linear, x)
    assert linear.packed_weight.dim() == 4
    exact = x.double() @ weight.double().t() + bias.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert torch.equal(strided, got)
    assert torch.equal(logits, got.float())
    onednn = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(weight), bias, "none", [], ""
    )
    assert (got == onednn).float().mean() > 0.999


def test_an_odd_input_width_keeps_onednn_s_form_under_pairs() -> None:
    _pairs_gemm_or_skip()
    linear = torch.nn.Linear(575, 40).to(torch.bfloat16)
    x = torch.randn(3, 575).to(torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        pack_linears(linear, "pairs")
        got = linear(x)
    assert linear.packed_weight.dim() != 4
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=1e-2)


def test_a_wrong_input_width_for_a_weight_in_pairs_is_a_clear_error() -> None:
    _pairs_gemm_or_skip()
    weight = torch.randn(40, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not match the weight in pairs"):
        torch.ops.vmkv.packed_linear(
            torch.randn(2, 32).to(torch.bfloat16), weight, gemv_kernel.in_pairs(weight), None
        )


def test_the_bench_picks_bf16_where_decode_reads_bf16_weights() -> None:
    from vmkv.engine.args import auto_dtype

    native = cpu_linear.has_native_half_gemm(torch.bfloat16)
    reads_bf16_weights = native or gemv_kernel.gemv_isa() is not None
    assert auto_dtype() == ("bfloat16" if reads_bf16_weights else "float32")
    assert (linear_packing(EngineConfig(dtype="bfloat16")) == "fp32") is not native


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 64])
def test_fp32_packed_linears_compute_what_a_bf16_gemm_computes(rows: int) -> None:
    """Any CPU: up to gemv_kernel.max_rows() rows (4 to 12 by CPU, MAX_ROWS) the GEMV kernel
    reads the bf16 weight, where it builds; more go to oneDNN's fp32 GEMM of the same values."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(2500, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(2500, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 1152, generator=gen).to(torch.bfloat16)[:, :576]  # rows 1152 apart
    linear = torch.nn.Linear(576, 2500).to(torch.bfloat16)
    linear.weight.data, linear.bias.data = weight, bias
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    with torch.inference_mode():
        pack_linears(linear, "fp32")
        got = linear(x)
        strided = linear(x[:, None].transpose(0, 1)).transpose(0, 1)[:, 0]
    exact = x.double() @ weight.double().t() + bias.double()
    # within one bf16 rounding of the exact sum (plus fp32 summation error) ...
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert torch.equal(strided, got)
    if rows > gemv_kernel.max_rows():  # ... and the fp32 GEMM's values exactly, but for the sum's order
        assert (got == expected).float().mean() > 0.999


def test_the_gemv_stops_at_fewer_rows_where_onednn_has_amx_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX makes oneDNN's GEMM faster than the GEMV from 7 rows; without it the GEMV wins to 12."""
    monkeypatch.setattr(gemv_kernel, "gemv_isa", lambda: "avx512_bf16")
    limits = {}
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        limits[amx] = gemv_kernel.max_rows()
    assert limits == {True: 6, False: 12}


def test_the_gemv_kernel_builds_where_the_cpu_and_a_compiler_allow() -> None:
    """A CPU with AVX2 (or AVX512-BF16) and a C++ compiler gets the C++ operator, not its
    Python fallback, which would read fp32 weights for every decode linear."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or gemv_kernel.gemv_isa() is None:
        pytest.skip("no C++ compiler, or a CPU with neither AVX2 nor AVX512-BF16")
    assert gemv_kernel.register()


@pytest.mark.skipif(
    not cpu_linear.has_native_half_gemm(torch.bfloat16), reason="this CPU has no native bf16 GEMM"
)
def test_native_linears_compute_what_a_bf16_gemm_computes() -> None:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).to(
        torch.bfloat16
    )
    x = torch.randn(2, 20, 64, generator=gen).to(torch.bfloat16)  # 40 rows: more than the GEMV or tiles take
    with torch.inference_mode():
        expected = model(x)
        first = model[0](x[0, :1])
        pack_linears(model, "onednn")
        got = model(x)
        strided = model(x.transpose(0, 1)).transpose(0, 1)
        few_rows = model[0](x[0, :1])
    assert torch.equal(got, expected)  # oneDNN, prepacked
    assert torch.equal(strided, expected)
    # one row: the GEMV kernel where it runs, the same sums in another order
    assert torch.allclose(few_rows.float(), first.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("k_len", [576, 96])  # 96: a 32-element tail after the 64-element steps
@pytest.mark.parametrize("rows", range(1, max(gemv_kernel.MAX_ROWS.values()) + 1))  # any build's
def test_the_gemv_kernel_rounds_fp32_sums_once(rows: int, k_len: int) -> None:
    if not gemv_kernel.register():
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, k_len, generator=gen).to(torch.bfloat16)  # 1000: a partial last block
    bias = torch.randn(1000, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(rows, 2 * k_len, generator=gen).to(torch.bfloat16)[:, :k_len]  # rows 2 k_len apart
    exact = x.double() @ weight.double().t() + bias.double()
    got = torch.ops.vmkv.packed_linear(x, weight, packed, bias)
    # within one bf16 rounding of the exact sum (plus fp32 summation error)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    # more rows than the kernels take: oneDNN's GEMM on the packed weight, torch's values exactly
    many = torch.randn(2, 20, k_len, generator=gen).to(torch.bfloat16)  # 40 rows
    assert torch.equal(
        torch.ops.vmkv.packed_linear(many, weight, packed, bias),
        torch.nn.functional.linear(many, weight, bias),
    )


@pytest.mark.parametrize("packing", ["fp32", "onednn", "pairs"])
@pytest.mark.parametrize("rows", [1, 4, 5, 6, 7, 12, 13, 64])
def test_packed_logits_are_the_linears_values_as_fp32(packing: str, rows: int) -> None:
    """The vocabulary projection's fp32 logits equal the linear's half-precision output widened,
    infinities and NaN included (the fp32 GEMM's output is rounded in place, not converted)."""
    if packing == "onednn" and not cpu_linear.has_native_half_gemm(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 GEMM")
    if packing == "pairs":
        _pairs_gemm_or_skip()
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(576, 1000, bias=False).to(torch.bfloat16)
    linear.weight.data = torch.randn(1000, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    x[0, 0] = float("inf")  # row 0: +-inf, or NaN where signs meet
    with torch.inference_mode():
        pack_linears(linear, packing)
        expected = linear(x).float()
        got = cpu_linear.packed_logits(linear, x)
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert expected[0].isinf().any()


def _close_in_bf16(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal but for a few bf16 roundings (a GEMM may sum in another order for another width)."""
    return torch.allclose(got.float(), expected.float(), rtol=2**-6, atol=2**-6 * float(expected.abs().max()))


@pytest.mark.parametrize("tokens", [3, 13])  # the GEMV's rows, the GEMM's
def test_linears_reading_one_input_run_as_one_call_with_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tokens: int
) -> None:
    grouped, alone = load_model(tiny_model_dir), load_model(tiny_model_dir)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        pack_linears(grouped, "fp32")
        monkeypatch.setattr(cpu_linear, "SHARED_INPUT_GROUPS", ())
        pack_linears(alone, "fp32")
        got, expected = grouped(ids).logits, alone(ids).logits
    if tokens <= gemv_kernel.max_rows() and gemv_kernel.register():
        assert torch.equal(got, expected)  # the GEMV sums each output row alone: the same sums
    else:
        assert _close_in_bf16(got, expected)
    attention, mlp = grouped.model.layers[0].self_attn, grouped.model.layers[0].mlp
    storage = attention.q_proj.weight.untyped_storage().data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == storage  # held once, as views
    assert attention.v_proj.weight.untyped_storage().data_ptr() == storage
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert up.untyped_storage().data_ptr() == gate.untyped_storage().data_ptr()


def test_grouped_linears_are_right_in_any_order_and_for_any_input(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    attention = load_model(tiny_model_dir).model.layers[0].self_attn
    alone = copy.deepcopy(attention)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(5, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    with torch.inference_mode():
        pack_linears(attention, "fp32")
        monkeypatch.setattr(cpu_linear, "SHARED_INPUT_GROUPS", ())
        pack_linears(alone, "fp32")
        calls = [("k_proj", x), ("q_proj", x), ("v_proj", y), ("q_proj", y), ("k_proj", x), ("v_proj", x)]
        for name, inputs in calls:
            assert _close_in_bf16(getattr(attention, name)(inputs), getattr(alone, name)(inputs)), name


def test_dynamo_traces_a_group_as_one_call(tiny_model_dir: Path) -> None:
    """Under torch.compile the model's three calls of q/k/v become one operator call in the
    graph, with eager's outputs (the graph is run as captured: no inductor)."""
    attention = load_model(tiny_model_dir).model.layers[0].self_attn
    with torch.inference_mode():
        pack_linears(attention, "fp32")
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)

    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        expected = project(x)
        got = torch.compile(project, backend=capture, fullgraph=True)(x)
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.vmkv.packed_linear.default]
    assert len(graphs) == 1 and len(calls) == 1
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("k_len", [576, 96])
@pytest.mark.parametrize("rows", [7, 12, 16])
@pytest.mark.parametrize("n_len", [1000, 64, 40, 16])  # a partial group and block; whole groups; 1 + part
def test_the_tile_gemm_rounds_fp32_sums_once(rows: int, k_len: int, n_len: int) -> None:
    """AMX builds: rows past the GEMV's and up to tile_max_rows() run y^T = W x^T on the tile
    unit, within one bf16 rounding of the exact sum, with or without a bias, x at any row stride."""
    if gemv_kernel.tile_max_rows() < rows:
        pytest.skip("no tile GEMM here: it needs AVX512-BF16 with AMX tiles and a C++ compiler")
    gen = torch.Generator().manual_seed(rows * n_len + k_len)
    weight = torch.randn(n_len, k_len, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(rows, 2 * k_len, generator=gen).to(torch.bfloat16)[:, :k_len]  # rows 2 k_len apart
    for bias in (torch.randn(n_len, generator=gen).to(torch.bfloat16), None):
        _assert_rounds_fp32_sums_once(x, weight, packed, bias)


def _assert_rounds_fp32_sums_once(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """packed_linear's output is within one bf16 rounding of the exact sum, and packed_logits
    gives those values as fp32; returns the output."""
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    got = torch.ops.vmkv.packed_linear(x, weight, packed, bias)
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    logits = torch.ops.vmkv.packed_logits(x, weight, packed, bias)
    assert logits.dtype == torch.float32 and torch.equal(logits, got.float())
    return got


@pytest.mark.parametrize("k_len", [576, 80])  # 80: not whole tile steps, the vdpbf16ps GEMM
@pytest.mark.parametrize("rows", [17, 33, 600, 1100])  # by panels; by rows, a partial last block
@pytest.mark.parametrize("n_len", [3072, 1000])  # 1,100 x 3,072: written past the caches; a partial panel
def test_the_tile_unit_computes_linears_in_pairs_past_the_tile_gemm(
    rows: int, k_len: int, n_len: int
) -> None:
    """AMX builds: rows past tile_max_rows() run the GEMM on weights in pairs on the tile unit,
    within one bf16 rounding of the exact sum and oneDNN's values but for a rare last bit, with
    or without a bias, x at any row stride; the logits are those values as fp32."""
    _pairs_gemm_or_skip()
    if not gemv_kernel.tile_max_rows():
        pytest.skip("no tile unit here: it needs AVX512-BF16 with AMX tiles")
    gen = torch.Generator().manual_seed(rows * n_len + k_len)
    weight = torch.randn(n_len, k_len, generator=gen).to(torch.bfloat16)
    pairs = gemv_kernel.in_pairs(weight)
    x = torch.randn(rows, 2 * k_len, generator=gen).to(torch.bfloat16)[:, :k_len]  # rows 2 k_len apart
    for bias in (torch.randn(n_len, generator=gen).to(torch.bfloat16), None):
        got = _assert_rounds_fp32_sums_once(x, weight, pairs, bias)
        onednn = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(weight), bias, "none", [], ""
        )
        assert (got == onednn).float().mean() > 0.999


def test_only_avx512_bf16_builds_on_amx_cpus_get_the_tile_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile code is compiled (-mamx-*) only where torch reports AMX tiles, and only into the
    AVX512-BF16 build; any other CPU builds the operator as before."""
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        for isa in ("avx512_bf16", "avx2"):
            flags = gemv_kernel._build_flags(isa)
            assert ("-mamx-tile" in flags) is (amx and isa == "avx512_bf16")


def _gated_expected(y: torch.Tensor) -> torch.Tensor:
    """What the model computes from a gate/up linear's output: SiLU of the gate half in inductor's
    form (x / (1 + e^-x)) rounded, times the up half, rounded."""
    gate, up = y.float().chunk(2, dim=-1)
    return ((gate / (1 + (-gate).exp())).to(y.dtype).float() * up).to(y.dtype)


@pytest.mark.parametrize("packing", ["fp32", "onednn", "pairs"])
@pytest.mark.parametrize("rows", [1, 7, 17, 33, 600])  # the GEMV, the tile GEMM, by panels, by rows
@pytest.mark.parametrize("half", [1536, 40])  # whole 16-column groups (AMX: one GEMM); a partial one
def test_a_gated_linear_is_silu_of_its_gate_half_times_its_up_half(
    packing: str, rows: int, half: int
) -> None:
    """packed_gated_linear(x, [gate; up]) gives what the model computes from packed_linear's
    output, but for a rare last bit (its own e^x), with or without a bias, x at any row stride;
    on AMX builds the rows past the tile GEMM take it in one GEMM."""
    if packing == "onednn" and not cpu_linear.has_native_half_gemm(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 GEMM")
    if packing == "pairs":
        _pairs_gemm_or_skip()
    gemv_kernel.register()
    gen = torch.Generator().manual_seed(rows * half)
    weight = (torch.randn(2 * half, 576, generator=gen) / 12).to(torch.bfloat16)
    packed = cpu_linear.pack_weight(weight, packing)
    x = torch.randn(rows, 2 * 576, generator=gen).to(torch.bfloat16)[:, :576]
    for bias in (torch.randn(2 * half, generator=gen).to(torch.bfloat16), None):
        expected = _gated_expected(torch.ops.vmkv.packed_linear(x, weight, packed, bias))
        got = torch.ops.vmkv.packed_gated_linear(x, weight, packed, bias)
        assert got.shape == (rows, half) and got.dtype == torch.bfloat16
        assert (got == expected).float().mean() > 0.999
        assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("rows", [41, 0])
def test_a_gated_linear_needs_a_weight_of_two_halves(rows: int) -> None:
    gemv_kernel.register()
    weight = torch.zeros(rows, 64, dtype=torch.bfloat16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even number"):
        torch.ops.vmkv.packed_gated_linear(x, weight, weight, None)  # checked before `packed` is read
    with pytest.raises(ValueError, match="even number"):
        gemv_kernel._python_gated(x, weight, weight, None)


def test_python_fallback_computes_gated_linears() -> None:
    """Where the C++ operator is missing, its Python stand-in gives the gated linear's values."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    got = gemv_kernel._python_gated(x, weight, gemv_kernel.in_pairs(weight), None)
    assert torch.equal(got, _gated_expected(torch.nn.functional.linear(x, weight)))
