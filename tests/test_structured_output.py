"""Structured outputs in the engine: grammars compile off the step while their request waits,
compiled grammars are cached by spec, each sample keeps its own matcher, and a grammar that
completes ends its sample."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema_rs
import pytest

from vmkv import LLM, SamplingParams
from vmkv.engine.sampling_params import StructuredOutput
from vmkv.engine.structured_output import GrammarCompiler, check_structured

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 6, 7, 8]
CHOICE = StructuredOutput("choice", choices=("red", "green", "blue"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(
        str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=256, kv_budget_bytes=1 << 22
    )
    yield llm
    llm.engine.close()


def test_each_sample_follows_the_grammar_with_its_own_matcher(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
    }
    params = SamplingParams(
        n=4, temperature=1.0, seed=2, max_tokens=60, structured=StructuredOutput("json", json.dumps(schema))
    )
    outputs = llm.generate([PROMPT, PROMPT[:2]], params)
    texts = [sample.text for out in outputs for sample in out.outputs]
    for text in texts:
        jsonschema_rs.validate(schema, json.loads(text))
    assert len(set(texts)) > 1
    assert {sample.finish_reason for out in outputs for sample in out.outputs} == {"stop"}


def test_a_completed_grammar_stops_the_sample_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=50, structured=CHOICE)
    )
    sample = out[0].outputs[0]
    assert sample.text in CHOICE.choices and sample.finish_reason == "stop"
    assert len(sample.token_ids) < 50


def test_end_of_thinking_leaves_the_output_free_until_its_tokens_then_constrains_it(llm: LLM) -> None:
    """A reasoning model thinks freely, then answers to the constraint: the marker here is the
    free answer's own third token, so the first three tokens are the free ones and the rest
    (by then in the middle of arbitrary text) is a choice, with n = 2 samples alike."""
    free = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].token_ids
    params = SamplingParams(temperature=0.0, n=2, max_tokens=40, structured=CHOICE, end_of_thinking=free[2:3])
    for sample in llm.generate(PROMPT, params)[0].outputs:
        assert sample.token_ids[:3] == free[:3]
        answer = llm.tokenizer.decode(sample.token_ids[3:], skip_special_tokens=True)
        assert answer in CHOICE.choices and sample.finish_reason == "stop"
    whole = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, structured=CHOICE))[
        0
    ].outputs[0]
    assert whole.text in CHOICE.choices  # without it, constrained from the first token
    with pytest.raises(ValueError, match="end_of_thinking"):
        SamplingParams(end_of_thinking=[5])  # nothing to end


def test_a_spent_thinking_budget_forces_the_end_of_thinking_then_frees_the_answer(llm: LLM) -> None:
    """Two tokens the free answer never writes stand for the end of thinking: after the budget
    they are forced, one a step, for each of n samples; an end the model writes itself before
    the budget forces nothing; a budget of 0 starts the output with the end."""
    free = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids
    end = [t for t in range(3, 400) if t not in free][:2]
    params = SamplingParams(temperature=0.0, n=2, max_tokens=12, end_of_thinking=end, thinking_budget=4)
    for sample in llm.generate(PROMPT, params)[0].outputs:
        assert sample.token_ids[:4] == free[:4] and sample.token_ids[4:6] == end
    unspent = SamplingParams(temperature=0.0, max_tokens=12, end_of_thinking=free[1:2], thinking_budget=6)
    assert llm.generate(PROMPT, unspent)[0].outputs[0].token_ids == free
    at_once = SamplingParams(temperature=0.0, max_tokens=4, end_of_thinking=end, thinking_budget=0)
    assert llm.generate(PROMPT, at_once)[0].outputs[0].token_ids[:2] == end
    with pytest.raises(ValueError, match="thinking_budget needs end_of_thinking"):
        SamplingParams(thinking_budget=4)


def test_a_row_left_with_no_allowed_token_ends_instead_of_failing_the_step(llm: LLM) -> None:
    # the choice completes long before min_tokens, which masks the only token the grammar still allows
    held = SamplingParams(temperature=1.0, seed=4, min_tokens=10, max_tokens=20, structured=CHOICE)
    nothing = SamplingParams(
        temperature=1.0, max_tokens=5, structured=StructuredOutput("grammar", "root ::= root")
    )
    plain = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([PROMPT] * 3, [held, nothing, plain])
    assert outputs[0].outputs[0].text in CHOICE.choices and outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[1].outputs[0].text == "" and outputs[1].outputs[0].finish_reason == "stop"
    assert len(outputs[2].outputs[0].token_ids) == 5  # the step went on for its neighbours


def test_a_waiting_grammar_does_not_hold_up_other_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    release = threading.Event()
    compile_for_real = GrammarCompiler._compile

    def slow_compile(self: GrammarCompiler, spec: StructuredOutput) -> object:
        release.wait(timeout=30)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    regex = StructuredOutput("regex", r"[0-9]{4}")  # not compiled yet by any test
    engine.add_request("constrained", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, structured=regex))
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.stats().num_waiting == 2
    finished = {}
    while "plain" not in finished:
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert "constrained" not in finished and engine.stats().num_waiting == 1
    engine.add_request(
        "aborted", PROMPT, SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "x+"))
    )
    assert engine.abort_request("aborted").outputs[0].finish_reason == "abort"
    release.set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert "aborted" not in finished
    text = finished["constrained"].outputs[0].text
    assert len(text) == 4 and text.isdigit()


def test_compiled_grammars_are_cached_by_spec(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    compile_for_real = GrammarCompiler._compile

    def counting(self: GrammarCompiler, spec: StructuredOutput) -> object:
        calls.append(spec)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", counting)
    grammar = StructuredOutput("grammar", 'root ::= "(" [a-z]+ ")"')
    for seed in range(3):
        out = llm.generate(PROMPT, SamplingParams(seed=seed, max_tokens=30, structured=grammar))
        assert out[0].outputs[0].text.startswith("(")
    assert calls == [grammar]


def test_a_grammar_that_does_not_compile_fails_only_its_request(llm: LLM) -> None:
    bad, good = StructuredOutput("regex", "[a-"), SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate([PROMPT, PROMPT], [SamplingParams(structured=bad), good])
    assert outputs[0].outputs[0].finish_reason == "error" and "compile" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="Unclosed"):
        check_structured(bad)  # what the API process runs first, for a 400
