"""Anthropic's Messages API over real HTTP with the `anthropic` client: a message is the chat
completion of the same conversation (system prompt, tool uses and results, a prefilled answer
continued), whole or streamed as the API's typed events; count_tokens counts that prompt;
errors come in Anthropic's shape and leave the server healthy; x-api-key is a key; an engine
that dies mid-stream ends the stream with an error event. One engine process over the tiny
fp32 model serves the module."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from test_server import MODEL, LiveServer, Served, live_server, start_engine

from vmkv.server import build_app
from vmkv.server.drain import Drain

QUESTION = "Which layout keeps each sequence's keys and values contiguous in virtual memory?"
CITY = {"type": "string", "enum": ["Oslo", "Paris"]}  # a random model's free string may not close
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# the same tool as OpenAI's chat spells it
WEATHER_FUNCTION = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}
FINISHES = {"length": "max_tokens", "stop": "end_turn"}  # chat's finish_reason -> stop_reason


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    with live_server(tiny_model_dir, "paged") as served:
        yield served


def client_of(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(served: Served) -> anthropic.Anthropic:
    return client_of(served.url)


def body(**extra: object) -> dict:
    """The JSON of a greedy request."""
    question = [{"role": "user", "content": QUESTION}]
    return dict(model=MODEL, max_tokens=8, temperature=0.0, messages=question) | extra


def greedy(**extra: object) -> dict:
    """The client's arguments for the same request: this client sends sampling fields (which
    older ones, and other servers' clients, send as they are) only as extra body."""
    arguments = body(**extra)
    sampling = {"temperature": arguments.pop("temperature")} | arguments.pop("extra_body", {})
    return arguments | {"extra_body": sampling}


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def tokenized(served: Served, messages: list[dict], **extra: object) -> int:
    """The prompt's length as /tokenize counts the same chat in OpenAI's form."""
    response = httpx.post(f"{served.url}/tokenize", json={"model": MODEL, "messages": messages} | extra)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_a_message_is_the_chat_completion_of_its_conversation(
    served: Served, client: anthropic.Anthropic
) -> None:
    """System prompt first, then the conversation: the same prompt, and so the same greedy
    answer and token counts, as OpenAI's chat of the same messages."""
    message = client.messages.create(**greedy(system="Answer in one sentence."))
    chat = served.openai().chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=8,
        temperature=0.0,
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg")
    assert text_of(message) == chat.choices[0].message.content
    assert message.stop_reason == FINISHES[chat.choices[0].finish_reason] and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    # the system prompt as text blocks is the same prompt, read from the prefix cache this time
    blocks = client.messages.create(**greedy(system=[{"type": "text", "text": "Answer in one sentence."}]))
    assert text_of(blocks) == text_of(message)
    assert blocks.usage.cache_read_input_tokens > 0
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(
        model=MODEL, system="Answer in one sentence.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_anthropics_client_lists_and_retrieves_the_served_model(
    served: Served, client: anthropic.Anthropic
) -> None:
    page = client.models.list()
    (card,) = page.data
    assert (card.id, card.display_name, card.type, page.has_more) == (MODEL, MODEL, "model", False)
    assert card.created_at is not None and card.max_input_tokens == served.engine.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL


def test_a_streamed_message_is_the_whole_one_in_typed_events(
    served: Served, client: anthropic.Anthropic
) -> None:
    whole = client.messages.create(**greedy())
    with client.messages.stream(**greedy()) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(whole) == text_of(final)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    with httpx.stream("POST", f"{served.url}/v1/messages", json=body(stream=True)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [payload["type"] for payload in payloads] == names  # each event's name is its type
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert payloads[0]["message"]["content"] == [] and payloads[0]["message"]["stop_reason"] is None
    assert payloads[-2]["delta"]["stop_reason"] == whole.stop_reason


def test_thinking_and_effort_work_through_the_templates_switch(
    served: Served, client: anthropic.Anthropic
) -> None:
    """The tiny model's template reads enable_thinking, as Qwen3's does: thinking disabled and
    an effort are chat's reasoning_effort "none" and that effort; adaptive leaves the prompt."""
    chat = served.openai().chat.completions

    def chat_text(**extra: object) -> str:
        answer = chat.create(model=MODEL, messages=body()["messages"], max_tokens=8, temperature=0.0, **extra)
        return answer.choices[0].message.content

    assert text_of(client.messages.create(**greedy(thinking={"type": "adaptive"}))) == chat_text()
    disabled = client.messages.create(**greedy(thinking={"type": "disabled"}))
    assert text_of(disabled) == chat_text(extra_body={"reasoning_effort": "none"})
    effort = client.messages.create(**greedy(output_config={"effort": "high"}))
    assert text_of(effort) == chat_text(extra_body={"reasoning_effort": "high"})
    with_switch = client.messages.count_tokens(
        model=MODEL, messages=body()["messages"], thinking={"type": "disabled"}
    )
    assert with_switch.input_tokens == tokenized(
        served, body()["messages"], chat_template_kwargs={"enable_thinking": False}
    )


def test_without_a_switch_thinking_off_changes_nothing_and_an_effort_is_refused(served: Served) -> None:
    no_switch = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}assistant:"
    with LiveServer(build_app(served.engine, MODEL, chat_template=no_switch)) as server:
        client = client_of(server.url)
        plain = text_of(client.messages.create(**greedy()))
        assert text_of(client.messages.create(**greedy(thinking={"type": "disabled"}))) == plain
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(**greedy(output_config={"effort": "high"}))
        assert "output_config" in raised.value.body["error"]["message"]


def test_a_reasoning_models_thinking_is_a_thinking_block_and_its_budget_holds(served: Served) -> None:
    """deepseek_r1 over the random model reads its answer as thinking never closed: a thinking
    block alone, whole and streamed; with thinking enabled and a budget, the end is forced and
    text follows."""
    with LiveServer(build_app(served.engine, MODEL, reasoning_parser="deepseek_r1")) as server:
        reasoner = client_of(server.url)
        free = reasoner.messages.create(**greedy(max_tokens=12))
        assert [block.type for block in free.content] == ["thinking"] and free.stop_reason == "max_tokens"
        with reasoner.messages.stream(**greedy(max_tokens=12)) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].thinking == free.content[0].thinking
        capped = reasoner.messages.create(
            **greedy(max_tokens=12, thinking={"type": "enabled", "budget_tokens": 3})
        )
        assert [block.type for block in capped.content] == ["thinking", "text"]
        assert capped.usage.output_tokens == 12


def test_an_output_format_constrains_the_answer_to_its_schema(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"layout": {"type": "string", "enum": ["vattention", "paged"]}},
        "required": ["layout"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        **greedy(max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert message.stop_reason == "end_turn"
    assert json.loads(text_of(message))["layout"] in ("vattention", "paged")


def test_a_stop_sequence_ends_the_answer_before_it(client: anthropic.Anthropic) -> None:
    full = text_of(client.messages.create(**greedy(max_tokens=16)))
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), f"the answer {full!r} has no text to stop at"
    message = client.messages.create(**greedy(max_tokens=16, stop_sequences=[stop]))
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == full[: full.index(stop)]


def test_a_forced_tool_use_round_trips(served: Served, client: anthropic.Anthropic) -> None:
    """tool_choice "tool" makes one call whose input fits the schema, whole or streamed; the
    call and its result sent back make the prompt OpenAI's chat makes of them."""
    forced = greedy(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=40)
    message = client.messages.create(**forced)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Oslo", "Paris")
    with client.messages.stream(**forced) as stream:
        final = stream.get_final_message()
    (streamed,) = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "get_weather", use.input)
    assert final.stop_reason == "tool_use"
    any_tool = client.messages.create(**greedy(tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=120))
    assert any_tool.stop_reason == "tool_use"
    assert {block.name for block in any_tool.content if block.type == "tool_use"} == {"get_weather"}

    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}],
        },
    ]
    openai_form = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    ]
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER])
    assert counted.input_tokens == tokenized(served, openai_form, tools=[WEATHER_FUNCTION])
    answer = client.messages.create(
        **greedy(messages=conversation, tools=[WEATHER], tool_choice={"type": "none"})
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens


def test_a_prefilled_answer_is_continued(served: Served, client: anthropic.Anthropic) -> None:
    """A conversation ending on the assistant's turn: the answer goes on from its text, as
    OpenAI's chat with continue_final_message (the prefill itself is not repeated)."""
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The layout is"}]
    message = client.messages.create(**greedy(messages=messages))
    chat = served.openai().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert text_of(message) == chat.choices[0].message.content
    counted = client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == tokenized(
        served, messages, continue_final_message=True, add_generation_prompt=False
    )


BAD_REQUESTS = [
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, "output_config"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ]
        },
        "image blocks are not served",
    ),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),  # no tools
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default, and no tool-call parser here
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),  # no name
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "x", "name": "y"}]}}, "mcp_servers"),
    ({"extra_body": {"speed": "fast"}}, "speed"),
    ({"extra_body": {"inference_geo": "eu"}}, "inference_geo"),
    ({"extra_body": {"kv_transfer_params": {}}}, "kv_transfer_params"),
    ({"extra_body": {"vllm_xargs": {"x": [1, {}]}}}, "vllm_xargs"),  # no objects among its values
    ({"max_tokens": 5000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
]


@pytest.mark.parametrize(("change", "named"), BAD_REQUESTS, ids=[named for _, named in BAD_REQUESTS])
def test_bad_requests_get_anthropic_errors_naming_the_field(
    served: Served, client: anthropic.Anthropic, change: dict, named: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(**greedy(**change))
    assert raised.value.body["type"] == "error"
    error = raised.value.body["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert text_of(client.messages.create(**greedy(max_tokens=2)))  # others are still answered


def test_unknown_models_and_missing_fields_are_anthropic_errors(
    served: Served, client: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(**greedy(model="claude-nonexistent"))
    assert raised.value.body["error"]["type"] == "not_found_error"
    without = body()
    del without["max_tokens"]
    response = httpx.post(f"{served.url}/v1/messages", json=without)
    assert response.status_code == 400
    assert response.json()["type"] == "error" and "max_tokens" in response.json()["error"]["message"]
    not_json = httpx.post(
        f"{served.url}/v1/messages/count_tokens", content=b"{", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's shape
    assert set(httpx.post(f"{served.url}/v1/chat/completions", json={}).json()) == {"error"}


def test_an_api_key_is_taken_as_anthropic_clients_send_it(served: Served) -> None:
    with LiveServer(build_app(served.engine, MODEL, api_keys=["sesame"])) as server:
        assert text_of(client_of(server.url, "sesame").messages.create(**greedy(max_tokens=2)))
        with pytest.raises(anthropic.AuthenticationError) as raised:
            client_of(server.url, "guess").messages.create(**greedy(max_tokens=2))
        assert raised.value.body["error"]["type"] == "authentication_error"
        # x-api-key opens the OpenAI routes too; a bare key in Authorization opens nothing
        assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "sesame"}).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers={"authorization": "sesame"}).status_code == 401


def test_an_engine_death_mid_stream_ends_it_with_an_error_event(tiny_model_dir: Path) -> None:
    engine = start_engine(str(tiny_model_dir), "contiguous")
    with LiveServer(build_app(engine, MODEL)) as server:
        streamed = body(max_tokens=150, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/messages", json=streamed, timeout=10) as response:
            lines = response.iter_lines()
            first = next(lines)
            os.kill(engine.llm.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert first == "event: message_start"
        assert rest[-2] == "event: error"
        error = json.loads(rest[-1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "killed by signal 9" in error["error"]["message"]
        after = httpx.post(f"{server.url}/v1/messages", json=body())
        assert after.status_code == 503 and after.json()["error"]["type"] == "api_error"
    engine.shutdown()


def test_a_client_leaving_a_stream_frees_its_kv(served: Served) -> None:
    served.wait_idle()
    with httpx.stream(
        "POST", f"{served.url}/v1/messages", json=body(max_tokens=150, stream=True)
    ) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
    assert served.wait_idle() == served.llm.info.capacity_tokens  # the engine request was aborted


def test_a_drain_refuses_new_messages_in_anthropics_shape_and_lets_those_running_end(served: Served) -> None:
    drain = Drain(build_app(served.engine, MODEL))
    with LiveServer(drain) as server:
        streamed = body(max_tokens=150, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/messages", json=streamed) as running:
            lines = running.iter_lines()
            assert next(lines) == "event: message_start"
            drain.draining = True
            refused = httpx.post(f"{server.url}/v1/messages", json=body())
            assert [line for line in lines if line][-2] == "event: message_stop"
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "api_error"
