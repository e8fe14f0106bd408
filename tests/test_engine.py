"""The engine end to end on the tiny model: every kv mode against transformers, sampling,
stopping, rejection, abort, streaming."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vmkv.engine import LLM, AsyncLLM, EngineDead, RequestRejected, SamplingParams
from vmkv.engine.config import KV_MODES
from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.oracle import CHAT_PROMPTS, ReferenceRun, chat_prompt_ids, compare, reference_greedy
from vmkv.engine.repetition import RepetitionDetection
from vmkv.model.store import load_tokenizer
from vmkv.model.tiny import build_tiny_model

MAX_TOKENS = 24
# Tiny model, fp32: 512 B of KV per token. 96 KiB holds 192 tokens, far less than the 8 prompts
# need together, so vattention (4 KiB pages) and paged (16-token blocks) must preempt.
SMALL_BUDGET = 96 * 1024


def make_llm(model_dir: Path, kv_mode: str = "paged", **kwargs: object) -> LLM:
    options = {
        "kv_mode": kv_mode,
        "dtype": "float32",
        "kv_budget_bytes": 1 << 22,
        "max_model_len": 128,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "page_size": 4096,
    }
    return LLM(str(model_dir), **(options | kwargs))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:8])


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompts: list[list[int]]):  # noqa: ANN201
    return reference_greedy(tiny_model_dir, prompts, MAX_TOKENS, torch.float32)


@pytest.mark.parametrize("order", ["token", "head"])
def test_vattention_lays_out_kv_in_the_order_asked_and_gives_the_same_tokens(
    tiny_model_dir: Path, prompts: list[list[int]], reference, order: str
) -> None:
    llm = make_llm(tiny_model_dir, "vattention", kv_order=order, max_num_batched_tokens=32)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    geometry = llm.engine.cache.geometry
    llm.close()
    assert geometry.order == order
    report = compare(reference, [o.outputs[0].token_ids for o in outputs])
    assert report.passed and report.identical == len(prompts), report.mismatches


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_mode", ["vattention", "paged", "contiguous"])
def test_greedy_matches_transformers_under_preemption_and_chunking(
    tiny_model_dir: Path, prompts: list[list[int]], reference, kv_mode: str, preemption_mode: str
) -> None:
    llm = make_llm(
        tiny_model_dir,
        kv_mode,
        kv_budget_bytes=SMALL_BUDGET if kv_mode != "contiguous" else 1 << 17,
        preemption_mode=preemption_mode,
        max_num_batched_tokens=32,  # shorter than most prompts: prefill is chunked
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    stats = llm.engine.stats()
    llm.close()
    report = compare(reference, [o.outputs[0].token_ids for o in outputs])
    assert report.passed, report.mismatches
    assert report.identical == len(prompts)  # the tiny model has clear winners: not even near-ties
    assert max(len(p) for p in prompts) > 32
    if kv_mode == "contiguous":
        assert stats.peak_running_seqs == 2  # two max_len slots, reserved up front
    else:
        assert stats.num_preemptions > 0
    assert stats.memory.used_bytes == 0 and stats.num_running_seqs == 0  # everything freed


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_other_architectures_match_transformers_unmodified(tmp_path: Path, architecture: str) -> None:
    """Qwen2 (biased q/k/v) and Mistral run through the same attention hook as Llama."""
    model_dir = build_tiny_model(tmp_path / architecture, architecture)
    prompts = chat_prompt_ids(load_tokenizer(model_dir), CHAT_PROMPTS[:4])
    reference = reference_greedy(model_dir, prompts, MAX_TOKENS, torch.float32)
    for kv_mode in KV_MODES:
        llm = make_llm(model_dir, kv_mode, max_num_batched_tokens=32)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        llm.close()
        report = compare(reference, [o.outputs[0].token_ids for o in outputs])
        assert report.identical == len(prompts), (kv_mode, report.mismatches, report.near_ties)


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "mistral", "mistral")
    config_file = model_dir / "config.json"
    config_file.write_text(config_file.read_text().replace('"sliding_window": 4096', '"sliding_window": 64'))
    with pytest.raises(ValueError, match="sliding window of 64 tokens"):
        make_llm(model_dir, max_model_len=128)
    make_llm(model_dir, max_model_len=64).close()


def test_outputs_carry_text_and_reasons(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir)
    tokenizer = llm.tokenizer
    out = llm.generate("What is the capital of France?", SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert out.prompt == "What is the capital of France?"
    assert out.prompt_token_ids == tokenizer("What is the capital of France?").input_ids
    sample = out.outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 10
    assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert out.metrics.first_token_time >= out.metrics.arrival_time


def test_stop_strings_are_trimmed_and_stop_tokens_kept(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    llm = make_llm(tiny_model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    base = llm.generate(prompts[0], greedy)[0].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    cut = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop]))[0]
    sample = cut.outputs[0]
    assert sample.text == base.text[: base.text.find(stop)]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)

    token = base.token_ids[4]
    first = base.token_ids.index(token)
    stopped = llm.generate(
        prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[token])
    )[0].outputs[0]
    assert stopped.token_ids == base.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", token)


@given(
    pattern=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    prefix=st.lists(st.integers(0, 9), max_size=6),
    count=st.integers(2, 4),
)
def test_repetition_is_a_pattern_repeated_at_the_tail(
    pattern: list[int], prefix: list[int], count: int
) -> None:
    """A pattern of a size in range, repeated min_count times at the end, is found; any output
    is judged as slicing it says (the last s tokens, count times over, for some s in range)."""
    detection = RepetitionDetection(max_pattern_size=4, min_count=count)
    assert detection.repeats(prefix + pattern * count)

    def sliced(output: list[int]) -> bool:
        return any(
            size * count <= len(output) and output[-size * count :] == output[-size:] * count
            for size in range(1, 5)
        )

    for output in (prefix + [10] + pattern * (count - 1), pattern + prefix, prefix * count):
        assert detection.repeats(output) == sliced(output), output
    assert not detection.repeats(list(range(20)))
    with pytest.raises(ValueError, match="min_count"):
        RepetitionDetection(max_pattern_size=2, min_count=1)


def test_a_loop_ends_the_sample_with_reason_repetition(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """One allowed token makes the output a loop of size 1: it ends after min_count of them, but
    not before min_tokens."""
    llm = make_llm(tiny_model_dir)
    looping = dict(temperature=0.0, max_tokens=MAX_TOKENS, allowed_token_ids=[7])
    detection = RepetitionDetection(max_pattern_size=3, min_count=4)
    sample = llm.generate(prompts[0], SamplingParams(**looping, repetition_detection=detection))[0].outputs[0]
    assert sample.token_ids == [7] * 4
    assert (sample.finish_reason, sample.stop_reason) == ("repetition", "repetition_detected")
    later = SamplingParams(**looping, repetition_detection=detection, min_tokens=6)
    assert len(llm.generate(prompts[0], later)[0].outputs[0].token_ids) == 6


def test_eos_stops_unless_ignored(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir)
    base = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    # pretend the model emits its end token there
    llm.engine.info = dataclasses.replace(llm.engine.info, eos_token_ids=frozenset({base.token_ids[3]}))
    stopped = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3]) + 1]
    )
    ignored = llm.generate(
        prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert ignored[0].outputs[0].token_ids == base.token_ids


@pytest.mark.parametrize("kv_mode", ["vattention", "paged", "contiguous"])
def test_parallel_samples_share_one_prefill_and_seeds_reproduce(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str
) -> None:
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    llm = make_llm(tiny_model_dir, kv_mode)
    first = llm.generate(prompts[2], params)[0]
    assert llm.engine.stats().prompt_tokens == len(prompts[2])  # prefilled once, then forked
    # the same seed gives the same samples, whatever else shares the batch
    again = llm.generate(
        [prompts[5], prompts[2], prompts[2]], [SamplingParams(max_tokens=12), params, params]
    )
    llm.close()
    assert [o.index for o in first.outputs] == [0, 1, 2]
    tokens = [o.token_ids for o in first.outputs]
    assert all(len(t) == 12 for t in tokens) and len({tuple(t) for t in tokens}) > 1
    assert [o.token_ids for o in again[1].outputs] == tokens
    assert [o.token_ids for o in again[2].outputs] == tokens


def test_seeds_use_all_64_bits(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    def sampled(seed: int) -> list[list[int]]:
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts[2], params)[0].outputs]

    llm = make_llm(tiny_model_dir)
    largest = sampled(2**63 - 1)
    assert sampled(2**63 - 1) == largest  # same seed, same samples
    assert largest[0] != largest[1]  # each sample draws its own stream
    # torch's CPU generator keeps only a seed's low 32 bits: the high ones must still count
    assert sampled(5) != sampled(5 + 2**32)
    llm.close()


def test_cache_salt_isolates_the_prefix_cache(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir, "paged", block_size=16)
    prompt = max(prompts, key=len)
    assert len(prompt) > 2 * 16  # at least two whole blocks to find in the prefix cache
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def hits_of(cache_salt: str | None) -> tuple[int, list[int]]:
        before = llm.engine.stats().prefix_cache_hits
        out = llm.generate(prompt, greedy, cache_salt=cache_salt)[0]
        return llm.engine.stats().prefix_cache_hits - before, out.outputs[0].token_ids

    first_hits, tokens = hits_of("tenant-a")
    assert first_hits == 0
    assert hits_of("tenant-b") == (0, tokens)  # another salt finds nothing of tenant-a's
    assert hits_of(None) == (0, tokens)  # nor does a request without one
    assert hits_of("tenant-a") == (len(prompt) // 16 * 16, tokens)  # the same salt shares its blocks
    llm.close()


def test_priority_orders_requests_only_under_the_priority_policy(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    fcfs = make_llm(tiny_model_dir)
    expected = [out.outputs[0].token_ids for out in fcfs.generate(prompts[:3], greedy)]
    with pytest.raises(RequestRejected, match="scheduling-policy priority") as caught:
        fcfs.generate(prompts[:3], greedy, priority=[0, 1, 0])
    assert caught.value.param == "priority" and not fcfs.engine.has_unfinished_requests()
    fcfs.close()
    llm = make_llm(tiny_model_dir, scheduling_policy="priority", max_num_seqs=1)  # one at a time
    outputs = llm.generate(prompts[:3], greedy, priority=[2, 0, 1])
    llm.close()
    assert [out.outputs[0].token_ids for out in outputs] == expected
    finish_order = sorted(range(3), key=lambda i: outputs[i].metrics.finished_time)
    assert finish_order == [1, 2, 0]


def test_logprobs_are_the_model_distribution(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir)
    out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert len(entry) == 3 and token in entry
        assert max(entry, key=entry.get) == token  # greedy picks the most likely
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_impossible_requests_are_rejected_before_anything_runs(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, kv_budget_bytes=SMALL_BUDGET)
    cases = [
        ([5] * 100, SamplingParams(max_tokens=29)),  # 129 tokens > max_model_len 128
        ([5] * 100, SamplingParams(max_tokens=20, n=2)),  # 240 tokens > the cache's 192
        ([5, 10**6], SamplingParams()),  # not a token id
        ([], SamplingParams()),
    ]
    for prompt, params in cases:
        with pytest.raises(RequestRejected):
            llm.generate([prompt, [5, 6, 7]], params)
        assert not llm.engine.has_unfinished_requests()
    assert issubclass(RequestRejected, ValueError)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


def test_abort_frees_the_request(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    engine.add_request("a", prompts[0], SamplingParams(temperature=0.0, max_tokens=20))
    engine.add_request("b", prompts[1], SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    engine.step()
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and finished[0].outputs[0].finish_reason == "length"
    assert engine.cache.memory().allocated_bytes == 0


@pytest.mark.parametrize("kv_mode", ["vattention", "paged"])
def test_stats_reuse_kv_figures_only_while_the_batch_is_unchanged_and_young(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str
) -> None:
    engine = make_llm(tiny_model_dir, kv_mode).engine
    engine.add_request("a", prompts[0], SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    first = engine.stats(kv_max_age=60.0)
    for _ in range(4):
        engine.step()
    held = engine.stats(kv_max_age=60.0)  # same batch, young figures: reused, counters current
    assert held.memory == first.memory and held.num_steps == first.num_steps + 4
    assert engine.stats().memory.used_bytes > first.memory.used_bytes  # 4 tokens more, fresh
    engine.add_request("b", prompts[1], SamplingParams(temperature=0.0, max_tokens=20))
    assert engine.stats(kv_max_age=60.0).num_waiting == 1
    engine.step()  # "b" joins the batch: the figures are taken again
    assert engine.stats(kv_max_age=60.0).memory == engine.stats().memory
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.stats(kv_max_age=60.0).memory.used_bytes == 0


def test_detokenizer_waits_for_whole_characters(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "Größe: 中文字 🙂 ok"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # some byte tokens had to wait for the rest of their character


def test_chat_renders_conversations_with_the_template_as_the_server_does(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    tokenizer = llm.tokenizer
    first = [{"role": "user", "content": "Hi!"}]
    second = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    (one,) = llm.chat(first, params)
    both = llm.chat([first, second], params, continue_final_message=True, add_generation_prompt=False)
    thinking_off = llm.chat(first, params, chat_template_kwargs={"enable_thinking": False})[0]
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    (templated,) = llm.chat(first, params, chat_template=plain)
    llm.close()
    rendered = [
        tokenizer.apply_chat_template(
            first, tokenize=False, add_generation_prompt=False, continue_final_message=True
        ),
        tokenizer.apply_chat_template(
            second, tokenize=False, add_generation_prompt=False, continue_final_message=True
        ),
    ]
    assert (
        one.prompt_token_ids == tokenizer.apply_chat_template(first, add_generation_prompt=True)["input_ids"]
    )
    assert [o.prompt_token_ids for o in both] == [
        tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered
    ]
    assert tokenizer.decode(both[1].prompt_token_ids).endswith("Blue")  # left open for the answer
    assert tokenizer.decode(thinking_off.prompt_token_ids).endswith("</think>\n\n")
    assert (
        templated.prompt_token_ids
        == tokenizer("user: Hi!\nassistant:", add_special_tokens=False)["input_ids"]
    )
    assert one.outputs[0].token_ids


def test_async_streams_tokens_and_aborts_on_early_exit(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    engine = AsyncLLM(model=str(tiny_model_dir), dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128)

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        seen = []
        async for out in engine.generate(prompts[0], params):
            seen.append(out.outputs[0])
        assert [len(o.token_ids) for o in seen] == list(range(1, 9))
        assert all(b.text.startswith(a.text) for a, b in zip(seen, seen[1:], strict=False))
        assert seen[-1].finish_reason == "length"

        stream = engine.generate(prompts[1], SamplingParams(max_tokens=100), request_id="early")
        async for _ in stream:
            break
        await stream.aclose()
        with pytest.raises(RequestRejected):
            async for _ in engine.generate([1] * 200, params):
                pass
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_running == 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fp32_gemm", [False, True])
def test_bf16_follows_a_bf16_forward_on_the_same_gemm_path(
    tiny_model_dir: Path, prompts: list[list[int]], fp32_gemm: bool
) -> None:
    """Holds on any x86-64 CPU: the reference is a bf16 no-cache forward whose Linears take the
    engine's GEMM path (fp32 GEMMs, or torch's bf16 GEMM: native with AVX512-BF16/AMX, emulated
    without), so what is left to differ is attention and the batch's accumulation order."""
    reference = reference_greedy(tiny_model_dir, prompts, MAX_TOKENS, torch.bfloat16, fp32_gemm=fp32_gemm)
    llm = make_llm(tiny_model_dir, "vattention", dtype="bfloat16", fp32_gemm=fp32_gemm)
    assert llm.engine.runner.fp32_gemm is fp32_gemm
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.close()
    # A bf16 logit is exact to 8 bits: where the reference's top two logits are within four bf16
    # steps of each other (0.0625 at this model's top logits of ~4), a different accumulation
    # order (batched or not, the decode kernel, the GEMV kernel or oneDNN) may flip the choice.
    # Every other divergence is a bug. Two steps held on an AVX512-BF16 CPU; on an AVX2 one the
    # decode kernel's fp32 softmax path (as close to an fp32 reference as SDPA is: max error
    # 0.0078 against 0.0080 over 200 random bf16 inputs) flipped a choice 3 steps apart at 3.84,
    # where SDPA on the same slots did not.
    report = compare(reference, [o.outputs[0].token_ids for o in outputs], tie_bf16_ulps=4)
    assert report.passed, report.mismatches
    assert report.identical + len(report.near_ties) == len(prompts)


def test_oracle_counts_near_ties_apart_from_mismatches() -> None:
    reference = [
        ReferenceRun([1, 2, 3], margins=[5.0, 5e-5, 5.0], tops=[20.0, 20.0, 20.0]),
        ReferenceRun([1, 2, 3], margins=[5.0, 0.125, 5.0], tops=[20.0, 20.0, 20.0]),
        ReferenceRun([1, 2, 3], margins=[5.0, 5.0, 5.0], tops=[20.0, 20.0, 20.0]),
        ReferenceRun([1, 2], margins=[5.0, 5.0], tops=[20.0, 20.0]),
    ]
    outputs = [[1, 9, 9], [1, 9, 9], [1, 2, 9], [1, 2]]
    report = compare(reference, outputs)
    assert report.identical == 1
    assert [(d.prompt, d.step) for d in report.near_ties] == [(0, 1)]  # margin below 1e-4
    assert [(d.prompt, d.step, d.expected, d.got) for d in report.mismatches] == [(1, 1, 2, 9), (2, 2, 3, 9)]
    bf16 = compare(reference, outputs, tie_bf16_ulps=1)  # 0.125 is one bf16 step at 20.0
    assert [(d.prompt, d.step) for d in bf16.near_ties] == [(0, 1), (1, 1)]
    assert compare(reference, outputs, first=2).identical == 2


def test_async_engine_fails_the_requests_of_a_broken_step_and_keeps_serving(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """A step that raises outside the model forward (which is retried: tests/test_faults.py)
    fails the requests in flight and the engine serves the next ones."""
    engine = AsyncLLM(model=str(tiny_model_dir), dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128)
    schedule = engine.engine.scheduler.schedule
    calls = []

    def broken_once() -> object:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return schedule()

    engine.engine.scheduler.schedule = broken_once

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        failed = [out async for out in engine.generate(prompts[0], params)]
        assert failed[-1].finished and failed[-1].outputs[0].finish_reason == "error"
        assert "kernel exploded" in failed[-1].error
        served = [out async for out in engine.generate(prompts[0], params)]
        assert served[-1].outputs[0].finish_reason == "length"
        assert engine.stats().memory.used_bytes == 0  # the snapshot is taken before outputs go out

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        engine.shutdown()  # idempotent


def test_async_engine_thread_crash_fails_streams_and_refuses_new_ones(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    engine = AsyncLLM(model=str(tiny_model_dir), dtype="float32", kv_budget_bytes=1 << 22, max_model_len=128)

    def explode(*args: object) -> None:
        raise RuntimeError("inbox exploded")

    engine.engine.add_request = explode  # a bug outside any step kills the engine thread

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        with pytest.raises(EngineDead, match="inbox exploded"):
            await asyncio.wait_for(anext(engine.generate(prompts[0], params)), timeout=10)
        assert "inbox exploded" in engine.dead_reason
        with pytest.raises(EngineDead, match="inbox exploded"):
            await anext(engine.generate(prompts[0], params))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_mode", ["vattention", "paged"])
def test_a_reset_prefix_cache_makes_a_repeated_prompt_start_cold(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str
) -> None:
    llm = make_llm(tiny_model_dir, kv_mode)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    first, warm = llm.generate([prompts[0]], one)[0], llm.generate([prompts[0]], one)[0]
    forgotten = llm.reset_prefix_cache()
    cold = llm.generate([prompts[0]], one)[0]
    stats = llm.engine.stats()
    llm.close()
    assert first.num_cached_tokens == 0 and warm.num_cached_tokens >= 16
    assert forgotten >= 1 and cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert stats.memory.used_bytes == 0
