"""The native `vmkv::attention` op: decode steps the CPU decode kernel runs alone go through it
without Python, give the tokens the Python path gives, and reject wrong arguments with the same
exception types; every other step still reaches the cache's attend()."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vmkv.paging import PagedKVCache

from vmkv.decode_kernel import load_decode_kernel
from vmkv.engine import LLM, SamplingParams, attention_hook, native_attention
from vmkv.engine.attention_hook import attention_op, step_context
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
Q_HEADS, SCALE = 4, 0.25


@pytest.fixture(autouse=True)
def native() -> None:
    if not native_attention.load():
        pytest.skip("the native op cannot be built here (no C++ compiler)")
    if load_decode_kernel(SHAPE.dtype, Q_HEADS // SHAPE.num_kv_heads, SHAPE.head_dim) is None:
        pytest.skip("the CPU decode kernel cannot be built here (no C compiler)")


def counting_native_steps(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the steps the native op runs, by the cache's layout."""
    counts: Counter[str] = Counter()
    scope = native_attention.kernel_step_scope

    def counted(step: object) -> Iterator[None]:
        counts[attention_hook._step.cache.kv_mode] += 1
        return scope(step)

    monkeypatch.setattr(native_attention, "kernel_step_scope", counted)
    return counts


@pytest.mark.parametrize("kv_mode", ["vattention", "paged"])
def test_decode_steps_run_natively_and_give_the_python_paths_tokens(
    tiny_model_dir: Path, kv_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[1, 5, 9, 13, 2], [7, 3, 3, 8, 1, 4, 4, 9], [2, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), kv_mode=kv_mode, dtype="float32", kv_budget_bytes=1 << 20)
    counts = counting_native_steps(monkeypatch)
    native_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert counts[kv_mode] >= 8  # every decode step after the first, which builds the kernel
    monkeypatch.setattr(native_attention, "load", lambda: False)
    python_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    assert native_tokens == python_tokens


def _decoding_cache(layout: str) -> tuple[KVCache, list[SeqStep]]:
    """A cache holding two prompts, after one decode step through attend() (which builds the
    kernel), and the steps of the next decode step."""
    if layout == "vattention":
        cache: KVCache = VAttentionKVCache(SHAPE, 64, 1 << 20, page_size=4096, background_mapping=False)
    else:
        cache = PagedKVCache(SHAPE, 64, 1 << 20, block_size=8)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9]
    for seq_id, length in enumerate(lengths):
        cache.admit(seq_id, list(range(1, length + 1)))
    prefill = [SeqStep(i, 0, n) for i, n in enumerate(lengths)]
    decode = [SeqStep(i, n, 1) for i, n in enumerate(lengths)]
    for steps in (prefill, decode):
        if steps is decode:
            for s in steps:
                cache.grow(s.seq_id, [1])
        batch = StepBatch.build(steps)
        plan = cache.prepare(batch)
        for layer in range(SHAPE.num_layers):
            q = torch.randn(batch.num_tokens, Q_HEADS, SHAPE.head_dim, generator=gen)
            k, v = torch.randn(2, batch.num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gen)
            cache.attend(layer, q, k, v, plan, SCALE)
        cache.finish_step(plan)
    for seq_id in range(len(lengths)):
        cache.grow(seq_id, [1])
    return cache, [SeqStep(i, n + 1, 1) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("layout", ["vattention", "paged"])
def test_the_native_op_checks_its_arguments_and_attends_as_attend_does(layout: str) -> None:
    cache, steps = _decoding_cache(layout)
    batch = StepBatch.build(steps)
    plan = cache.prepare(batch)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, Q_HEADS, SHAPE.head_dim, generator=gen)
    k, v = torch.randn(2, batch.num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gen)
    with step_context(cache, plan):
        assert attention_hook._step.native
        with pytest.raises(IndexError, match=r"layer 2 is outside \[0, 2\)"):
            attention_op(q, k, v, 2, SCALE)
        with pytest.raises(ValueError, match=r"k and v must be \[2, 2, 16\]"):
            attention_op(q, k[:, :1], v[:, :1], 0, SCALE)
        with pytest.raises(ValueError, match=r"q must be \[2, 4, 16\]"):
            attention_op(q[:, :3], k, v, 0, SCALE)
        with pytest.raises(TypeError, match="q, k and v must be Float"):
            attention_op(q.double(), k, v, 0, SCALE)
        for layer in range(SHAPE.num_layers):  # attend() writes the same k/v again: the same output
            assert torch.equal(attention_op(q, k, v, layer, SCALE), cache.attend(layer, q, k, v, plan, SCALE))
    assert not attention_hook._step.native
    cache.finish_step(plan)
    cache.close()


def test_outside_a_step_the_op_reaches_python_and_says_so() -> None:
    q = torch.zeros(1, Q_HEADS, SHAPE.head_dim)
    k = torch.zeros(1, SHAPE.num_kv_heads, SHAPE.head_dim)
    with pytest.raises(RuntimeError, match="outside an engine step"):
        attention_op(q, k, k, 0, SCALE)
