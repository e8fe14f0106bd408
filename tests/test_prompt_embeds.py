"""Prompts given as embeddings: the model's own embeddings of a prompt's tokens generate what
the tokens do, in every layout, chunked and preempted, eager and compiled, offline and served
(across the engine process's boundary); only equal embeddings share cached KV; and what cannot
hold for an embedded prompt is refused by name, a 400 over HTTP."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_engine import MAX_TOKENS, SMALL_BUDGET, make_llm
from test_server import MODEL, LiveServer, Served, start_engine
from transformers import AutoModelForCausalLM

from vmkv import LLM, SamplingParams
from vmkv.engine import RequestRejected
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids
from vmkv.engine.prompt_embeds import EmbedsPayload
from vmkv.model.store import load_tokenizer
from vmkv.server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:6])


def embedded(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The model's own embeddings of the prompt's tokens."""
    with torch.inference_mode():
        return llm.engine.runner.model.get_input_embeddings()(torch.tensor(prompt)).clone()


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("kv_mode", ["vattention", "paged", "contiguous"])
def test_embeddings_of_the_prompts_tokens_generate_what_the_tokens_do(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str, preemption_mode: str
) -> None:
    """Chunked prefill (chunks shorter than the prompts) and preemption under a small budget,
    prompts as ids and as embeddings mixed in one batch."""
    llm = make_llm(
        tiny_model_dir,
        kv_mode,
        kv_budget_bytes=SMALL_BUDGET if kv_mode != "contiguous" else 1 << 17,
        preemption_mode=preemption_mode,
        max_num_batched_tokens=32,
    )
    as_ids = tokens(llm.generate(prompts, GREEDY))
    mixed = [embedded(llm, p) if i % 2 else p for i, p in enumerate(prompts)]
    as_embeds = tokens(llm.generate(mixed, GREEDY))
    stats = llm.engine.stats()
    llm.close()
    assert as_embeds == as_ids
    assert max(len(p) for p in prompts) > 32
    assert kv_mode == "contiguous" or stats.num_preemptions > 0
    assert stats.memory.used_bytes == 0


def test_compiled_and_eager_agree_on_an_embedded_prompt(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    llm = make_llm(tiny_model_dir, "paged", compile_model=True)
    outputs = llm.generate([prompts[0], {"prompt_embeds": embedded(llm, prompts[0])}], GREEDY)
    llm.close()
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_beams_from_embeddings_read_as_the_beams_from_their_tokens(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """Beam search decodes its answer whole at the end, with the same (empty) prompt context
    as every other detokenizer of an embedded prompt: same beams, same text."""
    llm = make_llm(tiny_model_dir, "paged")
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    from_ids, from_embeds = llm.generate([prompts[0], embedded(llm, prompts[0])], beams)
    llm.close()
    assert [(o.token_ids, o.text) for o in from_embeds.outputs] == [
        (o.token_ids, o.text) for o in from_ids.outputs
    ]
    assert all(o.text for o in from_ids.outputs)


@pytest.mark.parametrize("kv_mode", ["vattention", "paged"])
def test_only_equal_embeddings_share_cached_kv(
    tiny_model_dir: Path, prompts: list[list[int]], kv_mode: str
) -> None:
    llm = make_llm(tiny_model_dir, kv_mode)
    embeds = embedded(llm, prompts[0])
    one = SamplingParams(temperature=0.0, max_tokens=1)
    first, again = llm.generate([embeds], one)[0], llm.generate([embeds.clone()], one)[0]
    other = llm.generate([embeds + 0.01], one)[0]
    placeholders = llm.generate([[0] * len(embeds)], one)[0]
    llm.close()
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert other.num_cached_tokens == 0 and placeholders.num_cached_tokens == 0
    assert len(again.prompt_token_ids) == len(embeds)


@pytest.mark.parametrize(
    ("embeds", "params", "param", "match"),
    [
        (torch.zeros(4), GREEDY, "prompt_embeds", "shape"),
        (torch.zeros(4, 7), GREEDY, "prompt_embeds", "shape"),
        (torch.zeros(0, 64), GREEDY, "prompt_embeds", "shape"),
        (torch.zeros(4, 64, dtype=torch.int32), GREEDY, "prompt_embeds", "floating"),
        (torch.full((4, 64), float("nan")), GREEDY, "prompt_embeds", "finite"),
        (torch.zeros(4, 64), SamplingParams(repetition_penalty=1.2), "repetition_penalty", "tokens"),
        (torch.zeros(4, 64), SamplingParams(prompt_logprobs=1), "prompt_logprobs", "tokens"),
        (torch.zeros(200, 64), GREEDY, None, "max_model_len"),
    ],
)
def test_what_an_embedded_prompt_cannot_be_is_refused_by_name(
    tiny_model_dir: Path, embeds: torch.Tensor, params: SamplingParams, param: str | None, match: str
) -> None:
    llm = make_llm(tiny_model_dir)
    assert llm.engine.info.hidden_size == 64
    try:
        with pytest.raises(RequestRejected, match=match) as caught:
            llm.engine.add_request("r", embeds, params)
        assert caught.value.param == param
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()


def test_embeddings_cross_processes_bit_for_bit() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        embeds = torch.randn(5, 8).to(dtype)
        assert torch.equal(EmbedsPayload.of(embeds).tensor(), embeds)


# ------------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    """The engine in its own process: embeddings cross the process boundary."""
    engine = start_engine(str(tiny_model_dir), "vattention")
    with LiveServer(build_app(engine, MODEL, enable_prompt_embeds=True)) as server:
        yield Served(server.url, engine, "vattention")
    engine.shutdown()


@pytest.fixture(scope="module")
def embed(tiny_model_dir: Path) -> Callable[[list[int]], str]:
    """A prompt's embeddings in vLLM's wire format: base64 of the torch.save'd tensor."""
    table = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_input_embeddings()

    def encode(prompt: list[int]) -> str:
        with torch.no_grad():
            return to_base64(table(torch.tensor(prompt)))

    return encode


def to_base64(value: object) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def complete(client: openai.OpenAI, **request: object) -> openai.types.Completion:
    return client.completions.create(model=MODEL, max_tokens=8, temperature=0.0, **request)


def test_a_served_completion_from_embeddings_is_the_completion_from_their_tokens(
    served: Served, embed: Callable[[list[int]], str], prompts: list[list[int]]
) -> None:
    client = served.openai()
    first, second = prompts[0], prompts[1]
    from_ids = [complete(client, prompt=p).choices[0].text for p in (first, second)]
    both = complete(
        client,
        prompt="",
        extra_body={"prompt_embeds": [embed(first), embed(second)], "return_token_ids": True},
    )
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == from_ids
    assert both.usage.prompt_tokens == len(first) + len(second)
    for choice in both.choices:  # an embedded prompt has no tokens to return; its answer has
        assert "prompt_token_ids" not in choice.model_extra and len(choice.model_extra["token_ids"]) == 8
    streamed = complete(client, prompt="", stream=True, extra_body={"prompt_embeds": embed(first)})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == from_ids[0]
    cut = complete(
        client, prompt="", extra_body={"prompt_embeds": embed(first), "truncate_prompt_tokens": 10}
    )
    assert cut.choices[0].text == complete(client, prompt=first[-10:]).choices[0].text
    assert cut.usage.prompt_tokens == 10
    served.wait_idle()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds"),
        ({"prompt_embeds": to_base64({"weights": 1})}, "prompt_embeds"),
        ({"prompt_embeds": to_base64(torch.zeros(3, 7))}, "prompt_embeds"),
        ({"prompt_embeds": to_base64(torch.full((3, 64), float("inf")))}, "prompt_embeds"),
        ({"prompt_embeds": []}, "prompt_embeds"),
        ({"prompt_embeds": to_base64(torch.zeros(3, 64)), "echo": True}, "echo"),
        ({"prompt_embeds": to_base64(torch.zeros(3, 64)), "repetition_penalty": 1.3}, "repetition_penalty"),
        ({"prompt_embeds": to_base64(torch.zeros(3, 64)), "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt_embeds": to_base64(torch.zeros(300, 64))}, "prompt_embeds"),
    ],
)
def test_embeddings_a_server_cannot_take_are_400s_naming_the_field(
    served: Served, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(served.openai(), prompt="", extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_embeddings_need_the_flag_and_the_completions_endpoint(served: Served) -> None:
    embeds = {"prompt_embeds": to_base64(torch.zeros(3, 64))}
    with pytest.raises(openai.BadRequestError) as caught:
        complete(served.openai(), prompt="hello", extra_body=embeds)
    assert caught.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=embeds
        )
    assert caught.value.body["param"] == "prompt_embeds"
    with LiveServer(build_app(served.engine, MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            complete(client, prompt="", extra_body=embeds)
        assert (
            caught.value.body["param"] == "prompt_embeds" and "--enable-prompt-embeds" in caught.value.message
        )
