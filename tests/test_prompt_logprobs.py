"""prompt_logprobs: every prompt token after the first gets the log-probability a plain forward
of the model gives it, its rank and the top-k, in every KV mode, across prefill chunks, a
preemption and a prefix the cache already holds; and it crosses the engine process intact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from vmkv import LLM, SamplingParams
from vmkv.engine.async_process import AsyncProcessLLM
from vmkv.model.store import load_model

PROMPT = list(range(5, 45))  # 40 tokens: three chunks at max_num_batched_tokens 16
K = 3


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> torch.Tensor:
    """log-softmax of a plain fp32 forward over the whole prompt: row p predicts token p + 1."""
    model = load_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)


def check(prompt_logprobs: list, expected: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        entry, rank = prompt_logprobs[j]
        row = expected[j - 1]
        token = PROMPT[j]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        assert rank == int((row > row[token]).sum()) + 1
        top = set(row.topk(K).indices.tolist())
        assert top <= set(entry) and set(entry) <= top | {token}


@pytest.mark.parametrize("kv_mode", ["vattention", "paged", "contiguous"])
def test_prompt_logprobs_match_a_plain_forward(
    tiny_model_dir: Path, expected: torch.Tensor, kv_mode: str
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        kv_mode=kv_mode,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=K)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert plain.prompt_logprobs is None
    # the second request's prompt is cached by the first (paged, vattention): it is computed anyway
    for out in llm.generate([PROMPT, PROMPT], params):
        check(out.prompt_logprobs, expected)
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.close()


def test_prompt_logprobs_survive_a_recompute_preemption(tiny_model_dir: Path, expected: torch.Tensor) -> None:
    # four 40-token prompts growing to 80 tokens in 96 KiB of paged KV: some are preempted
    # (recomputed from scratch), and none may record a prompt token twice or lose one
    llm = LLM(
        str(tiny_model_dir),
        kv_mode="paged",
        dtype="float32",
        max_model_len=128,
        kv_budget_bytes=96 * 1024,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    for out in llm.generate([PROMPT] * 4, params):
        check(out.prompt_logprobs, expected)
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.close()


def test_prompt_logprobs_cross_the_engine_process(tiny_model_dir: Path, expected: torch.Tensor) -> None:
    llm = AsyncProcessLLM(
        model=str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=128, num_threads=1
    )

    async def run() -> list:
        last = None
        async for out in llm.generate(
            PROMPT, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=K)
        ):
            last = out
        return last.prompt_logprobs

    try:
        check(asyncio.run(run()), expected)
    finally:
        llm.shutdown()
