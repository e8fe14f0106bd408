"""The CPU decode kernel against the naive fp32 reference, on every layout it reads in place.

The same K/V is stored three ways: token-major slots, head-major slots (a padded head
stride, as vattention's page-rounded columns have) and scattered paged blocks. Tolerances:
fp32 2e-5 (reduction order); bf16/fp16 are compared with the reference on the same rounded
values, so only rounding inside the kernel and of its output remains: 2e-2 / 4e-3 absolute
for O(1) values. The AVX2 variant (-mno-avx512f) runs where the compiler targets x86, so
CPUs without AVX-512 or AVX512-BF16 have their code path checked here too; where the CPU has
AMX tiles (whose build scores on them), so does the -DNO_AMX build's vector path. Paged blocks
of a tile's 16 tokens (read in place by the AMX path) and of 8 (copied) are both checked.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from attention_reference import reference_attention

from vmkv import decode_kernel
from vmkv.bench.kernels import (
    BLOCK_TABLE,
    IN_PLACE,
    PAGED,
    VIRTUAL,
    AttentionShape,
    available_kernels,
    kernel_matrix,
)
from vmkv.decode_kernel import dense_plan, load_decode_kernel, paged_plan
from vmkv.kv_cache import SeqStep

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
X86 = platform.machine().lower() in ("x86_64", "amd64")
AMX = torch.cpu._is_amx_tile_supported()
VARIANTS = [
    (),
    pytest.param(("-mno-avx512f",), marks=pytest.mark.skipif(not X86, reason="x86 only")),
    # where the default build scores on AMX tiles, the vector path that CPUs without them run
    pytest.param(("-DNO_AMX",), marks=pytest.mark.skipif(not AMX, reason="the default build has no AMX")),
]
BLOCK = 16


def _kernel(
    dtype: torch.dtype, group: int, head_dim: int, flags: tuple[str, ...]
) -> decode_kernel.DecodeKernel:
    kernel = load_decode_kernel(dtype, group, head_dim, flags)
    if kernel is None:
        pytest.skip("no C compiler here")
    return kernel


def _layouts(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator) -> dict[str, tuple]:
    """(kind, K, V, table or None) holding sequences [B, L, Hkv, D] in slots 1..B or in blocks."""
    b, length, h, d = k.shape
    token = [torch.zeros(b + 2, length + 5, h, d, dtype=k.dtype) for _ in range(2)]
    head = [torch.zeros(b + 2, h, length + 7, d, dtype=k.dtype) for _ in range(2)]
    for src, t, hm in zip((k, v), token, head, strict=True):
        t[1 : b + 1, :length] = src
        hm[1 : b + 1, :, :length] = src.transpose(1, 2)
    layouts = {
        "token-major": (token[0], token[1], None),
        "head-major": (head[0].transpose(1, 2), head[1].transpose(1, 2), None),
    }
    for block in (BLOCK, BLOCK // 2):  # blocks of a tile's tokens, and smaller
        width = -(-length // block)
        order = torch.randperm(b * width, generator=gen)
        blocks = [torch.zeros(b * width, block, h, d, dtype=k.dtype) for _ in range(2)]
        for src, bl in zip((k, v), blocks, strict=True):
            padded = torch.zeros(b, width * block, h, d, dtype=k.dtype)
            padded[:, :length] = src
            bl[order] = padded.view(-1, block, h, d)
        layouts[f"paged, blocks of {block}"] = (blocks[0], blocks[1], order.view(b, width).to(torch.int32))
    return layouts


def _check(
    dtype: torch.dtype,
    group: int,
    num_kv: int,
    head_dim: int,
    lens: list[int],
    flags: tuple,
    q_scale: float = 1.0,
) -> None:
    kernel = _kernel(dtype, group, head_dim, flags)
    gen = torch.Generator().manual_seed(sum(lens))
    b, length = len(lens), max(lens)
    rows = torch.randperm(b + 3, generator=gen)[:b]  # query rows anywhere in the packed batch
    q = (q_scale * torch.randn(b + 3, num_kv * group, head_dim, generator=gen)).to(dtype)
    k = torch.randn(b, length, num_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(b, length, num_kv, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    lens_t = torch.tensor(lens)
    for name, (kc, vc, table) in _layouts(k, v, gen).items():
        if table is None:
            plan = dense_plan(rows, lens_t, torch.arange(1, b + 1), kc)
        else:
            plan = paged_plan(rows, lens_t, table, kc)
        out = torch.full_like(q, 7.0)
        kernel(plan, q, kc, vc, out, scale)
        for i, row in enumerate(rows.tolist()):
            n = lens[i]
            ref = reference_attention(q[row : row + 1], [k[i, :n]], [v[i, :n]], [SeqStep(0, n - 1, 1)], scale)
            err = (out[row].float() - ref[0]).abs().max().item()
            assert err < TOLERANCE[dtype], (name, dtype, i, n, err)
        untouched = sorted(set(range(b + 3)) - set(rows.tolist()))
        assert (out[untouched] == 7.0).all(), name  # writes exactly its rows


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize(("group", "num_kv", "head_dim"), [(3, 3, 64), (1, 2, 16), (4, 1, 32), (4, 2, 128)])
def test_kernel_matches_reference_on_every_layout(
    dtype: torch.dtype, group: int, num_kv: int, head_dim: int, flags: tuple
) -> None:
    """Odd lengths, lengths below one tile and one block, many sequences (no splitting)."""
    _check(dtype, group, num_kv, head_dim, [1, 5, 16, 17, 33, 70, 2, 9, 31], flags)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_split_over_threads_and_combine(dtype: torch.dtype, flags: tuple) -> None:
    """Few sequences with two threads: contexts are cut into pieces (not multiples of a tile
    or block) whose softmax states are combined."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(dtype, 3, 3, 64, [1001, 613], flags)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contexts_longer_than_a_chunk_fold_each_heads_state(dtype: torch.dtype, flags: tuple) -> None:
    """Where a token's heads share its row, the kernel passes over 256 KiB chunks (160 fp32 or
    336 bf16 tokens of this shape), every head per chunk, and folds the chunks' softmax states:
    contexts of several chunks and on either side of a boundary, enough sequences not to split,
    and large scores, so the running maximum moves between chunks."""
    lens = [1000, 1, 159, 160, 161, 335, 336, 337, 700]
    _check(dtype, 3, 3, 64, lens, flags, q_scale=30.0)


@pytest.mark.parametrize("flags", VARIANTS)
def test_large_scores_keep_the_running_maximum_exact(flags: tuple) -> None:
    """Queries 30x larger make scores of a few hundred: the softmax is nearly one-hot and the
    running maximum moves between tiles, so every rescaling of the partial state is exercised."""
    _check(torch.bfloat16, 3, 3, 64, [1, 40, 300, 613], flags, q_scale=30.0)


@pytest.mark.parametrize("locality", sorted(set(decode_kernel.PREFETCH_LOCALITY.values())))
def test_every_prefetch_locality_builds_and_matches_reference(
    locality: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefetching into L1 or L2 moves no result: each build checked on this CPU, whatever its
    own kind picks."""
    monkeypatch.setattr(decode_kernel, "prefetch_locality", lambda: locality)
    _check(torch.bfloat16, 3, 3, 64, [1, 40, 300, 613], (), q_scale=30.0)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "kind"),
    [(True, True, "avx512_bf16_amx"), (False, True, "avx512_bf16"), (False, False, "other")],
)
def test_prefetch_locality_follows_the_cpu_kind(
    amx: bool, avx512_bf16: bool, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert decode_kernel.prefetch_locality() == decode_kernel.PREFETCH_LOCALITY[kind]


def test_kernel_refuses_a_plan_for_other_strides() -> None:
    kernel = _kernel(torch.float32, 1, 16, ())
    k = torch.zeros(2, 8, 1, 16)
    plan = dense_plan(torch.tensor([0]), torch.tensor([3]), torch.tensor([0]), k)
    other = torch.zeros(2, 1, 8, 16).transpose(1, 2)
    with pytest.raises(ValueError, match="strides"):
        kernel(plan, torch.zeros(1, 1, 16), other, other, torch.zeros(1, 1, 16), 1.0)


def test_unsupported_shapes_and_missing_compiler_return_none_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert load_decode_kernel(torch.float32, 2, 8) is None  # head_dim not a multiple of 16
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernel built earlier to fall back on
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    assert load_decode_kernel(torch.float32, 2, 16) is None
    assert "no C compiler" in caplog.text


def test_builds_are_cached_across_processes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A second process (simulated: the in-process table emptied) loads the built library."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    if load_decode_kernel(torch.float32, 1, 16) is None:
        pytest.skip("no C compiler here")
    built = list((tmp_path / "vmkv" / "kernels").glob("decode_*.so"))
    assert len(built) == 1
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    monkeypatch.setenv("CC", "no-such-compiler")  # it must not need the compiler again
    assert load_decode_kernel(torch.float32, 1, 16) is not None


def test_torchs_own_kernels_give_the_same_bits_around_the_decode_kernel() -> None:
    """On an AMX CPU the kernel loads a tile configuration of its own on torch's threads, which
    torch's AMX kernels (oneDNN's GEMMs, SDPA's micro-GEMMs) also run on: a GEMM and an SDPA
    call after it give the bits they gave before. (This torch's kernels load their own
    configuration on every call: with the kernel releasing the tiles instead of loading back
    the configuration it found, this passed too. Elsewhere it holds trivially.)"""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(48, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
    q, k, v = (torch.randn(1, h, 300, 64, generator=gen).to(torch.bfloat16) for h in (9, 3, 3))

    def torch_ops() -> tuple[torch.Tensor, torch.Tensor]:
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.nn.functional.linear(x, w), attention

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = torch_ops()
        for _ in range(2):
            _check(torch.bfloat16, 3, 3, 64, [1, 40, 300, 613], ())
            after = torch_ops()
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    finally:
        torch.set_num_threads(threads)


def test_kernel_matrix_lists_the_kernel_on_both_layouts() -> None:
    if load_decode_kernel(torch.float32, 2, 16) is None:
        pytest.skip("no C compiler here")
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    kernels = [k for k in available_kernels(torch.device("cpu")) if k.name == "vmkv cpu decode kernel"]
    matrix = kernel_matrix(shape, contexts=(40,), batches=(2,), kernels=kernels, min_seconds=0.0)
    for layout, status in ((VIRTUAL, IN_PLACE), (PAGED, BLOCK_TABLE)):
        cell = matrix.cell("vmkv cpu decode kernel", layout)
        assert cell.status == status and cell.max_error < 1e-5, cell


@pytest.mark.parametrize("flags", VARIANTS)
def test_kernel_appends_the_new_token_before_attending(flags: tuple) -> None:
    """With new=(k, v), row rows[b] becomes sequence b's last token in every layout, and the
    attention already sees it."""
    kernel = _kernel(torch.bfloat16, 2, 32, flags)
    gen = torch.Generator().manual_seed(3)
    lens = [1, 17, 40]
    b, length = len(lens), max(lens)
    rows = torch.tensor([2, 0, 3])
    q = torch.randn(4, 4, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, length, 2, 32, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, length, 2, 32, generator=gen).to(torch.bfloat16)
    new_k, new_v = torch.zeros(4, 2, 32, dtype=torch.bfloat16), torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    for i, row in enumerate(rows.tolist()):
        new_k[row], new_v[row] = k[i, lens[i] - 1], v[i, lens[i] - 1]
    stale_k, stale_v = k.clone(), v.clone()
    for i, n in enumerate(lens):
        stale_k[i, n - 1] = stale_v[i, n - 1] = 9.0  # what the cache held before the step
    for name, (kc, vc, table) in _layouts(stale_k, stale_v, gen).items():
        lens_t = torch.tensor(lens)
        plan = (
            dense_plan(rows, lens_t, torch.arange(1, b + 1), kc)
            if table is None
            else paged_plan(rows, lens_t, table, kc)
        )
        out = torch.zeros_like(q)
        kernel(plan, q, kc, vc, out, 0.2, (new_k, new_v))
        for i, row in enumerate(rows.tolist()):
            n = lens[i]
            ref = reference_attention(q[row : row + 1], [k[i, :n]], [v[i, :n]], [SeqStep(0, n - 1, 1)], 0.2)
            assert (out[row].float() - ref[0]).abs().max().item() < TOLERANCE[torch.bfloat16], (name, i)


def _flip(kc: torch.Tensor, table: torch.Tensor | None, i: int, t: int) -> None:
    """Bit 0 of sequence i's K at token t, head 1, dimension 0 (fp32), in _layouts' storage."""
    block = kc.shape[1]
    row = kc[1 + i, t] if table is None else kc[table[i, t // block], t % block]
    row[1, 0:1].view(torch.int32).bitwise_xor_(1)


@pytest.mark.parametrize("flags", VARIANTS)
def test_read_only_build_reads_exactly_each_context(flags: tuple) -> None:
    """The -DREAD_ONLY build (bench_kernels.py's read floor) walks the rows the kernel walks:
    a bit flipped in a sequence's context row changes that sequence's output and no other;
    one flipped just past the context changes nothing. Every layout; contexts split over two
    threads too."""
    kernel = _kernel(torch.float32, 1, 16, (*flags, "-DREAD_ONLY"))
    gen = torch.Generator().manual_seed(5)
    lens = [5, 40, 613]
    b, length = len(lens), max(lens)
    rows, lens_t = torch.tensor([1, 2, 0]), torch.tensor(lens)
    q = torch.zeros(b, 2, 16)
    k = torch.randn(b, length, 2, 16, generator=gen)
    v = torch.randn(b, length, 2, 16, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, (kc, vc, table) in _layouts(k, v, gen).items():
            if table is None:
                plan = dense_plan(rows, lens_t, torch.arange(1, b + 1), kc)
            else:
                plan = paged_plan(rows, lens_t, table, kc)
            outs = []
            for i, t in ((None, None), (0, 4), (1, 17), (2, 600), (0, 5), (1, 40), (2, 613)):
                if i is not None:
                    _flip(kc, table, i, t)
                outs.append(torch.zeros_like(q))
                kernel(plan, q, kc, vc, outs[-1], 1.0)
                if i is not None:
                    _flip(kc, table, i, t)
            before, inside, past = outs[0], outs[1:4], outs[4:]
            for i, out in enumerate(inside):  # only sequence i's output moves
                moved = [r for r in range(b) if not torch.equal(out[r], before[r])]
                assert moved == [rows[i].item()], (name, i, moved)
            assert all(torch.equal(out, before) for out in past), name
    finally:
        torch.set_num_threads(threads)
