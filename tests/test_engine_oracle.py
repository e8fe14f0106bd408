"""The correctness oracle, fast version: SmolLM2-135M in float32, a few chat prompts batched,
every kv mode, with preemption forced by a small KV budget. The full oracle (16 prompts,
fp32 and the bf16 policy) is `python benchmarks/bench_engine.py oracle`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vmkv.engine import LLM, SamplingParams
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids, compare, reference_greedy
from vmkv.model.store import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 16
FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(default_model_dir), CHAT_PROMPTS[2:6])


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompts: list[list[int]]):  # noqa: ANN201
    return reference_greedy(default_model_dir, prompts, MAX_TOKENS, torch.float32)


@pytest.mark.parametrize(
    ("kv_mode", "preemption_mode", "budget_tokens"),
    [("vattention", "recompute", 150), ("paged", "swap", 150), ("contiguous", "recompute", 128)],
)
def test_fp32_greedy_matches_transformers(
    default_model_dir: Path, prompts, reference, kv_mode: str, preemption_mode: str, budget_tokens: int
) -> None:
    llm = LLM(
        str(default_model_dir),
        kv_mode=kv_mode,
        dtype="float32",
        kv_budget_bytes=budget_tokens * FP32_BYTES_PER_TOKEN,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        preemption_mode=preemption_mode,
        page_size=4096,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    stats = llm.engine.stats()
    llm.close()
    report = compare(reference, [o.outputs[0].token_ids for o in outputs])
    assert report.passed, report.mismatches  # near-ties (margin < 1e-4) are the only allowed difference
    assert report.identical + len(report.near_ties) == len(prompts)
    if kv_mode == "contiguous":
        assert stats.peak_running_seqs == 2  # 128 tokens of budget = two 64-token slots
    else:
        assert stats.num_preemptions > 0
