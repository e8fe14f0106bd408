"""The decoder under torch.compile: token-identical to eager (tiny model, fp32, preemption and
chunked prefill forced), compiled once at start, and eager with a warning when compiling fails.

Compiling the tiny model's two graphs takes seconds (tens on a cold inductor cache), so only
these tests pay it; every other test runs the default, eager, path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from vmkv.engine import LLM, SamplingParams
from vmkv.engine.compiled import WARMUP_TOKEN_COUNTS
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids, compare, reference_greedy
from vmkv.engine.rotary_hook import route_rotary_embedding
from vmkv.model.store import load_tokenizer
from vmkv.model.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 16
SMALL_BUDGET = 96 * 1024  # tiny model, fp32: 192 tokens of KV, so the layouts must preempt


def make_llm(model_dir: Path, kv_mode: str, compile_model: bool) -> LLM:
    return LLM(
        str(model_dir),
        kv_mode=kv_mode,
        dtype="float32",
        kv_budget_bytes=SMALL_BUDGET,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # shorter than most prompts: prefill is chunked
        page_size=4096,
        compile_model=compile_model,
    )


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:8])


@pytest.mark.parametrize("kv_mode", ["vattention", "paged"])
def test_compiled_is_token_identical_to_eager_and_compiles_only_at_start(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    eager = make_llm(tiny_model_dir, kv_mode, compile_model=False)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    eager.close()

    llm = make_llm(tiny_model_dir, kv_mode, compile_model=True)
    assert llm.engine.runner.compiled
    graphs = counters["stats"]["unique_graphs"]
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    llm.close()
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    assert stats.num_preemptions > 0 and max(len(p) for p in prompts) > 32
    assert counters["stats"]["unique_graphs"] == graphs  # decode and chunked prefill reuse the start's graphs
    report = compare(reference_greedy(tiny_model_dir, prompts[:2], MAX_TOKENS, torch.float32), got[:2])
    assert report.identical == 2


def test_each_graph_is_traced_once_at_start(tiny_model_dir: Path) -> None:
    """dynamo once traced every graph twice: its first attempt made the model's Python floats
    (RMSNorm's epsilon, a power of 2) symbolic, failed to turn them into tensors and started over
    with them constant: more than half of a start's compile time on the default model."""

    def attempts(n: int) -> int:
        return len(compilation_time_metrics.get(f"compile_attempt_{n}", []))

    first, second = attempts(0), attempts(1)
    llm = make_llm(tiny_model_dir, "paged", compile_model=True)
    llm.close()
    assert llm.engine.runner.compiled
    assert attempts(0) - first == len(WARMUP_TOKEN_COUNTS)  # one attempt per graph ...
    assert attempts(1) == second  # ... and no second


def test_engines_of_different_models_in_one_process_each_run_their_own_graphs(
    tiny_model_dir: Path, tmp_path: Path, prompts: list[list[int]]
) -> None:
    """The compiled graphs keep only the guards on their inputs, so a second model's calls must
    never reach the first model's graphs: each engine compiles an entry point of its own."""
    deeper = build_tiny_model(
        tmp_path / "deeper", seed=1, num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = {}
    for model_dir in (tiny_model_dir, deeper):
        eager = make_llm(model_dir, "paged", compile_model=False)
        expected[model_dir] = [o.outputs[0].token_ids for o in eager.generate(prompts[:3], params)]
        eager.close()
    compiled = {model_dir: make_llm(model_dir, "paged", compile_model=True) for model_dir in expected}
    for model_dir, llm in compiled.items():  # the first model again after the second compiled
        assert llm.engine.runner.compiled
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params)] == expected[model_dir]
    for llm in compiled.values():
        llm.close()


def test_a_compiler_failure_falls_back_to_eager_with_a_warning(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_compile(model: torch.nn.Module, **kwargs: object) -> object:
        def fail(**inputs: object) -> None:
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="vmkv.engine.compiled"):
        llm = make_llm(tiny_model_dir, "paged", compile_model=True)
    assert not llm.engine.runner.compiled
    assert "RuntimeError: no C++ compiler" in caplog.text
    out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))[0]
    llm.close()
    assert len(out.outputs[0].token_ids) == 4


def test_the_compiled_decoder_evaluates_the_rotary_embedding_once_per_step(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inlined by inductor, the rotary cos/sin were recomputed inside every layer's kernel; run
    through `vmkv::rotary_embedding`, the model's own rotary forward runs once per forward."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    calls = []
    original = LlamaRotaryEmbedding.forward

    def counted(self: LlamaRotaryEmbedding, x: torch.Tensor, position_ids: torch.Tensor) -> object:
        calls.append(position_ids.shape[-1])
        return original(self, x, position_ids)

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", counted)
    llm = make_llm(tiny_model_dir, "paged", compile_model=True)
    assert llm.engine.runner.compiled
    calls.clear()
    steps = llm.engine.num_steps
    llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=4))
    steps = llm.engine.num_steps - steps
    llm.close()
    assert len(calls) == steps > 0


def test_a_decoder_without_a_cos_sin_rotary_module_keeps_its_own_forward() -> None:
    class Plain(torch.nn.Module):
        pass

    class OneTensor(torch.nn.Module):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return position_ids.float()

    odd = Plain()
    odd.rotary_emb = OneTensor()
    forward = odd.rotary_emb.forward
    assert not route_rotary_embedding(Plain())
    assert not route_rotary_embedding(odd)
    assert odd.rotary_emb.forward == forward
