"""Speculative decoding (n-gram prompt lookup): a request's tokens are those it gets without
speculation, in every layout, under preemption, for greedy, seeded and logprob requests; the
cache keeps exactly the accepted tokens' KV; and the proposer finds what it should.

Most engine tests draft with an oracle: the tokens the request will produce (known from a run
without speculation), some of them changed, so every case is met in a few steps: a draft
accepted whole (plus the bonus token), cut short at any position, rejected at once, and a
sample ending inside an accepted run. The tiny random model's own text rarely repeats, so the
real proposer would leave most of them untried.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_engine_process import vmkv_serve
from torch._dynamo.utils import counters
from vmkv.paging import PagedKVCache

from vmkv.engine import LLM, LoRARequest, SamplingParams
from vmkv.engine import scheduler as scheduler_module
from vmkv.engine.args import engine_flags
from vmkv.engine.config import EngineConfig
from vmkv.engine.draft_length import StepCost
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids, compare, reference_greedy
from vmkv.engine.sampling_params import StructuredOutput
from vmkv.engine.speculative import SpeculativeConfig, propose_ngram
from vmkv.kv_cache import KVShape, SeqStep, StepBatch
from vmkv.model.store import load_tokenizer
from vmkv.model.tiny import build_random_lora
from vmkv.server.metrics import engine_samples
from vmkv.vattention import VAttentionKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SMALL_BUDGET = 96 * 1024  # tiny model, fp32: 192 tokens of KV, so the layouts must preempt


def make_llm(model_dir: Path, kv_mode: str, speculative: bool, **options: object) -> LLM:
    settings = {
        "kv_mode": kv_mode,
        "dtype": "float32",
        "kv_budget_bytes": SMALL_BUDGET,
        "max_model_len": 128,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,  # shorter than most prompts: prefill is chunked
        "page_size": 4096,
        "speculative_config": SPEC if speculative else None,
    }
    return LLM(str(model_dir), **(settings | options))


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:8])


def oracle_drafter(expected: Sequence[list[int]], seed: int = 0, wrong: float = 0.35):
    """A propose_ngram stand-in drafting each request's known continuation, a token in a
    `wrong` share of drafts changed at a random position (so drafts are cut short anywhere)."""
    rng = random.Random(seed)

    def propose(token_ids: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
        k = min(limit, config.num_speculative_tokens)
        for full in expected:
            if len(full) > len(token_ids) and full[: len(token_ids)] == list(token_ids):
                draft = full[len(token_ids) : len(token_ids) + k]
                if draft and rng.random() < wrong:
                    at = rng.randrange(len(draft))
                    draft[at] = (draft[at] + 1) % 384
                return draft
        return []

    return propose


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    llm.close()
    return outputs, stats


@pytest.mark.parametrize(
    ("kv_mode", "preemption_mode"),
    [
        ("paged", "recompute"),
        ("vattention", "recompute"),
        ("contiguous", "recompute"),
        ("paged", "swap"),
        ("vattention", "swap"),
    ],
)
def test_greedy_tokens_are_those_without_speculation_in_every_layout_under_preemption(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    kv_mode: str,
    preemption_mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, plain_stats = run(
        make_llm(tiny_model_dir, kv_mode, False, preemption_mode=preemption_mode), prompts, params
    )
    expected = [o.outputs[0].token_ids for o in plain]
    monkeypatch.setattr(
        scheduler_module,
        "propose_ngram",
        oracle_drafter([p + e for p, e in zip(prompts, expected, strict=True)]),
    )
    outputs, stats = run(
        make_llm(tiny_model_dir, kv_mode, True, preemption_mode=preemption_mode), prompts, params
    )
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # accepted and rejected drafts
    per_position = stats.spec_accepted_per_position  # a draft's tokens are accepted as a prefix
    assert sum(per_position) == stats.spec_accepted_tokens
    assert list(per_position) == sorted(per_position, reverse=True)
    assert stats.num_steps < plain_stats.num_steps
    assert stats.num_preemptions > 0 or kv_mode == "contiguous"  # its slots admit only what fits
    assert stats.generation_tokens == plain_stats.generation_tokens
    report = compare(reference_greedy(tiny_model_dir, prompts[:2], 24, torch.float32), expected[:2])
    assert report.identical == 2


def test_seeded_samples_logprobs_and_n_are_those_without_speculation(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each emitted token takes one draw from its sample's generator, with or without a draft,
    so a seeded request's tokens do not change; logprobs come from the same logits rows."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, n=2, max_tokens=20, min_tokens=20),
    ]
    plain, _ = run(make_llm(tiny_model_dir, "paged", False), prompts[:3], params)
    expected = [[o.token_ids for o in r.outputs] for r in plain]
    full = [p + tokens for p, r in zip(prompts, expected, strict=False) for tokens in r]
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle_drafter(full, seed=3))
    outputs, stats = run(make_llm(tiny_model_dir, "paged", True), prompts[:3], params)
    assert [[o.token_ids for o in r.outputs] for r in outputs] == expected
    assert stats.spec_accepted_tokens > 0
    for got, want in zip(outputs[0].outputs[0].logprobs, plain[0].outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, abs=1e-4)


def test_a_sample_ends_inside_an_accepted_draft(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_tokens and a stop token that fall inside an accepted run end the sample there: no
    token after them is emitted, and the cache gives back the sample's KV."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _ = run(make_llm(tiny_model_dir, "vattention", False), prompts[:2], params)
    expected = [o.outputs[0].token_ids for o in plain]
    full = [p + e for p, e in zip(prompts, expected, strict=False)]
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle_drafter(full, wrong=0.0))
    stop = expected[1][6]
    llm = make_llm(tiny_model_dir, "vattention", True)
    outputs = llm.generate(
        prompts[:2],
        [
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True),
        ],
    )
    assert outputs[0].outputs[0].token_ids == expected[0][:7]
    assert outputs[0].outputs[0].finish_reason == "length"
    assert outputs[1].outputs[0].token_ids == expected[1][: expected[1].index(stop) + 1]
    assert outputs[1].outputs[0].finish_reason == "stop"
    assert llm.engine.cache.memory().used_bytes == 0
    llm.close()


def test_grammars_and_stop_strings_hold_through_accepted_drafts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar's matcher advances over every accepted token and masks each position as a
    decode step would (the JSON stays valid and the same); a stop string completed inside an
    accepted run cuts the text there, as without speculation."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    structured = StructuredOutput("json", json.dumps(schema))
    params = [
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=40, structured=structured),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    prompts = [[5, 6, 7, 8], list(range(40, 60))]
    plain, _ = run(make_llm(tiny_model_dir, "paged", False), prompts, params)
    stop = plain[1].outputs[0].text[10:14]
    params[1] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    plain, _ = run(make_llm(tiny_model_dir, "paged", False), prompts, params)
    expected = [[(o.token_ids, o.text) for o in r.outputs] for r in plain]
    full = [p + o.token_ids for p, r in zip(prompts, plain, strict=True) for o in r.outputs]
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle_drafter(full, wrong=0.2))
    outputs, stats = run(make_llm(tiny_model_dir, "paged", True), prompts, params)
    assert [[(o.token_ids, o.text) for o in r.outputs] for r in outputs] == expected
    assert stats.spec_accepted_tokens > 0
    for sample in outputs[0].outputs:
        assert "n" in json.loads(sample.text)
    assert outputs[1].outputs[0].finish_reason == "stop" and stop not in outputs[1].outputs[0].text


def test_the_ngram_proposer_speeds_up_text_that_repeats_its_prompt(tiny_model_dir: Path) -> None:
    """The real proposer on a prompt that repeats: drafts are made and the tokens do not change."""
    prompt = [list(range(40, 60)) * 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = run(make_llm(tiny_model_dir, "vattention", False), prompt, params)
    outputs, stats = run(make_llm(tiny_model_dir, "vattention", True), prompt, params)
    assert outputs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert stats.spec_draft_tokens > 0
    common, _ = engine_samples(stats)
    assert common["spec_decode_num_draft_tokens_total"][2] == stats.spec_draft_tokens


# ----------------------------------------------------------------------------- the proposer


def brute_force_proposal(tokens: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    k = min(limit, config.num_speculative_tokens)
    if k < 1 or len(tokens) <= config.prompt_lookup_min:
        return []
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        ends = [i + n - 1 for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if ends:
            full = [e for e in ends if e + 1 + k <= len(tokens)]
            start = (full[-1] if full else ends[-1]) + 1
            return tokens[start : start + k]
    return []


def test_a_costly_token_is_drafted_where_drafts_are_kept_and_cut_where_they_fail(
    tiny_model_dir: Path,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a step whose tokens cost what the batch does (the threshold pinned) and half the
    requests drafting their true continuation, half a wrong one, the adaptive engine keeps about
    the accepted tokens of the fixed one and verifies few of the wrong ones; both emit the tokens
    of the engine without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = run(make_llm(tiny_model_dir, "paged", False), prompts, params)
    expected = [o.outputs[0].token_ids for o in plain]
    full = [p + e for p, e in zip(prompts, expected, strict=True)]
    right, wrong = oracle_drafter(full[::2], wrong=0.0), oracle_drafter(full[1::2], wrong=0.0)

    def propose(token_ids: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
        return right(token_ids, config, limit) or [(t + 1) % 384 for t in wrong(token_ids, config, limit)]

    monkeypatch.setattr(scheduler_module, "propose_ngram", propose)
    # a step of a + b * tokens seconds, a = 5 ms, b = 1 ms: at 8 sequences a token pays from 0.62
    monkeypatch.setattr(StepCost, "threshold", lambda self, batch: 0.001 * batch / (0.005 + 0.001 * batch))
    stats = {}
    for adaptive in (False, True):
        spec = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        llm = make_llm(tiny_model_dir, "paged", True, speculative_config=spec | {"adaptive_length": adaptive})
        outputs, stats[adaptive] = run(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    rejected = {a: s.spec_draft_tokens - s.spec_accepted_tokens for a, s in stats.items()}
    assert stats[True].spec_accepted_tokens >= 0.8 * stats[False].spec_accepted_tokens
    assert 0 < rejected[True] < 0.3 * rejected[False]


@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    lookup=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    limit=st.integers(0, 8),
)
def test_the_proposal_is_what_follows_the_longest_most_recent_match(
    tokens: list[int], k: int, lookup: tuple[int, int], limit: int
) -> None:
    low, extra = lookup
    config = SpeculativeConfig(k, low + extra, low)
    assert propose_ngram(tokens, config, limit) == brute_force_proposal(tokens, config, limit)


def test_the_config_reads_vllms_forms_and_refuses_what_it_cannot_do() -> None:
    parsed = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (parsed.num_speculative_tokens, parsed.prompt_lookup_max, parsed.prompt_lookup_min) == (3, 4, 4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5  # vLLM's default
    config = EngineConfig(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert config.speculative_config == SpeculativeConfig(2, 2, 2)
    flags = engine_flags(config)
    assert (
        SpeculativeConfig.parse(flags[flags.index("--speculative-config") + 1]) == config.speculative_config
    )
    for bad, message in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
        ('{"num_speculative_tokens": 2, "model": "draft"}', "model"),
        ('{"num_speculative_tokens": 0}', "positive integer"),
        ('{"prompt_lookup_max": 2}', "needs num_speculative_tokens"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must be <="),
        ("{nope", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, tensor_parallel_size=2)


def test_the_batch_size_schedule_picks_k_as_vllm_does() -> None:
    """vLLM's num_speculative_tokens_per_batch_size: inclusive ranges from 1, a size in a gap or
    past the last range takes the k before it, never more than num_speculative_tokens."""
    key = "num_speculative_tokens_per_batch_size"
    config = SpeculativeConfig.parse({"num_speculative_tokens": 4, key: [[1, 2, 6], [5, 8, 2], [9, 64, 0]]})
    assert [config.tokens_at(b) for b in (1, 2, 3, 4, 5, 8, 9, 500)] == [4, 4, 4, 4, 2, 2, 0, 0]
    assert SpeculativeConfig.parse(json.dumps(config.as_dict())) == config
    for bad in ([[2, 4, 1]], [], [[1, 4, 2], [3, 6, 1]], [[1, 2, -1]], [[1, 2]], "1-4:2", [[1, 2, True]]):
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.parse({"num_speculative_tokens": 4, key: bad})


# ------------------------------------------------------------------------ the cache's truncate

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def write(cache: PagedKVCache | VAttentionKVCache, seq_id: int, cached: int, new: int) -> None:
    plan = cache.prepare(StepBatch.build([SeqStep(seq_id, cached, new)]))
    for layer in range(SHAPE.num_layers):
        kv = torch.randn(new, SHAPE.num_kv_heads, SHAPE.head_dim)
        cache.attend(layer, torch.randn(new, 4, SHAPE.head_dim), kv, kv, plan, 0.25)
    cache.finish_step(plan)


def test_paged_copies_a_cached_block_a_rejected_draft_filled_before_writing_into_it() -> None:
    cache = PagedKVCache(SHAPE, 80, 20 * 8 * SHAPE.bytes_per_token, block_size=8, model_id="m")
    cache.admit(0, [1, 2, 3, 4])
    write(cache, 0, 0, 4)
    cache.grow(0, [5, 6, 7, 8, 9, 10])  # a draft filling block 0: indexed once written
    write(cache, 0, 4, 6)
    cache.truncate(0, 6)  # tokens 7.. rejected: block 0 is cached, and partly ours again
    assert len(cache.seqs[0].block_table) == 1
    cache.grow(0, [11])
    assert cache.stats().cow_copies == 1
    write(cache, 0, 6, 1)
    assert cache.admit(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8  # the cached block still holds its tokens
    with pytest.raises(ValueError):
        cache.truncate(0, 0)


def test_vattention_forgets_a_cached_chunk_that_held_a_rejected_draft_token() -> None:
    cache = VAttentionKVCache(
        SHAPE, 80, 1 << 20, page_size=4096, order="token", background_mapping=False, prefix_caching=True
    )  # token-major: 32 tokens a page, a chunk is one page
    cache.admit(0, list(range(1, 31)))
    write(cache, 0, 0, 30)
    cache.grow(0, [31, 32, 33, 34])
    write(cache, 0, 30, 4)
    assert len(cache.prefix.chunks) == 1
    cache.truncate(0, 31)  # token 32 (in chunk 0) rejected: the chunk is written again
    assert len(cache.prefix.chunks) == 0
    cache.grow(0, [99])
    write(cache, 0, 31, 1)  # prepare() refuses a write into a shared page
    assert cache.memory().used_bytes == 32 * SHAPE.bytes_per_token
    cache.close()


def test_compiled_speculation_runs_on_the_graphs_compiled_at_start(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with drafts is a step of chunks over cached context: the compiled graph for any
    step other than batch-1 decode serves it, so nothing compiles after start."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain, _ = run(make_llm(tiny_model_dir, "paged", False), prompts[:4], params)
    expected = [o.outputs[0].token_ids for o in plain]
    full = [p + e for p, e in zip(prompts, expected, strict=False)]
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle_drafter(full))
    llm = make_llm(tiny_model_dir, "paged", True, compile_model=True)
    assert llm.engine.runner.compiled
    graphs = counters["stats"]["unique_graphs"]
    outputs, stats = run(llm, prompts[:4], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.spec_accepted_tokens > 0
    assert counters["stats"]["unique_graphs"] == graphs


def test_vmkv_serve_speculates_with_vllms_flag_and_reports_it_in_metrics(tiny_model_dir: Path) -> None:
    """`vmkv serve --speculative-config JSON`: answers, streamed or not, are the tokens and text
    of an engine without speculation; /metrics counts drafts as vLLM names them; a config vmkv
    cannot run stops the start with the reason."""
    prompt = list(range(40, 60)) * 3
    offline = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, kv_budget_bytes=8 << 20)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    offline.close()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    with vmkv_serve(tiny_model_dir, "--max-model-len", "128", "--speculative-config", spec) as (_, url):
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        request = {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        extra = {"ignore_eos": True, "return_token_ids": True}
        answer = api.completions.create(**request, extra_body=extra)
        assert answer.choices[0].token_ids == expected.outputs[0].token_ids
        streamed = "".join(
            c.choices[0].text for c in api.completions.create(**request, stream=True, extra_body=extra)
        )
        assert streamed == answer.choices[0].text == expected.outputs[0].text
        metrics = httpx.get(f"{url}/metrics").text
    drafted = [
        line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in metrics
    assert ',position="2"}' in metrics  # positions 0, 1, 2 of 3-token drafts
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "vmkv.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--speculative-config",
            '{"method": "eagle", "num_speculative_tokens": 2}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode != 0 and "eagle" in failed.stderr


def test_a_lora_adapters_requests_speculate_with_its_weights(
    tiny_model_dir: Path, prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafted sample's rows are one slice of the step, so its adapter's terms reach every
    verified position: the tokens are those of the same adapter without speculation."""
    lora = LoRARequest("first", 1, str(build_random_lora(tiny_model_dir, tmp_path / "first", seed=1)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [lora, None, lora]
    plain_llm = make_llm(tiny_model_dir, "vattention", False, enable_lora=True)
    plain = plain_llm.generate(prompts[:3], params, lora_request=requests)
    plain_llm.close()
    expected = [o.outputs[0].token_ids for o in plain]
    full = [p + e for p, e in zip(prompts, expected, strict=False)]
    monkeypatch.setattr(scheduler_module, "propose_ngram", oracle_drafter(full))
    llm = make_llm(tiny_model_dir, "vattention", True, enable_lora=True)
    outputs = llm.generate(prompts[:3], params, lora_request=requests)
    stats = llm.engine.stats()
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    base, _ = run(make_llm(tiny_model_dir, "vattention", False), prompts[:1], params)
    assert expected[0] != base[0].outputs[0].token_ids  # the adapter changes the tokens
    assert stats.spec_accepted_tokens > 0
