"""Every generation parameter over real HTTP with the `openai` client: each one the server
accepts changes the output the way its definition says, and each one it does not implement
is a 400 naming the field. One engine process over the tiny fp32 model serves the module."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, LiveServer, Served, live_server, start_engine

from vmkv import LLM, SamplingParams
from vmkv.engine import AsyncLLM, RequestRejected
from vmkv.engine.structured_output import check_structured
from vmkv.model.store import load_tokenizer
from vmkv.server import EngineClient, build_app
from vmkv.server.chat import template_message
from vmkv.server.chat_template import template_variables
from vmkv.server.protocol import ChatCompletionRequest
from vmkv.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from vmkv.server.tool_calls import answer_calls, forced_tool
from vmkv.server.tool_parser import HermesStream, parse_calls

PROMPT = [5, 6, 7, 8, 9, 10]  # token ids: the tiny model's text is noise anyway
EOS = 2  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    with live_server(tiny_model_dir, "paged") as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return served.openai()


def complete(client: openai.OpenAI, max_tokens: int = 12, **extra: object) -> openai.types.Completion:
    """A greedy completion of PROMPT; non-OpenAI fields travel in extra_body, as clients send them."""
    return client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, extra_body=extra
    )


def token_ids(served: Served, text: str) -> list[int]:
    return served.engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def single_token(served: Served, word: str) -> int:
    ids = token_ids(served, word)
    assert len(ids) == 1, (word, ids)
    return ids[0]


def assert_refused(client: openai.OpenAI, served: Served, extra: dict, param: str) -> None:
    """A 400 naming `param`, and the server stays healthy."""
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, **extra)
    assert caught.value.body["param"] == param, caught.value.body
    assert httpx.get(f"{served.url}/health").status_code == 200


# ------------------------------------------------------------------------------------ penalties
WORD = " the"  # one token of the tiny tokenizer


def test_frequency_penalty_grows_with_each_repeat_and_presence_penalty_does_not(
    client: openai.OpenAI, served: Served
) -> None:
    bias = {str(single_token(served, WORD)): 20.0}  # the model's logits span about -6..6: it always wins
    assert complete(client, logit_bias=bias).choices[0].text == WORD * 12
    # 20 - 2 x count: the word wins its first repeats, then falls behind
    text = complete(client, logit_bias=bias, frequency_penalty=2.0).choices[0].text
    assert text.startswith(WORD * 3) and text.count(WORD) < 12
    # presence subtracts once, however often the word came: 20 - 2 still wins every step
    assert complete(client, logit_bias=bias, presence_penalty=2.0).choices[0].text == WORD * 12
    assert complete(client, logit_bias=bias, presence_penalty=-2.0).choices[0].text == WORD * 12


def test_repetition_penalty_covers_prompt_and_output_tokens(client: openai.OpenAI, served: Served) -> None:
    token = single_token(served, WORD)
    bias = {str(token): 20.0}
    assert complete(client, logit_bias=bias).choices[0].text == WORD * 12
    # not in the prompt: the first token is still the word, its repeats are penalised away
    text = complete(client, logit_bias=bias, repetition_penalty=50.0).choices[0].text
    assert text.startswith(WORD) and text.count(WORD) == 1
    # in the prompt: its logit (at most 26) is divided by 50 from the first step on
    prompted = client.completions.create(
        model=MODEL,
        prompt=[*PROMPT, token],
        max_tokens=12,
        temperature=0.0,
        extra_body={"logit_bias": bias, "repetition_penalty": 50.0},
    )
    assert WORD not in prompted.choices[0].text


# ------------------------------------------------------------------- min_tokens, min_p, logit_bias
def test_min_tokens_holds_off_eos_and_stop_token_ids(client: openai.OpenAI, served: Served) -> None:
    eos_first = {str(EOS): 100.0}
    early = complete(client, logit_bias=eos_first)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = complete(client, logit_bias=eos_first, min_tokens=5)
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    # the case, over chat: min_tokens 30 of max_tokens 32 is honoured
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=32,
        temperature=0.0,
        extra_body={"min_tokens": 30, "logit_bias": eos_first},
    )
    assert chat.usage.completion_tokens == 31 and chat.choices[0].finish_reason == "stop"
    # a stop token id is held off too, and reported as the stop_reason when it ends the choice
    token = single_token(served, WORD)
    stop = {"logit_bias": {str(token): 100.0}, "stop_token_ids": [token]}
    first = complete(client, **stop).choices[0]
    assert (first.text, first.finish_reason, first.model_extra["stop_reason"]) == (WORD, "stop", token)
    later = complete(client, min_tokens=3, **stop)
    assert later.usage.completion_tokens == 4 and later.choices[0].model_extra["stop_reason"] == token
    assert WORD not in later.choices[0].text[: -len(WORD)]


def test_min_tokens_holds_off_stop_strings_in_both_front_doors(
    client: openai.OpenAI, served: Served, tiny_model_dir: Path
) -> None:
    """As vLLM: a stop string only ends a sample once min_tokens are out (the text before the
    match stays, the match is cut), whether the API process or the engine detokenizes."""
    token = single_token(served, WORD)
    forced = {"logit_bias": {str(token): 100.0}, "stop": [WORD]}  # " the the the ..."
    first = complete(client, **forced)
    assert (first.choices[0].text, first.usage.completion_tokens) == ("", 1)
    held = complete(client, min_tokens=3, **forced)
    assert (held.choices[0].text, held.usage.completion_tokens) == (WORD * 2, 3)
    assert held.choices[0].model_extra["stop_reason"] == WORD
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_mode="paged", max_model_len=64)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={token: 100.0}, stop=[WORD], min_tokens=3
    )
    (out,) = llm.generate([PROMPT], params)[0].outputs
    assert (out.text, len(out.token_ids), out.stop_reason) == (WORD * 2, 3, WORD)
    llm.engine.close()


def test_min_p_one_keeps_only_the_most_likely_token(client: openai.OpenAI) -> None:
    greedy = complete(client, max_tokens=16).choices[0].text
    sampled = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3, extra_body={"min_p": 1.0}
    )
    assert sampled.choices[0].text == greedy
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3)
    assert free.choices[0].text != greedy  # the random model's distribution is nearly flat


def test_logit_bias_shifts_the_listed_tokens(client: openai.OpenAI, served: Served) -> None:
    plain = complete(client, max_tokens=4).choices[0].text
    first = served.engine.tokenizer(plain, add_special_tokens=False)["input_ids"][0]
    banned = complete(client, max_tokens=4, logit_bias={str(first): -100.0}).choices[0].text
    assert not banned.startswith(served.engine.tokenizer.decode([first]))
    forced = complete(client, max_tokens=4, logit_bias={str(single_token(served, WORD)): 100.0})
    assert forced.choices[0].text == WORD * 4


def test_bad_words_never_appear_at_the_start_or_after_a_space(client: openai.OpenAI, served: Served) -> None:
    alone, spaced = single_token(served, "is"), single_token(served, " is")
    bias = {str(alone): 20.0, str(spaced): 20.0}

    def tokens(**extra: object) -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=0, extra_body=extra
        )
        return out.choices[0].logprobs.tokens

    assert set(tokens(logit_bias=bias)) <= {"is", " is"}
    assert not {"is", " is"} & set(tokens(logit_bias=bias, bad_words=["is"]))


def test_skip_special_tokens_false_keeps_them_in_the_text(client: openai.OpenAI) -> None:
    eos = {"logit_bias": {str(EOS): 100.0}, "ignore_eos": True}
    assert complete(client, max_tokens=2, **eos).choices[0].text == ""
    kept = complete(client, max_tokens=2, skip_special_tokens=False, **eos).choices[0].text
    assert kept == "<|im_end|>" * 2
    # a fast tokenizer never spaces special tokens, so vLLM's switch changes nothing
    unspaced = complete(
        client, max_tokens=2, skip_special_tokens=False, spaces_between_special_tokens=False, **eos
    )
    assert unspaced.choices[0].text == kept


# ------------------------------------------------------------------------- echo and stop_reason
def test_echo_returns_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.0)
    echoed = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.0, echo=True
    )
    assert echoed.choices[0].text == "Hello world" + plain.choices[0].text
    assert echoed.usage == plain.usage
    stream = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == echoed.choices[0].text


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(client: openai.OpenAI, served: Served) -> None:
    """As vLLM: the prompt's tokens and logprobs (none for the first token) come before the
    completion's, in one response and across a stream alike."""
    plain = complete(client, max_tokens=4, logprobs=2).choices[0]
    prompt = complete(client, max_tokens=4, prompt_logprobs=2).choices[0].prompt_logprobs
    echoed = complete(client, max_tokens=4, logprobs=2, echo=True).choices[0]
    lp = echoed.logprobs
    n = len(PROMPT)
    assert lp.tokens == [served.engine.tokenizer.decode([t]) for t in PROMPT] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, n):
        assert lp.token_logprobs[j] == pytest.approx(prompt[j][str(PROMPT[j])]["logprob"])
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs)
    assert lp.text_offset[n] == len(echoed.text) - len(plain.text)  # the completion starts after the echo
    assert lp.text_offset == sorted(lp.text_offset)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=2, echo=True, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    # the prompt's offsets, and where the completion starts; later offsets follow each stream's text
    assert [o for c in chunks for o in c.logprobs.text_offset][: n + 1] == lp.text_offset[: n + 1]


def test_a_stop_string_is_the_stop_reason(client: openai.OpenAI, served: Served) -> None:
    bias = {str(single_token(served, WORD)): 100.0}
    out = complete(client, logit_bias=bias, stop=["the the"]).choices[0]
    assert (out.text, out.finish_reason, out.model_extra["stop_reason"]) == (" ", "stop", "the the")


# ------------------------------------------------------------------- vLLM's request extensions
def test_include_stop_str_in_output_keeps_the_match_in_both_front_doors(
    client: openai.OpenAI, served: Served, tiny_model_dir: Path
) -> None:
    token = single_token(served, WORD)
    forced = {"logit_bias": {str(token): 100.0}, "stop": ["the the"]}  # " the the the ..."
    kept = complete(client, include_stop_str_in_output=True, **forced).choices[0]
    assert (kept.text, kept.finish_reason, kept.model_extra["stop_reason"]) == (" the the", "stop", "the the")
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        stream=True,
        extra_body={"include_stop_str_in_output": True, **forced},
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == " the the"
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_mode="paged", max_model_len=64)
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        logit_bias={token: 100.0},
        stop=["the the"],
        include_stop_str_in_output=True,
    )
    (out,) = llm.generate([PROMPT], params)[0].outputs
    assert (out.text, out.stop_reason) == (" the the", "the the")
    llm.engine.close()


def test_logprob_token_ids_give_the_listed_tokens_logprobs_in_place_of_the_top_ones(
    client: openai.OpenAI,
) -> None:
    def named(**extra: object) -> openai.types.Completion:
        return complete(client, max_tokens=4, return_tokens_as_token_ids=True, **extra)

    plain = named(logprobs=5).choices[0].logprobs
    chosen = int(plain.tokens[0].split(":")[1])
    listed = [int(name.split(":")[1]) for name in plain.top_logprobs[0] if name != plain.tokens[0]][:2]
    scored = named(logprobs=0, logprob_token_ids=listed).choices[0].logprobs
    assert scored.tokens == plain.tokens  # the same greedy answer
    for name, logprob in plain.top_logprobs[0].items():
        if int(name.split(":")[1]) in listed + [chosen]:
            assert scored.top_logprobs[0][name] == pytest.approx(logprob, abs=1e-4)
    assert all(
        set(top) == {f"token_id:{t}" for t in listed} | {token}
        for top, token in zip(scored.top_logprobs, scored.tokens, strict=True)
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        extra_body={"logprob_token_ids": listed, "return_tokens_as_token_ids": True},
    )
    for entry in chat.choices[0].logprobs.content:
        assert [top.token for top in entry.top_logprobs] == [f"token_id:{t}" for t in listed]
    for bad in ({"logprob_token_ids": [100000], "logprobs": 0}, {"logprob_token_ids": listed}):
        with pytest.raises(openai.BadRequestError) as caught:
            named(**bad)
        assert caught.value.body["param"] == "logprob_token_ids"


def test_beam_search_answers_the_engines_beams_whole_and_streamed(
    client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    """The engine process's beams reach the client as the in-process engine finds them: n
    choices best first, their cumulative logprobs, the same text whole and streamed."""
    extra = {"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, extra_body=extra)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=3, stream=True, extra_body=extra
    )
    streamed = {}
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_mode="vattention", max_model_len=64)
    params = SamplingParams(n=3, use_beam_search=True, length_penalty=0.5, max_tokens=8)
    (expected,) = llm.generate([PROMPT], params)
    llm.close()
    choices = sorted(whole.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in choices] == [o.token_ids for o in expected.outputs]
    assert [c.text for c in choices] == [o.text for o in expected.outputs]
    assert streamed == {c.index: c.text for c in choices}
    assert len({tuple(o.token_ids) for o in expected.outputs}) == 3


def test_allowed_token_ids_are_the_only_tokens_sampled(client: openai.OpenAI, served: Served) -> None:
    allowed = [single_token(served, WORD), single_token(served, " is")]
    for temperature in (0.0, 1.0):
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=temperature,
            seed=7,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
        )
        assert len(out.choices[0].model_extra["token_ids"]) == 16
        assert set(out.choices[0].model_extra["token_ids"]) <= set(allowed)


def test_return_token_ids_gives_the_prompts_and_each_choices_tokens(
    client: openai.OpenAI, served: Served
) -> None:
    token = single_token(served, WORD)
    forced = {"logit_bias": {str(token): 100.0}, "return_token_ids": True}
    choice = complete(client, max_tokens=5, **forced).choices[0]
    assert (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]) == (PROMPT, [token] * 5)
    assert "token_ids" not in complete(client, max_tokens=5).choices[0].model_extra
    stream = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True, extra_body=forced
        )
    )
    assert stream[0].choices[0].model_extra["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in chunk.choices[0].model_extra for chunk in stream[1:])
    assert [t for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]] == [token] * 5
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0.0, extra_body=forced
    )
    rendered = served.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert chat.model_extra["prompt_token_ids"] == token_ids(served, rendered)
    assert chat.choices[0].model_extra["token_ids"] == [token] * 5
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0.0, stream=True, extra_body=forced
        )
    )
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for chunk in chunks[1:] for t in chunk.choices[0].model_extra["token_ids"]] == [token] * 5


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client: openai.OpenAI) -> None:
    named = complete(client, max_tokens=4, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    lp, ids = named.choices[0].logprobs, named.choices[0].model_extra["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(name.startswith("token_id:") for top in lp.top_logprobs for name in top)
    plain = complete(client, max_tokens=4, logprobs=2).choices[0].logprobs
    assert lp.text_offset == plain.text_offset  # offsets still count characters of the text
    assert lp.token_logprobs == pytest.approx(plain.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [
        f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]
    ]
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens(client: openai.OpenAI) -> None:
    expected = complete(client).choices[0].text
    tail = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3, *PROMPT],
        max_tokens=12,
        temperature=0.0,
        extra_body={"truncate_prompt_tokens": 6},
    )
    assert (tail.choices[0].text, tail.usage.prompt_tokens) == (expected, len(PROMPT))
    head = client.completions.create(
        model=MODEL,
        prompt=[*PROMPT, 1, 2, 3],
        max_tokens=12,
        temperature=0.0,
        extra_body={"truncate_prompt_tokens": 6, "truncation_side": "right"},
    )
    assert (head.choices[0].text, head.usage.prompt_tokens) == (expected, len(PROMPT))
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"truncate_prompt_tokens": -1}
    )
    assert (whole.choices[0].text, whole.usage.prompt_tokens) == (expected, len(PROMPT))
    echoed = client.completions.create(
        model=MODEL,
        prompt="abcdef",
        max_tokens=2,
        temperature=0.0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 2},
    )
    assert echoed.usage.prompt_tokens == 2 and echoed.choices[0].text.startswith(
        "ef"
    )  # bytes: one token each
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert chat.usage.prompt_tokens == 3


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    def usages(**options: bool) -> list[openai.types.CompletionUsage | None]:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0.0,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
        return [chunk.usage for chunk in stream]

    every = usages(include_usage=True, continuous_usage_stats=True)
    assert all(u is not None and u.prompt_tokens == len(PROMPT) for u in every)
    counts = [u.completion_tokens for u in every]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in every)
    # as vLLM: without include_usage there is no usage at all
    assert usages(continuous_usage_stats=True) == [None] * len(usages(continuous_usage_stats=True))


def test_continue_final_message_and_echo_continue_an_assistant_message(
    client: openai.OpenAI, served: Served
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
    options = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    request = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0.0}
    out = client.chat.completions.create(**request, extra_body=options)
    rendered = served.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, continue_final_message=True
    )
    assert rendered.endswith("Hello the")  # left open: the answer continues the message
    assert out.model_extra["prompt_token_ids"] == token_ids(served, rendered)
    echoed = client.chat.completions.create(**request, extra_body={**options, "echo": True})
    assert echoed.choices[0].message.content == "Hello the" + out.choices[0].message.content
    stream = client.chat.completions.create(**request, stream=True, extra_body={**options, "echo": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == echoed.choices[0].message.content
    # echo repeats only an assistant's message: after a user's there is nothing to continue
    user_last = client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=4, temperature=0.0, extra_body={"echo": True}
    )
    plain = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, temperature=0.0)
    assert user_last.choices[0].message.content == plain.choices[0].message.content


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, served: Served) -> None:
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True},
    )
    rendered = served.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert out.model_extra["prompt_token_ids"] == token_ids(served, rendered)
    tokenized = httpx.post(
        f"{served.url}/tokenize",
        json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert tokenized["tokens"] == token_ids(served, rendered)


def test_reasoning_effort_switches_the_templates_thinking_as_vllm_does(
    client: openai.OpenAI, served: Served, default_model_dir: Path
) -> None:
    """ "none" renders enable_thinking false, any other effort true, unless chat_template_kwargs
    says; the Responses API's reasoning.effort is the same switch. A template that reads neither
    variable (SmolLM2's) makes the effort a 400: it would change nothing."""
    messages = [{"role": "user", "content": "hi"}]

    def prompt_ids(**extra: object) -> list[int]:
        request = {"model": MODEL, "messages": messages, "max_tokens": 1}
        out = client.chat.completions.create(**request, extra_body={"return_token_ids": True, **extra})
        return out.model_extra["prompt_token_ids"]

    tokenizer = served.engine.tokenizer
    closed, open_ = (
        token_ids(
            served, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        )
        for kw in ({"enable_thinking": False}, {})
    )
    assert closed != open_
    assert prompt_ids(reasoning_effort="none") == closed
    assert prompt_ids(reasoning_effort="high") == open_
    assert prompt_ids(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == closed
    answer = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "none"}
    )
    assert answer.usage.input_tokens == len(closed) and answer.reasoning.effort == "none"

    assert template_variables(load_tokenizer(default_model_dir).chat_template).isdisjoint(
        {"reasoning_effort", "enable_thinking"}
    )
    template = tokenizer.chat_template
    tokenizer.chat_template = load_tokenizer(default_model_dir).chat_template
    try:
        with LiveServer(build_app(served.engine, MODEL)) as server:
            plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                plain.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="low")
            assert caught.value.body["param"] == "reasoning_effort"
            with pytest.raises(openai.BadRequestError) as caught:
                plain.responses.create(model=MODEL, input="hi", reasoning={"effort": "low"})
            assert caught.value.body["param"] == "reasoning"
    finally:
        tokenizer.chat_template = template


def test_tools_reach_the_template_in_chat_and_tokenize_alike(client: openai.OpenAI, served: Served) -> None:
    rendered = served.engine.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "tools: weather forecast" in rendered  # the tiny template names them, as real ones describe them
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=2,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"return_token_ids": True},
    )
    assert out.model_extra["prompt_token_ids"] == token_ids(served, rendered)
    tokenized = httpx.post(f"{served.url}/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert tokenized["tokens"] == token_ids(served, rendered)


# ------------------------------------------------------------------------------ forced tool calls
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
DAYS = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Today's weather", "parameters": CITY},
    },
    {"type": "function", "function": {"name": "forecast", "parameters": DAYS}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_named_tool_choice_answers_one_call_with_valid_arguments(client: openai.OpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 40,
        "temperature": 0.0,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
    }
    answer = client.chat.completions.create(**request).choices[0]
    (call,) = answer.message.tool_calls
    assert (call.type, call.function.name, answer.message.content) == ("function", "weather", None)
    assert jsonschema_rs.validator_for(CITY).is_valid(json.loads(call.function.arguments))
    assert answer.finish_reason == "stop"  # OpenAI's for a named call
    deltas = [
        delta
        for chunk in client.chat.completions.create(**request, stream=True)
        if chunk.choices
        for delta in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas[0].id and (deltas[0].type, deltas[0].function.name) == ("function", "weather")
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_deprecated_functions_are_tools_answered_as_function_call(
    client: openai.OpenAI, served: Served
) -> None:
    """functions + function_call by name: the same call tools + a named tool_choice make, come
    back as message.function_call (delta.function_call pieces in a stream); an earlier call and
    its `function` answer make the prompt tool_calls and a tool message make."""
    functions = [tool["function"] for tool in TOOLS]
    named = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0.0)
    as_tools = client.chat.completions.create(
        **named, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}
    ).choices[0]
    legacy = client.chat.completions.create(
        **named, functions=functions, function_call={"name": "weather"}
    ).choices[0]
    assert legacy.message.tool_calls is None and legacy.message.content is None
    assert legacy.message.function_call.name == "weather"
    assert legacy.message.function_call.arguments == as_tools.message.tool_calls[0].function.arguments
    assert legacy.finish_reason == as_tools.finish_reason == "stop"  # a named call, as OpenAI's
    chunks = client.chat.completions.create(
        **named, functions=functions, function_call={"name": "weather"}, stream=True
    )
    pieces = [
        c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call
    ]
    assert pieces[0].name == "weather" and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == legacy.message.function_call.arguments

    arguments = legacy.message.function_call.arguments
    earlier = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": arguments}},
        {"role": "function", "name": "weather", "content": "Sunny"},
    ]
    spelled_as_tools = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=earlier, max_tokens=1, functions=functions, function_call="none"
    )
    tokenized = httpx.post(
        f"{served.url}/tokenize", json={"model": MODEL, "messages": spelled_as_tools, "tools": TOOLS}
    ).json()["count"]
    assert answer.usage.prompt_tokens == tokenized
    with pytest.raises(openai.BadRequestError) as caught:  # both spellings at once
        client.chat.completions.create(**named, functions=functions, tools=TOOLS, tool_choice="none")
    assert caught.value.body["param"] == "functions"


def test_required_tool_choice_answers_calls_of_the_given_tools(client: openai.OpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 60,
        "temperature": 0.0,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,  # exactly one call: the random model would not stop at one
    }
    answer = client.chat.completions.create(**request).choices[0]
    (call,) = answer.message.tool_calls
    schema = {"weather": CITY, "forecast": DAYS}[call.function.name]
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(call.function.arguments))
    assert (answer.finish_reason, answer.message.content) == ("tool_calls", None)
    chunks = [chunk for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices]
    (streamed,) = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_parse_from_the_constrained_array_and_its_schema_compiles() -> None:
    body = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required")
    spec = forced_tool(body)
    check_structured(spec)  # xgrammar compiles it
    answer = [
        {"name": "weather", "parameters": {"city": "Paris"}},
        {"name": "forecast", "parameters": {"days": 3}},
    ]
    assert jsonschema_rs.validator_for(json.loads(spec.spec)).is_valid(answer)
    assert not jsonschema_rs.validator_for(json.loads(spec.spec)).is_valid([])
    content, calls = answer_calls(body, json.dumps(answer), parse=False)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"}),
        ("forecast", {"days": 3}),
    ]
    assert len({c.id for c in calls}) == 2
    cut = '[{"name": "weather", "param'  # by max_tokens: content instead
    assert answer_calls(body, cut, parse=False) == (cut, None)


HERMES_ANSWERS = [
    'Let me check.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>{"name": "weather", "arguments": {"city": "Nice"}}</tool_call>\n'
    '<tool_call>{"name": "forecast", "arguments": {"days": 2}}</tool_call>',
    '<tool_call>{"name": "forecast", "arguments": {"days": 4}}',  # left open at the end
    "No call here, though <tool is a prefix of the tag.",
    "<tool_call>not json</tool_call>",
]


@pytest.mark.parametrize("text", HERMES_ANSWERS)
def test_hermes_calls_read_alike_whole_and_streamed_in_any_pieces(text: str) -> None:
    content, calls = parse_calls(text)
    whole = (content, [(c.function.name, c.function.arguments) for c in calls or []])
    if "<tool_call>" in text and "not json" not in text:
        assert calls and content == (text.split("<tool_call>")[0] or None)
    else:
        assert (content, calls) == (text, None)
    for size in range(1, len(text) + 1):
        stream, streamed, named = HermesStream(), "", []
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            delta = stream.delta(piece, finished=i == len(pieces) - 1)
            if delta is not None:
                streamed += delta.content or ""
                for call in delta.tool_calls or []:
                    assert call.index == len(named) and call.id and call.type == "function"
                    named.append((call.function.name, call.function.arguments))
        assert (streamed or None, named) == whole, size
        assert stream.called == bool(named)


def test_a_hermes_parser_serves_calls_the_model_chooses_to_make(served: Served) -> None:
    """tool_choice "auto" (or none) with --tool-call-parser hermes; the random model is held to
    a Hermes answer by a regex, as a model trained on the format would write it."""
    said = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    regex = re.escape(said)
    with LiveServer(build_app(served.engine, MODEL, tool_call_parser="hermes")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        request = {
            "model": MODEL,
            "messages": ASK,
            "max_tokens": 80,
            "temperature": 0.0,
            "tools": TOOLS,
            "extra_body": {"structured_outputs": {"regex": regex}},
        }
        answer = client.chat.completions.create(**request).choices[0]
        (call,) = answer.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("weather", {"city": "Paris"})
        assert (answer.message.content, answer.finish_reason) == ("Checking.", "tool_calls")
        chunks = [
            c for c in client.chat.completions.create(**request, tool_choice="auto", stream=True) if c.choices
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        (streamed,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert (text, streamed.function.name, streamed.function.arguments) == (
            "Checking.",
            "weather",
            call.function.arguments,
        )
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=TOOLS)
        assert plain.choices[0].message.tool_calls is None  # a free answer with no call is content


REASONING_ANSWERS = [
    ("<think>Paris is the capital.</think>It is Paris.", ("Paris is the capital.", "It is Paris.")),
    ("The template opened it.</think>Paris.", ("The template opened it.", "Paris.")),
    ("<think>cut short by max_tok", ("cut short by max_tok", None)),
    ("<think>all thought</think>", ("all thought", None)),
    ("No thinking, and a </thinking> word.", None),  # None: by parser, below
]


@pytest.mark.parametrize("parser", REASONING_PARSERS)
@pytest.mark.parametrize(("text", "expected"), REASONING_ANSWERS)
def test_reasoning_splits_alike_whole_and_streamed_in_any_pieces(
    parser: str, text: str, expected: tuple[str | None, str | None] | None
) -> None:
    whole = split_reasoning(text, parser)
    if parser == "qwen3" and not text.startswith("<think>"):
        assert whole == (None, text)  # qwen3: only an answer opening with the tag thinks
    elif expected is not None:
        assert whole == expected
    else:
        assert whole == (text, None)  # deepseek_r1: thinking until a </think> that never came
    for size in range(1, len(text) + 1):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            new_reasoning, new_content = stream.delta(piece, finished=i == len(pieces) - 1)
            reasoning, content = reasoning + new_reasoning, content + new_content
        assert (reasoning or None, content or None) == whole, size


def test_a_reasoning_parser_splits_thinking_answers_and_holds_constraints_until_it_ends(
    client: openai.OpenAI, served: Served
) -> None:
    """--reasoning-parser over the random model, which never writes a </think>: deepseek_r1 reads
    its free answer as thinking cut short, qwen3 (no opening tag) as content; a constraint waits
    for the end of the thinking, unless the prompt closed the thinking block (the tiny template
    does with enable_thinking=false), when the answer is not split and is constrained at once."""
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0.0)
    text = plain.choices[0].message.content
    tools = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    forced = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0.0, **tools}
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    for parser, split in [("deepseek_r1", (text, None)), ("qwen3", (None, text))]:
        with LiveServer(build_app(served.engine, MODEL, reasoning_parser=parser)) as server:
            reasoner = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            request = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0.0}
            message = reasoner.chat.completions.create(**request).choices[0].message
            assert (message.model_extra.get("reasoning"), message.content) == split
            deltas = [
                c.choices[0].delta
                for c in reasoner.chat.completions.create(**request, stream=True)
                if c.choices
            ]
            streamed = "".join(d.model_extra.get("reasoning") or "" for d in deltas) or None
            assert (streamed, "".join(d.content or "" for d in deltas) or None) == split
            answer = reasoner.chat.completions.create(**forced, extra_body=no_thinking).choices[0]
            assert answer.message.tool_calls and "reasoning" not in answer.message.model_extra
            if parser == "deepseek_r1":  # thinking: free until the </think> that never comes
                free = reasoner.chat.completions.create(**{**forced, "max_tokens": 8}).choices[0]
                assert (free.finish_reason, free.message.tool_calls, free.message.content) == (
                    "length",
                    None,
                    None,
                )
                assert free.message.model_extra["reasoning"]


def test_earlier_tool_calls_and_tool_answers_reach_the_template_as_templates_read_them(
    client: openai.OpenAI,
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    rendered = [template_message(m) for m in ChatCompletionRequest(messages=history).messages]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    answer = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=4, tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.content is not None and answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"}, "tools"),
    ],
)
def test_tool_requests_that_cannot_be_met_are_400s(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert caught.value.body["param"].startswith(param), caught.value.body


# --------------------------------------------------------------------------- structured outputs
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def test_json_schema_outputs_parse_and_validate(client: openai.OpenAI) -> None:
    validator = jsonschema_rs.validator_for(PERSON)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    plain = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=120,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"response_format": response_format},
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        temperature=0.0,
        response_format=response_format,
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        temperature=0.0,
        response_format=response_format,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    texts = [c.text for c in plain.choices] + [chat.choices[0].message.content, streamed]
    assert streamed == chat.choices[0].message.content
    assert len(set(texts[:3])) > 1  # the seeded samples differ, each valid
    for text in texts:
        validator.validate(json.loads(text))
    assert {c.finish_reason for c in plain.choices} | {chat.choices[0].finish_reason} == {"stop"}


def test_vllm_structured_output_fields(client: openai.OpenAI) -> None:
    def text(**extra: object) -> str:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=11, extra_body=extra
        ).choices[0]
        assert out.finish_reason == "stop"
        return out.text

    assert re.fullmatch(r"[a-c]{3}-\d{2}", text(structured_outputs={"regex": r"[a-c]{3}-\d{2}"}))
    assert re.fullmatch(r"x+y", text(guided_regex="x+y"))
    assert text(structured_outputs={"choice": ["yes", "no way"]}) in ("yes", "no way")
    assert text(guided_choice=['say "hi"', "a\\b"]) in ('say "hi"', "a\\b")
    assert text(guided_grammar='root ::= "(" [0-9]+ ")"').startswith("(")
    jsonschema_rs.validate(PERSON, json.loads(text(guided_json=PERSON, max_tokens=120)))
    assert isinstance(json.loads(text(structured_outputs={"json": json.dumps(PERSON)})), dict)
    obj = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=200,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}, "logit_bias": {"96": 5.0}},
    )
    assert isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_structured_outputs_are_400s_naming_the_field(
    client: openai.OpenAI, served: Served, extra: dict, param: str
) -> None:
    assert_refused(client, served, extra, param)


# ------------------------------------------------------------------------------ prompt_logprobs
def test_prompt_logprobs_come_in_vllms_shape(
    client: openai.OpenAI, served: Served, tiny_model_dir: Path
) -> None:
    """Each prompt token after the first gets its log-probability under the model, its rank and
    the top-k (vLLM's shape: token id -> logprob, rank, decoded_token), in a completion, its
    stream and a chat; the engine's own figures (checked against a forward pass in
    test_prompt_logprobs.py) arrive unchanged."""
    llm = LLM(str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=64)
    (engine_out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    llm.engine.close()
    body = complete(client, max_tokens=2, prompt_logprobs=2).model_dump()
    (choice,) = body["choices"]
    got = choice["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    for j in range(1, len(PROMPT)):
        top, rank = engine_out.prompt_logprobs[j]
        entries = got[j]
        own = entries[str(PROMPT[j])]
        assert own["logprob"] == pytest.approx(top[PROMPT[j]]) and own["rank"] == rank
        assert sorted(e["rank"] for e in entries.values())[:2] == [1, 2] and len(entries) <= 3
        assert all(e["decoded_token"] == served.engine.tokenizer.decode([int(t)]) for t, e in entries.items())
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0.0,
        stream=True,
        extra_body={"prompt_logprobs": 2},
    )
    streamed = [c.model_dump()["choices"][0].get("prompt_logprobs") for c in stream if c.choices]
    assert [p for p in streamed if p is not None] == [got]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 1},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )
    assert caught.value.body["param"] == "prompt_logprobs"


# ----------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "the end"}, "suffix"),
        ({"best_of": 2, "n": 3}, "best_of"),  # fewer candidates than choices
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["x"] * 129}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_json": ""}, "guided_json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "bad_words": ["x"]}, "bad_words"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"logprob_token_ids": [5]}, "logprob_token_ids"),
        ({"priority": 1}, "priority"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),  # over max_model_len (256)
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 13}, "min_tokens"),  # more than max_tokens (12)
        ({"min_tokens": -1}, "min_tokens"),
        # vLLM's fields for what this server does not have: refused, not ignored
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"ec_transfer_params": {}}, "ec_transfer_params"),
        ({"mm_payload": "none"}, "mm_payload"),
        ({"return_mm_kwargs": True}, "return_mm_kwargs"),
        ({"watermarking": True}, "watermarking"),
        ({"routed_experts_prompt_start": 3}, "routed_experts_prompt_start"),
        ({"return_token_offsets": True}, "return_token_offsets"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),  # a chat's
    ],
)
def test_completion_parameters_not_honoured_are_400s(
    client: openai.OpenAI, served: Served, extra: dict, param: str
) -> None:
    assert_refused(client, served, extra, param)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is on
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
        ({"media_io_kwargs": {"video": {}}}, "media_io_kwargs"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
    ],
)
def test_chat_parameters_not_honoured_are_400s(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra
        )
    assert caught.value.body["param"] == param, caught.value.body


def test_return_prompt_text_brings_the_rendered_conversation(client: openai.OpenAI, served: Served) -> None:
    rendered = served.engine.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    chat = dict(model=MODEL, messages=ASK, max_tokens=2, extra_body={"return_prompt_text": True})
    assert client.chat.completions.create(**chat).model_extra["prompt_text"] == rendered
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks[0].model_extra["prompt_text"] == rendered
    assert all("prompt_text" not in chunk.model_extra for chunk in chunks[1:])
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert "prompt_text" not in plain.model_extra  # only when asked


def test_a_session_id_is_written_in_the_request_log(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = start_engine(str(tiny_model_dir), "paged", in_process=True)
    try:
        with LiveServer(build_app(engine, MODEL, log_requests=True)) as server, caplog.at_level("INFO"):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "session_id": "chat-41"}
            assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    finally:
        engine.shutdown()
    assert any(" of session chat-41 finished" in record.getMessage() for record in caplog.records)


def test_a_callers_request_id_names_the_response_even_when_reused(
    client: openai.OpenAI, served: Served
) -> None:
    """vLLM's rule: the X-Request-Id header, else the body's request_id, after the endpoint's
    prefix; two requests in flight under one id are both answered (the engine's ids differ)."""
    chat = dict(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0.0, extra_body={"request_id": "trace-7"}
    )
    assert client.chat.completions.create(**chat).id == "chatcmpl-trace-7"
    streamed = {chunk.id for chunk in client.chat.completions.create(**chat, stream=True)}
    assert streamed == {"chatcmpl-trace-7"}
    assert complete(client, request_id="trace-7").id == "cmpl-trace-7"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "request_id": "same"}

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(2)])

    assert [r.json()["id"] for r in asyncio.run(twice())] == ["cmpl-same", "cmpl-same"]
    headed = httpx.post(
        f"{served.url}/v1/embeddings",
        json={"model": MODEL, "input": "x", "request_id": "body"},
        headers={"X-Request-Id": "header"},
    )
    assert headed.json()["id"] == "embd-header"
    too_long = httpx.post(f"{served.url}/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"


def test_a_stream_interval_sends_tokens_in_chunks_after_the_first(
    client: openai.OpenAI, served: Served
) -> None:
    """vLLM's stream_interval: the first token at once, then chunks of that many, the rest with
    the finish; the text is the same. The server's --stream-interval is a floor a request raises."""

    def chunk_sizes(client: openai.OpenAI, **extra: object) -> tuple[list[int], str]:
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True} | extra,
        )
        chunks = [c.choices[0] for c in stream if c.choices]
        return [len(c.model_extra["token_ids"]) for c in chunks if c.model_extra.get("token_ids")], "".join(
            c.text for c in chunks
        )

    whole = complete(client, max_tokens=10, ignore_eos=True).choices[0].text
    assert chunk_sizes(client) == ([1] * 10, whole)
    assert chunk_sizes(client, stream_interval=4) == ([1, 4, 4, 1], whole)
    with LiveServer(build_app(served.engine, MODEL, stream_interval=3)) as server:
        floor = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert chunk_sizes(floor, stream_interval=1) == ([1, 3, 3, 3], whole)
        assert chunk_sizes(floor, stream_interval=5) == ([1, 5, 4], whole)


def test_request_id_headers_answer_with_the_requests_id_or_a_new_one(served: Served) -> None:
    with LiveServer(build_app(served.engine, MODEL, request_id_headers=True)) as server:
        assert (
            httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc"}).headers["x-request-id"]
            == "abc"
        )
        made = httpx.post(
            f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        )
        assert len(made.headers["x-request-id"]) == 32
    assert "x-request-id" not in httpx.get(f"{served.url}/v1/models").headers  # off by default


def test_request_logging_logs_one_line_per_finished_request(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with LiveServer(build_app(served.engine, MODEL, log_requests=True)) as server, caplog.at_level("INFO"):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "request_id": "logged", "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "request cmpl-logged" in r.getMessage()]
    assert f"(length): {len(PROMPT)} prompt tokens, 3 generated, first token after" in line


def test_best_of_returns_the_n_candidates_of_the_highest_logprob_per_token(client: openai.OpenAI) -> None:
    """Seeded samples do not depend on the batch, so n = 4 shows the four candidates best_of = 4
    draws: the answer is the two of the highest mean token logprob, best first, and the usage
    counts all four."""
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
    candidates = client.completions.create(**seeded, n=4, logprobs=0).choices

    def mean(choice: openai.types.CompletionChoice) -> float:
        return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)

    best = [c.text for c in sorted(candidates, key=mean, reverse=True)[:2]]
    answer = client.completions.create(**seeded, n=2, best_of=4)
    assert [c.text for c in answer.choices] == best and [c.index for c in answer.choices] == [0, 1]
    assert all(c.logprobs is None for c in answer.choices)  # not asked for
    assert answer.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**seeded, n=2, best_of=4, stream=True)
    assert caught.value.body["param"] == "best_of"


def test_accepted_no_op_fields_change_nothing(client: openai.OpenAI) -> None:
    plain = complete(client).choices[0].text
    assert complete(client, user="someone", best_of=1).choices[0].text == plain
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    bare = client.chat.completions.create(**chat).choices[0].message.content
    tagged = client.chat.completions.create(
        **chat,
        user="someone",
        store=False,
        metadata={"k": "v"},
        parallel_tool_calls=False,
        modalities=["text"],
        verbosity="medium",
        prompt_cache_key="k",
        safety_identifier="someone",
    )
    assert tagged.choices[0].message.content == bare
    tools_off = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.0,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none",
    )
    assert tools_off.choices[0].message.content is not None


# ----------------------------------------------------------------------------- capacity and metrics
def test_n_beyond_the_caches_slots_is_refused_up_front(tiny_model_dir: Path) -> None:
    """Contiguous with two slots: n=4 is a 400 naming n (plain and streamed), RequestRejected in the
    library, before anything runs; n=2 still runs."""
    options = {
        "kv_mode": "contiguous",
        "dtype": "float32",
        "max_model_len": 256,
        "kv_budget_bytes": (32 << 20) // 128,
    }
    llm = LLM(str(tiny_model_dir), **options)
    assert llm.engine.info.kv_units == 2
    with pytest.raises(RequestRejected, match="n=4"):
        llm.generate([PROMPT], SamplingParams(n=4, max_tokens=4))
    assert len(llm.generate([PROMPT], SamplingParams(n=2, max_tokens=4))[0].outputs) == 2
    llm.engine.close()
    engine = EngineClient(AsyncLLM(model=str(tiny_model_dir), **options))
    with LiveServer(build_app(engine, MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=4, stream=stream)
            assert caught.value.body["param"] == "n"
        assert len(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2).choices) == 2
    engine.shutdown()


def test_priority_is_served_by_a_priority_server_and_refused_by_an_fcfs_one(
    client: openai.OpenAI, served: Served, tiny_model_dir: Path
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, priority=-5)
    assert caught.value.body["param"] == "priority" and "scheduling-policy" in caught.value.body["message"]
    expected = complete(client).choices[0].text
    options = {"kv_mode": "paged", "dtype": "float32", "max_model_len": 256, "scheduling_policy": "priority"}
    engine = EngineClient(AsyncLLM(model=str(tiny_model_dir), **options))
    with LiveServer(build_app(engine, MODEL)) as server:
        prioritized = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert complete(prioritized, priority=-5).choices[0].text == expected
        with pytest.raises(openai.BadRequestError) as caught:
            complete(prioritized, priority=2**63)
        assert caught.value.body["param"] == "priority"
    engine.shutdown()


VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
}


def scrape(served: Served) -> dict[str, object]:
    return {
        family.name: family
        for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
    }


def test_metrics_carry_vllms_names_with_model_name(client: openai.OpenAI, served: Served) -> None:
    complete(client, max_tokens=2)
    families = scrape(served)
    for name, kind in VLLM_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert all(sample.labels.get("model_name") == MODEL for sample in families[name].samples), name


def test_metrics_count_successes_by_finished_reason(client: openai.OpenAI, served: Served) -> None:
    def successes() -> dict[str, float]:
        family = scrape(served)["vllm:request_success"]
        assert family.type == "counter"
        assert all(s.labels["model_name"] == MODEL for s in family.samples)
        return {s.labels["finished_reason"]: s.value for s in family.samples}

    before = successes()
    complete(client, max_tokens=2, n=2)  # two samples, both cut by max_tokens
    complete(client, logit_bias={str(EOS): 100.0})  # ends at end-of-sequence
    after = successes()
    assert after["length"] - before["length"] == 2
    assert after["stop"] - before["stop"] == 1
    assert after["abort"] == before["abort"] and after["error"] == before["error"]


# ------------------------------------------------------------------------------ responses API
INSTRUCTIONS = "Answer briefly, in one sentence, and do not repeat the question back to the user."
QUESTION = "Which layout keeps each sequence's keys and values contiguous in virtual memory?"


def as_chat(**extra: object) -> dict:
    return dict(
        model=MODEL,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        temperature=0.0,
        **extra,
    )


def test_a_response_answers_as_the_same_chat_does_whole_and_streamed(client: openai.OpenAI) -> None:
    """instructions are the system message, max_output_tokens the budget; a cut answer is
    incomplete; the stream's events come in the API's order with their sequence numbers and
    build the same text; usage counts the cached prompt tokens of a request sent again."""
    chat = client.chat.completions.create(**as_chat(max_tokens=8))
    request = dict(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8, temperature=0.0
    )
    first, again = client.responses.create(**request), client.responses.create(**request)
    assert first.output_text == again.output_text == chat.choices[0].message.content
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    (message,) = first.output
    assert message.type == "message" and message.status == "incomplete" and message.role == "assistant"
    assert first.usage.input_tokens == chat.usage.prompt_tokens and first.usage.output_tokens == 8
    assert first.usage.total_tokens == first.usage.input_tokens + 8
    assert first.usage.output_tokens_details.reasoning_tokens == 0
    cached = again.usage.input_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.input_tokens  # whole blocks
    # chat and completions report them the same way
    assert (
        client.chat.completions.create(**as_chat(max_tokens=1)).usage.prompt_tokens_details.cached_tokens
        == cached
    )

    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == first.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 8


def test_a_response_takes_a_conversation_a_schema_and_returns_logprobs(client: openai.OpenAI) -> None:
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a layout."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paged."}]},
        {"role": "user", "content": "Another one?"},
    ]
    rendered = [
        {"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in conversation[:2]
    ]
    chat = client.chat.completions.create(
        model=MODEL, messages=[*rendered, conversation[2]], max_tokens=6, temperature=0.0
    )
    response = client.responses.create(
        model=MODEL,
        input=conversation,
        max_output_tokens=6,
        temperature=0.0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert response.output_text == chat.choices[0].message.content
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 6 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == response.output_text

    shaped = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        max_output_tokens=120,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(shaped.output_text))
    assert shaped.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"prompt": {"id": "pmpt_123"}}, "prompt"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"max_output_tokens": 10_000}, "max_output_tokens"),
        ({"input": "x" * 100_000}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "nonsense"}}}}, "text"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"extra_body": {"enable_response_messages": True}}, "enable_response_messages"),
        ({"extra_body": {"previous_input_messages": []}}, "previous_input_messages"),
        ({"extra_body": {"kv_transfer_params": {}}}, "kv_transfer_params"),
        ({"extra_body": {"mm_processor_kwargs": {"x": 1}}}, "mm_processor_kwargs"),
        ({"extra_body": {"watermarking": True}}, "watermarking"),
    ],
)
def test_response_fields_not_honoured_are_400s(
    client: openai.OpenAI, served: Served, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": MODEL, "input": "hi"} | extra)
    assert caught.value.body["param"] == param, caught.value.body
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_a_responses_request_id_names_it_once_among_the_kept(client: openai.OpenAI) -> None:
    kept = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, service_tier="default", extra_body={"request_id": "r-9"}
    )
    assert kept.id == "resp-r-9" and client.responses.retrieve("resp-r-9").id == "resp-r-9"
    with pytest.raises(openai.BadRequestError) as caught:  # it would replace the kept one
        client.responses.create(
            model=MODEL, input="hi", max_output_tokens=2, extra_body={"request_id": "r-9"}
        )
    assert caught.value.body["param"] == "request_id"
    unkept = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, store=False, extra_body={"request_id": "r-9"}
    )
    assert unkept.id == "resp-r-9"  # not kept: nothing to collide with
    client.responses.delete("resp-r-9")


def test_a_reasoning_parser_puts_the_thinking_in_a_reasoning_item(served: Served) -> None:
    """deepseek_r1 over the random model, which never closes its thinking: the answer is all
    reasoning (cut short), whole and streamed, and the message is empty."""
    with LiveServer(build_app(served.engine, MODEL, reasoning_parser="deepseek_r1")) as server:
        reasoner = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        request = dict(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0.0)
        whole = reasoner.responses.create(**request)
        events = list(reasoner.responses.create(**request, stream=True))
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert message.type == "message" and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 8
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_a_response_takes_vllms_sampling_fields_as_chat_does(client: openai.OpenAI) -> None:
    """Seeded sampling through every extension that changes the draw: the response's text is the
    chat's with the same fields (and not the chat's without them), stop strings cut it alike,
    and a vLLM structured output constrains it."""
    sampling = {
        "seed": 7,
        "top_k": 20,
        "min_p": 0.02,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "logit_bias": {"5": 5.0},
    }
    request = dict(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12, temperature=1.0
    )

    def chat_text(**extra: object) -> str:
        body = as_chat(max_tokens=12) | {"temperature": 1.0}
        return client.chat.completions.create(**body, extra_body=extra).choices[0].message.content

    drawn = chat_text(**sampling)
    assert client.responses.create(**request, extra_body=sampling).output_text == drawn
    assert chat_text(seed=7) != drawn
    stop = {"stop": [drawn[len(drawn) // 2 :][:2]], "include_stop_str_in_output": True}
    cut = client.responses.create(**request, extra_body=sampling | stop).output_text
    assert cut == chat_text(**sampling, **stop) and len(cut) < len(drawn)
    choice = {"structured_outputs": {"choice": ["paged", "vattention"]}}
    assert client.responses.create(**request, extra_body=choice).output_text in ("paged", "vattention")
    with pytest.raises(openai.BadRequestError) as caught:  # under the default fcfs policy
        client.responses.create(**request, extra_body={"priority": 1})
    assert caught.value.body["param"] == "priority"


def test_include_reasoning_false_leaves_the_thinking_out(served: Served) -> None:
    """deepseek_r1 over the random model reads its whole answer as thinking: without it, chat's
    message and deltas carry no reasoning and the response no reasoning item."""
    with LiveServer(build_app(served.engine, MODEL, reasoning_parser="deepseek_r1")) as server:
        reasoner = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        hidden = {"include_reasoning": False}
        chat = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0.0)
        shown = reasoner.chat.completions.create(**chat).choices[0].message
        assert shown.model_extra.get("reasoning")
        message = reasoner.chat.completions.create(**chat, extra_body=hidden).choices[0].message
        assert message.content is None and "reasoning" not in message.model_extra
        chunks = list(reasoner.chat.completions.create(**chat, stream=True, extra_body=hidden))
        assert not any(c.choices and c.choices[0].delta.model_extra.get("reasoning") for c in chunks)
        request = dict(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0.0, extra_body=hidden)
        assert [item.type for item in reasoner.responses.create(**request).output] == ["message"]
        events = list(reasoner.responses.create(**request, stream=True))
        assert not any(e.type.startswith("response.reasoning") for e in events)
        assert [item.type for item in events[-1].response.output] == ["message"]
        assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 8  # still counted


def test_repetition_detection_ends_a_loop_with_vllms_reason(client: openai.OpenAI, served: Served) -> None:
    """One allowed token loops at once; the loop ends after min_count repeats, counted in the
    metrics under its own finish reason, and a detection that cannot work is a 400."""
    detection = {"max_pattern_size": 3, "min_count": 4}
    looped = complete(client, max_tokens=12, allowed_token_ids=[7], repetition_detection=detection)
    (choice,) = looped.choices
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("repetition", "repetition_detected")
    assert looped.usage.completion_tokens == 4
    off = complete(client, max_tokens=12, allowed_token_ids=[7], repetition_detection={"max_pattern_size": 0})
    assert off.choices[0].finish_reason == "length"
    metrics = httpx.get(f"{served.url}/metrics").text
    assert re.search(r'vllm:request_success_total\{[^}]*finished_reason="repetition"\} [1-9]', metrics)
    assert_refused(
        client,
        served,
        {"repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
        "repetition_detection",
    )


def test_a_thinking_token_budget_ends_the_thinking_and_the_answer_follows(
    client: openai.OpenAI, served: Served
) -> None:
    """The random model never closes its thinking (deepseek_r1 reads it all as reasoning); with
    a budget of 3 its end is forced after three tokens and the rest is the answer."""
    budget = {"thinking_token_budget": 3}
    chat = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0.0)
    with pytest.raises(openai.BadRequestError) as caught:  # no reasoning parser: no known end
        client.chat.completions.create(**chat, extra_body=budget)
    assert caught.value.body["param"] == "thinking_token_budget"
    with LiveServer(build_app(served.engine, MODEL, reasoning_parser="deepseek_r1")) as server:
        reasoner = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        free = reasoner.chat.completions.create(**chat).choices[0].message
        assert free.content is None and free.model_extra["reasoning"]
        capped = reasoner.chat.completions.create(**chat, extra_body=budget)
        message = capped.choices[0].message
        assert message.content and message.model_extra["reasoning"]
        ids = reasoner.chat.completions.create(**chat, extra_body=budget | {"return_token_ids": True})
        end = token_ids(served, "</think>")
        assert ids.choices[0].model_extra["token_ids"][3 : 3 + len(end)] == end
        # a forced call's constraint holds from the forced end of the thinking
        tools = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        called = reasoner.chat.completions.create(**chat | {"max_tokens": 60}, **tools, extra_body=budget)
        assert called.choices[0].message.tool_calls and called.choices[0].message.model_extra["reasoning"]


def test_chat_add_special_tokens_puts_the_tokenizers_own_around_the_rendered_chat(
    client: openai.OpenAI, served: Served
) -> None:
    request = dict(model=MODEL, messages=ASK, max_tokens=1, temperature=0.0)
    plain = client.chat.completions.create(**request).usage.prompt_tokens
    added = client.chat.completions.create(
        **request, extra_body={"add_special_tokens": True}
    ).usage.prompt_tokens
    tokenizer = served.engine.tokenizer
    extra = len(tokenizer("x")["input_ids"]) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    assert added == plain + extra


def test_documents_reach_a_template_that_reads_them_and_are_a_400_for_one_that_does_not(
    client: openai.OpenAI, served: Served
) -> None:
    documents = [{"title": "Layouts", "text": "vattention keeps KV contiguous."}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"documents": documents}
        )
    assert caught.value.body["param"] == "documents"
    reads_documents = (
        "{% for d in documents or [] %}{{ d['title'] + ': ' + d['text'] + '\\n' }}{% endfor %}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant:"
    )
    with LiveServer(build_app(served.engine, MODEL, chat_template=reads_documents)) as server:
        retriever = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = retriever.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"documents": documents}
        )
    rendered = "Layouts: vattention keeps KV contiguous.\nuser: Weather in Paris?\nassistant:"
    assert answer.usage.prompt_tokens == len(token_ids(served, rendered))


RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the API's flat shape


def test_a_response_makes_the_calls_chat_makes_whole_and_streamed(client: openai.OpenAI) -> None:
    """Function tools with a forcing tool_choice: function_call items whose arguments are chat's,
    streamed as argument deltas; earlier calls and their outputs in the input render as chat's
    assistant tool_calls and tool messages."""
    request = {
        "model": MODEL,
        "input": ASK[0]["content"],
        "tools": RESPONSE_TOOLS,
        "tool_choice": {"type": "function", "name": "weather"},
        "max_output_tokens": 60,
        "temperature": 0.0,
    }
    whole = client.responses.create(**request)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=60,
        temperature=0.0,
    )
    (call,) = whole.output
    assert (call.type, call.name) == ("function_call", "weather") and call.call_id
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert jsonschema_rs.validator_for(CITY).is_valid(json.loads(call.arguments))

    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == events[-3].arguments == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))

    required = client.responses.create(**request | {"tool_choice": "required", "parallel_tool_calls": False})
    assert [(o.type, o.name in ("weather", "forecast")) for o in required.output] == [("function_call", True)]

    arguments = json.dumps({"city": "Paris"})
    history = [
        *ASK,
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    answered = client.responses.create(
        model=MODEL, input=history, tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=1
    )
    chat_call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat_answered = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert answered.usage.input_tokens == chat_answered.usage.prompt_tokens
    assert answered.output[0].type == "message"

    # the forced call continued by its id: the kept call is the conversation's, as if sent whole
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = dict(tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=1)
    continued = client.responses.create(model=MODEL, previous_response_id=whole.id, input=[output], **after)
    sent_call = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": "weather",
        "arguments": call.arguments,
    }
    resent = client.responses.create(model=MODEL, input=[*ASK, sent_call, output], **after)
    assert continued.usage.input_tokens == resent.usage.input_tokens
