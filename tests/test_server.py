"""The HTTP server end to end: a real uvicorn on a loopback port over the real engine and the
tiny model, in every KV mode, with the engine in its own process (and once on a thread of the
server), driven by the `openai` client and by httpx."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
import uvicorn
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from vmkv.engine import AsyncLLM, AsyncProcessLLM, SamplingParams
from vmkv.engine.config import KV_MODES
from vmkv.server import EngineClient, build_app
from vmkv.server.limits import RequestLimits
from vmkv.server.protocol import CompletionChoice, CompletionResponse
from vmkv.server.streaming import sse_event

MODEL = "tiny"
MAX_MODEL_LEN = 256
KV_BUDGET_BYTES = 32 << 20  # holds more than 64 sequences of MAX_MODEL_LEN in every mode
NUM_CONCURRENT_STREAMS = 50


class LiveServer:
    """uvicorn serving `app` on a free loopback port from a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@dataclass
class Served:
    url: str
    engine: EngineClient
    kv_mode: str

    @property
    def llm(self) -> AsyncLLM | AsyncProcessLLM:
        return self.engine.llm

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def wait_idle(self, timeout: float = 10.0) -> int:
        """Wait until no request is left in the engine; returns the KV cache's free capacity then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.llm.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_swapped == 0
            if idle and stats.free_tokens == self.llm.info.capacity_tokens:
                return stats.free_tokens
            assert time.monotonic() < deadline, f"engine still busy: {stats}"
            time.sleep(0.01)


def start_engine(model_dir: str, kv_mode: str, in_process: bool = False) -> EngineClient:
    front_door = AsyncLLM if in_process else AsyncProcessLLM
    llm = front_door(
        model=model_dir,
        kv_mode=kv_mode,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_budget_bytes=KV_BUDGET_BYTES,
        # the engine process shares the cores with this server and its clients; see conftest
        num_threads=1 if not in_process else None,
    )
    return EngineClient(llm)


@contextmanager
def live_server(model_dir: Path, kv_mode: str, in_process: bool = False) -> Iterator[Served]:
    """An engine over the tiny model behind a live server, shut down on the way out."""
    engine = start_engine(str(model_dir), kv_mode, in_process)
    with LiveServer(build_app(engine, MODEL)) as server:
        yield Served(server.url, engine, kv_mode)
    engine.shutdown()


# Every layout behind the engine process (the server's default); the thread engine once.
SERVED = [(kv_mode, False) for kv_mode in KV_MODES] + [("paged", True)]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{m}-{'thread' if t else 'process'}" for m, t in SERVED])
def served(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Served]:
    with live_server(tiny_model_dir, *request.param) as served:
        yield served


def sse_payloads(lines: Iterator[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# --------------------------------------------------------------------------- the openai client


def test_completions_plain_and_streaming_agree(served: Served) -> None:
    client = served.openai()
    prompt = "The capital of France is"
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.model == MODEL and len(plain.choices) == 1
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len(served.engine.tokenizer(prompt)["input_ids"])

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    streamed = "".join(choice.text for chunk in chunks[:-1] for choice in chunk.choices)
    assert streamed == plain.choices[0].text  # greedy: the same tokens either way
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_n_samples_and_logprobs(served: Served) -> None:
    client = served.openai()
    result = client.completions.create(
        model=MODEL,
        prompt="Hello, world!",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    for choice in result.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
        assert all(lp <= 0 for lp in logprobs.token_logprobs)
        for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
            assert token in top and len(top) <= 3  # top-2 plus the sampled token, keyed by text
    again = client.completions.create(
        model=MODEL,
        prompt="Hello, world!",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # same seed, same samples


def test_any_64_bit_seed_reproduces(served: Served) -> None:
    client = served.openai()

    def texts() -> list[str]:
        result = client.completions.create(
            model=MODEL,
            prompt="Hello, world!",
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=2**63 - 1,
            extra_body={"ignore_eos": True},
        )
        return [choice.text for choice in sorted(result.choices, key=lambda choice: choice.index)]

    first = texts()
    assert texts() == first


def test_cache_salt_is_served_and_isolates_cached_prefixes(served: Served) -> None:
    prompt = "Salted prefixes are shared only within one tenant. " * 2  # several 16-token blocks

    def prefix_hits(path: str, body: dict) -> int:
        before = served.llm.stats().prefix_cache_hits
        response = httpx.post(f"{served.url}{path}", json={"model": MODEL, "max_tokens": 2, **body})
        assert response.status_code == 200, response.text
        served.wait_idle()
        return served.llm.stats().prefix_cache_hits - before

    hits = [
        prefix_hits("/v1/completions", {"prompt": prompt, "cache_salt": salt})
        for salt in ("tenant-a", "tenant-b", "tenant-a")
    ]
    chat = {"messages": [{"role": "user", "content": prompt}], "cache_salt": "tenant-c"}
    prefix_hits("/v1/chat/completions", chat)  # chat takes a salt too
    if served.kv_mode == "paged":
        assert hits[0] == hits[1] == 0 and hits[2] >= 32  # only the same salt finds tenant-a's blocks
    else:
        assert hits == [
            0,
            0,
            0,
        ]  # contiguous has no prefix cache; vattention's chunks are longer than this prompt


def test_completions_batch_of_prompts_streams_every_choice(served: Served) -> None:
    stream = served.openai().completions.create(
        model=MODEL,
        prompt=["Hello", "World!"],
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    finished = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3}
    assert usage.completion_tokens == 16
    assert usage.prompt_tokens == sum(
        len(served.engine.tokenizer(p)["input_ids"]) for p in ("Hello", "World!")
    )


def test_chat_plain_streaming_and_n(served: Served) -> None:
    client = served.openai()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 10
    template = served.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert plain.usage.prompt_tokens == len(
        served.engine.tokenizer(template, add_special_tokens=False)["input_ids"]
    )

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == plain.choices[0].message.content

    several = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        n=4,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(choice.index for choice in several.choices) == [0, 1, 2, 3]
    assert several.usage.completion_tokens == 20
    for choice in several.choices:
        assert len(choice.logprobs.content) == 5
        assert all(len(token.top_logprobs) == 3 for token in choice.logprobs.content)


def test_stop_string_ends_the_sample(served: Served) -> None:
    client = served.openai()
    free = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = next(
        text[i : i + 2]
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isalnum()
    )
    stopped = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].stop_reason == stop  # says which stop ended it, as vLLM does

    async def greedy_token_ids() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        async for out in served.llm.generate("Hello", params):
            final = out
        return final.outputs[0].token_ids

    second_token = asyncio.run(greedy_token_ids())[1]
    by_id = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [second_token]},
    )
    last = [chunk.choices[0] for chunk in by_id if chunk.choices][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", second_token)


def test_models_tokenize_detokenize_version(served: Served) -> None:
    models = served.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.openai().models.retrieve(MODEL).id == MODEL
    with httpx.Client(base_url=served.url) as http:
        assert_openai_error(http.get("/v1/models/org/other-model"), 404, "model")
        tokens = http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
            "prompt": "Hello, world!"
        }
        assert tokens["token_strs"] is None
        strings = http.post("/tokenize", json={"prompt": "Hello, world!", "return_token_strs": True}).json()
        assert strings["token_strs"] == served.engine.tokenizer.convert_ids_to_tokens(tokens["tokens"])
        assert "".join(strings["token_strs"]).endswith("world!")  # this tokenizer's strings are its bytes
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["count"] > tokens["count"] - 5  # the template wraps the message
        assert http.get("/tokenizer_info").status_code == 404  # only with --enable-tokenizer-info-endpoint
        assert http.get("/version").json()["version"]
        health = http.get("/health")
        assert health.status_code == 200 and health.content == b""


def test_tokenizer_info_describes_the_tokenizer_and_the_chat_template_in_use(tiny_model_dir: Path) -> None:
    engine = start_engine(str(tiny_model_dir), "paged", in_process=True)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        app = build_app(engine, MODEL, chat_template=template, enable_tokenizer_info=True)
        with LiveServer(app) as server:
            info = httpx.get(f"{server.url}/tokenizer_info").json()
    finally:
        engine.shutdown()
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__
    assert info["chat_template"] == template
    assert info["eos_token"] == engine.tokenizer.eos_token
    assert not any(key.endswith("_file") for key in info)


# ------------------------------------------------------------------------------- concurrency


def test_concurrent_streams_complete_and_free_every_block(served: Served) -> None:
    initial_free = served.wait_idle()

    async def one_client(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request number {i} says",
            max_tokens=8 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        assert finish == "length"
        return text, usage.completion_tokens

    async def run_all() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one_client(client, i) for i in range(NUM_CONCURRENT_STREAMS)))

    results = asyncio.run(run_all())
    assert [tokens for _, tokens in results] == [8 + i % 5 for i in range(NUM_CONCURRENT_STREAMS)]
    assert served.wait_idle() == initial_free
    metrics = httpx.get(f"{served.url}/metrics").text
    assert f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}' in metrics


def test_client_disconnect_mid_stream_aborts_and_frees_kv(served: Served) -> None:
    initial_free = served.wait_idle()
    generated_before = served.llm.stats().generation_tokens
    max_tokens = 200
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=served.url, timeout=10) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    assert served.wait_idle(timeout=5) == initial_free
    generated = served.llm.stats().generation_tokens - generated_before
    assert 3 <= generated < max_tokens / 2, f"generated {generated} tokens for an abandoned request"


def test_client_gone_before_a_plain_answer_aborts(served: Served) -> None:
    """A client that hangs up while its plain (non-streaming) answer is generated aborts it.

    The hang-up follows the first generated tokens, not a fixed client timeout: a 0.3 s timeout
    used to stand for "mid-generation", and a fast CPU finished the whole answer within it."""
    initial_free = served.wait_idle()
    generated_before = served.llm.stats().generation_tokens
    n, max_tokens = 16, 240
    body = json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "n": n, "ignore_eos": True}
    )
    host, port = served.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    )
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request.encode())
        deadline = time.monotonic() + 10
        while served.llm.stats().generation_tokens == generated_before:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.002)
    # the connection is closed now, with no byte of the answer sent
    assert served.wait_idle(timeout=5) == initial_free
    assert served.llm.stats().generation_tokens - generated_before < n * max_tokens


# ------------------------------------------------------------------------------- error matrix

CHAT = [{"role": "user", "content": "hi"}]
ERROR_CASES = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-40}, 400, "temperature"),  # 0 as a float32
    ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": 5e-324}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "cache_salt": 5}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 1.5}, 400, "seed"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/tokenize", {}, 400, None),
    # far past any max_model_len: refused before tokenizing; long: tokenized off the event loop
    ("/v1/completions", {"prompt": "word " * 200_000}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]}, 400, "messages"),
    ("/tokenize", {"prompt": "word " * 200_000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w" * 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    # no unbounded work per request
    ("/v1/completions", {"prompt": ["x"] * 65}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["x"] * 3, "n": 100}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"].endswith("Error")
    assert error["param"] == param, error


def test_error_matrix_keeps_the_server_healthy_and_other_requests_whole(served: Served) -> None:
    """Every bad request gets its OpenAI error while a long stream, started first, runs to its end."""
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 150,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=served.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as survivor:
            lines = survivor.iter_lines()
            first = next(lines)
            for path, request, status, param in ERROR_CASES:
                assert_openai_error(http.post(path, json={"model": MODEL, **request}), status, param)
            bad_json = http.post(
                "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            assert_openai_error(bad_json, 400, None)
            assert_openai_error(http.get("/v1/nothing-here"), 404, None)
            payloads = sse_payloads([first, *lines])
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 150
        assert http.get("/health").status_code == 200
        assert (
            http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code
            == 200
        )


def test_a_huge_prompt_is_refused_untokenized_and_a_long_one_tokenized_off_the_loop(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        huge = http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 200_000})
        long = http.post("/v1/completions", json={"model": MODEL, "prompt": "w" * 9000})
    assert "1000000 characters" in huge.json()["error"]["message"]
    assert "maximum context length" in long.json()["error"]["message"]  # counted in tokens


def test_a_full_queue_answers_429_with_retry_after(served: Served) -> None:
    if not isinstance(served.llm, AsyncProcessLLM):
        pytest.skip("needs a stats snapshot nothing refreshes while idle: the engine process's")
    served.wait_idle()
    with LiveServer(build_app(served.engine, MODEL, limits=RequestLimits(max_waiting=2))) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        idle = served.llm.stats()
        # the engine is idle, so this snapshot of a full queue stays until the next request
        served.llm._stats = dataclasses.replace(idle, num_waiting=2)
        try:
            full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        finally:
            served.llm._stats = idle
        assert_openai_error(full, 429, None)
        assert full.headers["retry-after"] == "1"


def test_a_prefix_cache_reset_makes_the_next_request_start_cold(served: Served) -> None:
    client = served.openai()
    prompt = [5 + i % 500 for i in range(200)]  # whole 16-token blocks, and a whole 128-token chunk

    def cached_tokens() -> int:
        usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
        return usage.prompt_tokens_details.cached_tokens

    cached_tokens()
    warm = cached_tokens()
    forgotten = httpx.post(f"{served.url}/reset_prefix_cache").json()["forgotten"]
    cold = cached_tokens()
    if served.kv_mode == "contiguous":  # no prefix cache: nothing to forget
        assert warm == forgotten == cold == 0
    else:
        assert warm >= 128 and forgotten >= 1 and cold == 0
    assert cached_tokens() == warm  # and the cache fills again


def test_oversized_bodies_get_413(served: Served) -> None:
    limit = 1024
    with (
        LiveServer(build_app(served.engine, MODEL, max_body_bytes=limit)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        big = {"model": MODEL, "prompt": "x" * (2 * limit)}
        assert_openai_error(http.post("/v1/completions", json=big), 413, None)

        def chunked():  # no Content-Length: the size is only known while reading
            for _ in range(4):
                yield b" " * limit

        assert_openai_error(http.post("/v1/completions", content=chunked()), 413, None)
        small = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert small.status_code == 200
        assert http.get("/health").status_code == 200


def test_api_keys_guard_every_route_but_the_probes(served: Served) -> None:
    with (
        LiveServer(build_app(served.engine, MODEL, api_keys=["sesame", "open"])) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        assert_openai_error(http.post("/v1/completions", json=body), 401, None)
        wrong = {"Authorization": "Bearer guess"}
        assert_openai_error(http.post("/v1/completions", json=body, headers=wrong), 401, None)
        # the key is checked before the body is read: malformed JSON tells a stranger nothing
        assert_openai_error(http.post("/v1/completions", content=b"{not json", headers=wrong), 401, None)
        for path in ("/v1/models", "/metrics", "/docs", "/redoc", "/openapi.json"):
            assert_openai_error(http.get(path, headers=wrong), 401, None)
        assert http.get("/health").status_code == 200 and http.get("/version").status_code == 200
        assert http.get("/metrics", headers={"Authorization": "Bearer open"}).status_code == 200
        for key in ("sesame", "open"):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            assert (
                client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
            )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0).models.list()
    with (
        LiveServer(build_app(served.engine, MODEL, api_keys=["sesame"], open_metrics=True)) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        assert http.get("/metrics").status_code == 200
        assert_openai_error(http.get("/v1/models"), 401, None)


def _shut_down(engine: EngineClient) -> None:
    engine.shutdown()


def _crash(engine: EngineClient) -> None:
    def explode(*args: object) -> None:
        raise RuntimeError("kernel exploded")

    # a step fails, and so does freeing its requests: the engine thread gives up
    engine.llm.engine.step = explode
    engine.llm.engine.fail_all = explode


def _kill(engine: EngineClient) -> None:
    os.kill(engine.llm.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("in_process", "stop", "reason"),
    [
        (True, _shut_down, None),
        (True, _crash, "kernel exploded"),
        (False, _shut_down, None),
        (False, _kill, "killed by signal 9"),
    ],
    ids=["thread-shutdown", "thread-crash", "process-shutdown", "process-sigkill"],
)
def test_dead_engine_answers_503_with_its_reason(
    tiny_model_dir: Path, in_process: bool, stop: Callable[[EngineClient], None], reason: str | None
) -> None:
    engine = start_engine(str(tiny_model_dir), "contiguous", in_process)
    with (
        LiveServer(build_app(engine, MODEL)) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        in_background = {"model": MODEL, "input": "Hello", "max_output_tokens": 200, "temperature": 0.0}
        # queued first: between the stream's first line and the stop nothing may wait, or the
        # stream could finish before the engine stops
        response_id = http.post("/v1/responses", json=in_background | {"background": True}).json()["id"]
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            stop(engine)
            payloads = sse_payloads([first, *lines])
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]  # the stream says why it ended early
        assert error["code"] == 503 and (reason is None or reason in error["message"])
        wait_until_ended = time.monotonic() + 10
        while (kept := http.get(f"/v1/responses/{response_id}").json())["status"] in (
            "queued",
            "in_progress",
        ):
            assert time.monotonic() < wait_until_ended, "the background response never ended"
            time.sleep(0.02)
        assert kept["status"] == "failed" and (reason is None or reason in kept["error"]["message"])
        for response in (
            http.get("/health"),
            http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}),
            http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}),
            http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT}),
            http.post("/v1/responses", json=in_background),
            http.post("/reset_prefix_cache"),
        ):
            assert_openai_error(response, 503, None)
            assert reason is None or reason in response.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 200  # the server itself keeps answering
    engine.shutdown()


# ------------------------------------------------------------------------------------ metrics


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, by name and labels."""
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_exposition(served: Served) -> None:
    """The gauges read what the engine holds: one stream running with KV in use while it runs,
    nothing after; the token counters grow by exactly the request's tokens."""
    label = f'{{model_name="{MODEL}"}}'
    served.wait_idle()
    before = scrape(served.url)
    prompt_len = len(served.engine.tokenizer("Hello")["input_ids"])
    # long enough to be scraped mid-stream; the stats snapshot may lag a step, so poll briefly
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 2
        while (during := scrape(served.url))[f"vllm:num_requests_running{label}"] != 1:
            assert time.monotonic() < deadline, during
            time.sleep(0.01)
        for _ in lines:
            pass
    served.wait_idle()
    after = scrape(served.url)
    assert during[f"vllm:num_requests_running{label}"] == 1
    assert during[f"vllm:num_requests_waiting{label}"] == 0
    assert 0 < during[f"vllm:kv_cache_usage_perc{label}"] <= 1
    assert during[f"vmkv:kv_cache_allocated_bytes{label}"] > 0
    assert after[f"vllm:num_requests_running{label}"] == 0
    assert after[f"vllm:num_preemptions_total{label}"] == before[f"vllm:num_preemptions_total{label}"]
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert after[f"vllm:{name}{label}"] >= before[f"vllm:{name}{label}"], name
    assert after[f"vmkv:kv_cache_fragmentation_bytes{label}"] >= 0
    grew = {
        name: after[f"vllm:{name}{label}"] - before[f"vllm:{name}{label}"]
        for name in ("generation_tokens_total", "prompt_tokens_total")
    }
    assert grew == {"generation_tokens_total": 200, "prompt_tokens_total": prompt_len}
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        count = after[f"vllm:{name}_count{label}"]
        assert count >= 1
        assert after[f'vllm:{name}_bucket{{model_name="{MODEL}",le="+Inf"}}'] == count
    assert (
        after[f"vllm:e2e_request_latency_seconds_count{label}"]
        - before[f"vllm:e2e_request_latency_seconds_count{label}"]
        == 1
    )
    in_use = {  # the layout's own gauge of what the running stream holds
        "vattention": "pages_mapped",
        "paged": "blocks_allocated",
        "contiguous": "units_in_use",
    }[served.kv_mode]
    assert during[f"vmkv:kv_{in_use}{label}"] > 0, in_use
    if served.kv_mode == "contiguous":
        assert during[f"vmkv:kv_units_in_use{label}"] == 1 and after[f"vmkv:kv_units_in_use{label}"] == 0


# ------------------------------------------------------------------------------------ fuzzing

FUZZ_MAX_MODEL_LEN = 32  # small limits keep every accepted fuzzed request short


@pytest.fixture(scope="module")
def fuzz_url(tiny_model_dir: Path) -> Iterator[str]:
    llm = AsyncProcessLLM(
        model=str(tiny_model_dir),
        kv_mode="paged",
        dtype="float32",
        num_threads=1,
        max_model_len=FUZZ_MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_budget_bytes=4 << 20,
    )
    engine = EngineClient(llm)
    with LiveServer(build_app(engine, MODEL, max_body_bytes=64 << 10)) as server:
        yield server.url
    engine.shutdown()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(fuzz_url: str, mode: GenerationMode) -> None:
    """Requests generated from the app's own OpenAPI schema, valid (positive) and invalid (negative)."""
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or not operation.body):
            continue  # a GET, or a POST with only a path's string in it, has no invalid form

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body.pop("model", None)  # a random name only ever reaches the 404 check
            response = case.call(timeout=30)
            if mode is GenerationMode.NEGATIVE and response.status_code == 413:
                return  # a list past its maxItems can be past the body limit too: refused unread
            # A schema-valid request may still be refused (a prompt too long for max_model_len): not a bug.
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

        check()


def test_a_chunk_whose_text_holds_unicode_line_breaks_stays_one_data_line() -> None:
    """Generated text may hold U+0085, U+2028 or U+2029, which JSON may leave raw and Python's
    str.splitlines (so httpx's aiter_lines) ends a line at: a soak stream once read a chunk cut
    in two. Each event must still be one line to such a client and decode to the same text."""
    text = "a\x85b\u2028c\u2029d é"
    chunk = CompletionResponse(id="c", model="m", choices=[CompletionChoice(index=0, text=text)])
    for event in (sse_event(chunk), sse_event(chunk.model_dump())):
        lines = event.splitlines()
        assert lines[1:] == [""] and lines[0].startswith("data: ")
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text
    assert "é" in sse_event(chunk)  # other characters stay as pydantic writes them
