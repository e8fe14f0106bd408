"""flash-attn is chosen only where it can run, and the flash path's per-step tensors are built once.

No GPU here: the capability query is stood in for, and flash_attn is a package on sys.path
that is installed (find_spec finds it) but fails to import, as a build for another torch does.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from vmkv import flash_support
from vmkv.dense import plan as dense_plan
from vmkv.dense.attention import attend_dense
from vmkv.host_metadata import host_query_starts
from vmkv.kv_cache import SeqStep, StepBatch

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fresh_import(monkeypatch):
    flash_support.flash_import_error.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    yield
    flash_support.flash_import_error.cache_clear()


def test_installed_but_broken_flash_attn_is_not_chosen(fresh_import, tmp_path, monkeypatch):
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c10 (built for another torch)')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert importlib.util.find_spec("flash_attn") is not None  # what the old check relied on
    reason = flash_support.flash_unusable_reason(CUDA, torch.bfloat16, 64)
    assert reason is not None and "undefined symbol" in reason
    assert not dense_plan.flash_usable(CUDA, torch.bfloat16, 64)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "capability", "why"),
    [
        (torch.float32, 64, (9, 0), "fp16 or bf16"),
        (torch.bfloat16, 72 + 4, (9, 0), "multiple of 8"),
        (torch.bfloat16, 264, (9, 0), "head_dim <= 256"),
        (torch.float16, 128, (7, 5), "compute capability"),
    ],
)
def test_limits_are_checked_before_any_import(fresh_import, monkeypatch, dtype, head_dim, capability, why):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # an import attempt would raise
    assert why in flash_support.flash_unusable_reason(CUDA, dtype, head_dim)
    assert flash_support.flash_import_error.cache_info().currsize == 0


def test_cpu_never_imports_flash_attn(fresh_import, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "CUDA" in flash_support.flash_unusable_reason(torch.device("cpu"), torch.bfloat16, 64)
    assert flash_support.flash_import_error.cache_info().currsize == 0


def _flash_stub(calls: list[dict]) -> types.ModuleType:
    def flash_attn_with_kvcache(q, k_cache, v_cache, **kw):
        calls.append(kw)
        return torch.zeros_like(q)

    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def test_flash_prefill_tensors_are_built_once_per_step_and_sliced_per_layer(monkeypatch):
    monkeypatch.setattr(dense_plan, "flash_usable", lambda *args: True)
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _flash_stub(calls))
    steps = [SeqStep(0, 5, 3), SeqStep(1, 7, 1), SeqStep(2, 0, 4)]
    batch = StepBatch.build(steps)
    cache = torch.zeros(4, 16, 2, 8)
    plan = dense_plan.plan_step(
        batch, [2, 0, 3], [16, 16, 16], torch.device("cpu"), use_flash=True, kv_view=cache
    )
    assert plan.flash_prefill.slots.tolist() == [2, 3] and plan.flash_prefill.cache_seqlens.tolist() == [5, 0]
    assert plan.flash_decode.slots.tolist() == [0] and plan.flash_decode.cache_seqlens.tolist() == [7]
    q = torch.zeros(batch.num_tokens, 4, 8)
    kv = torch.zeros(batch.num_tokens, 2, 8)
    for _layer in range(2):
        attend_dense(cache, cache, q, kv, kv, plan, 1.0)
    prefill_calls = [c for c in calls if c["cache_batch_idx"] is not plan.flash_decode.slots]
    assert len(calls) == 2 * 3 and len(prefill_calls) == 2 * 2
    storage = plan.flash_prefill.slots.untyped_storage().data_ptr()
    for c in prefill_calls:  # views of the step's tensors, not tensors made per layer
        assert c["cache_batch_idx"].untyped_storage().data_ptr() == storage
        assert c["cache_seqlens"].untyped_storage().data_ptr() == storage


def test_flash_is_dropped_for_a_head_dim_it_cannot_take(monkeypatch):
    """vattention decides flash before it knows head_dim; the plan checks it from the K/V view."""
    seen: list[tuple] = []
    monkeypatch.setattr(dense_plan.flash_support, "flash_usable", lambda *a: seen.append(a) or a[2] <= 256)
    batch = StepBatch.build([SeqStep(0, 3, 1)])
    plan = dense_plan.plan_step(
        batch, [0], [8], torch.device("cpu"), use_flash=True, kv_view=torch.zeros(1, 8, 1, 264)
    )
    assert not plan.use_flash and plan.flash_decode is None and seen[-1][2] == 264


def test_host_query_starts_match_the_batch_without_reading_the_device():
    steps = [SeqStep(0, 0, 3), SeqStep(1, 4, 1), SeqStep(2, 2, 5)]
    batch = StepBatch.build(steps)
    assert host_query_starts(batch) == batch.query_start.tolist() == [0, 3, 4, 9]
