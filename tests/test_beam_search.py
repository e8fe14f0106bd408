"""Beam search in the engine against its definition: vLLM's algorithm written out plainly over a
no-cache forward of the same model, in every kv mode, with preemption forced."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_engine import make_llm as make_engine_llm

from vmkv.engine import LLM, SamplingParams
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids
from vmkv.model.store import load_model, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH = 3
MAX_TOKENS = 16


def make_llm(model_dir: Path, kv_mode: str, **kwargs: object) -> LLM:
    """test_engine's engine, with prefill chunked at 32 tokens."""
    return make_engine_llm(model_dir, kv_mode, **({"max_num_batched_tokens": 32} | kwargs))


def reference_beam_search(
    model: torch.nn.Module,
    prompt: list[int],
    width: int,
    max_tokens: int,
    ends: set[int],
    length_penalty: float,
) -> list[tuple[list[int], float]]:
    """(generated tokens, cumulative logprob) of the answer, best first: each step every beam
    offers its top 2 x width tokens, ending ones finish, the width best others carry on."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cumulative in beams:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, -1).topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                hypothesis = (tokens + [token], cumulative + value)
                (finished if token in ends else candidates).append(hypothesis)
        beams = sorted(candidates, key=lambda h: -h[1])[:width]

    def score(h: tuple[list[int], float]) -> float:
        length = len(prompt) + len(h[0]) - (h[0][-1] in ends)
        return h[1] / length**length_penalty

    return sorted(finished + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:4])


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(tiny_model_dir, torch.float32)


def assert_matches(outputs, references) -> None:  # noqa: ANN001
    for output, reference in zip(outputs, references, strict=True):
        got = [(o.token_ids, o.cumulative_logprob) for o in output.outputs]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in reference]
        for (_, cumulative), (_, expected) in zip(got, reference, strict=True):
            assert math.isclose(cumulative, expected, rel_tol=1e-4, abs_tol=1e-4)
        assert [o.index for o in output.outputs] == list(range(WIDTH))


@pytest.mark.parametrize(
    ("kv_mode", "preemption_mode"),
    [
        ("paged", "recompute"),
        ("vattention", "swap"),
        ("vattention", "recompute"),
        ("contiguous", "recompute"),
    ],
)
def test_beams_match_the_definition_under_preemption(
    tiny_model_dir: Path, prompts, model, kv_mode: str, preemption_mode: str
) -> None:
    """Each beam forks its KV or is freed every step; a small budget preempts beams mid-search
    (recomputed beams must come back in lockstep), and the answers stay the definition's."""
    # 160 tokens: one request's 3 beams fit, not 4 requests'; contiguous: 4 slots of 128 tokens
    budget = 80 * 1024 if kv_mode != "contiguous" else 1 << 18
    llm = make_llm(
        tiny_model_dir, kv_mode, kv_budget_bytes=budget, preemption_mode=preemption_mode, max_num_seqs=12
    )
    params = SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params)
    stats, eos = llm.engine.stats(), set(llm.engine.info.eos_token_ids)
    llm.close()
    references = [reference_beam_search(model, p, WIDTH, MAX_TOKENS, eos, 1.0) for p in prompts]
    assert_matches(outputs, references)
    if kv_mode != "contiguous":
        assert stats.num_preemptions > 0
    assert stats.memory.used_bytes == 0 and stats.num_running_seqs == 0  # every beam freed


def test_ending_tokens_finish_hypotheses_ranked_by_length_penalty(
    tiny_model_dir: Path, prompts, model
) -> None:
    """A stop token id among a beam's candidates finishes a hypothesis (its token kept, not
    counted in the length); the answer mixes finished and live ones by the penalized score."""
    llm = make_llm(tiny_model_dir, "paged")
    eos = set(llm.engine.info.eos_token_ids)
    reference = reference_beam_search(model, prompts[0], WIDTH, MAX_TOKENS, eos, 1.0)
    stop = reference[0][0][1]  # a token the best beam takes: candidates will end on it
    for penalty in (0.0, 2.0):
        params = SamplingParams(
            n=WIDTH,
            use_beam_search=True,
            max_tokens=MAX_TOKENS,
            stop_token_ids=[stop],
            length_penalty=penalty,
        )
        (output,) = llm.generate([prompts[0]], params)
        expected = reference_beam_search(model, prompts[0], WIDTH, MAX_TOKENS, eos | {stop}, penalty)
        assert_matches([output], [expected])
        ended = [o for o in output.outputs if o.finish_reason == "stop"]
        assert any(o.token_ids[-1] == stop and o.stop_reason == stop for o in ended)
        assert all(o.finish_reason == "length" for o in output.outputs if o not in ended)
    llm.close()


def test_logprobs_and_text_follow_each_beam(tiny_model_dir: Path, prompts) -> None:
    llm = make_llm(tiny_model_dir, "vattention")
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=6, logprobs=3)
    (output,) = llm.generate([prompts[1]], params)
    tokenizer = llm.engine.tokenizer
    llm.close()
    for sample in output.outputs:
        assert len(sample.logprobs) == len(sample.token_ids) == 6
        assert all(
            token in step and len(step) >= 3
            for token, step in zip(sample.token_ids, sample.logprobs, strict=True)
        )
        chosen = sum(step[token] for token, step in zip(sample.token_ids, sample.logprobs, strict=True))
        assert math.isclose(chosen, sample.cumulative_logprob, rel_tol=1e-5)
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 0.9), ("top_k", 5), ("stop", ["x"]), ("repetition_penalty", 1.2), ("min_tokens", 2)],
)
def test_controls_beam_search_would_ignore_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(n=2, use_beam_search=True, **{field: value})


def test_length_penalty_without_beam_search_is_refused() -> None:
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(length_penalty=0.5)
