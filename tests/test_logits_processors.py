"""Custom logits processors: loaded by name in the engine's process, applied only to the rows
of requests that opt in (the rest sample as without them), their arguments checked up front."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest
from test_engine import make_llm
from test_server import MODEL, LiveServer

from vmkv.engine import AsyncProcessLLM, RequestRejected, SamplingParams
from vmkv.server import EngineClient, build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROCESSOR = '''
import torch
from vmkv.engine import LogitsProcessor


class ForceToken(LogitsProcessor):
    """Every token of a request with extra_args {"force_token": id} is that id."""

    @classmethod
    def validate_params(cls, params):
        token = (params.extra_args or {}).get("force_token")
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError(f"force_token must be a token id, got {token!r}")

    def applies_to(self, params):
        return "force_token" in (params.extra_args or {})

    def apply(self, logits, rows):
        assert logits.shape == (len(rows), self.vocab_size)
        for i, row in enumerate(rows):
            token = row.params.extra_args["force_token"]
            logits[i].fill_(float("-inf"))
            logits[i, token] = 0.0


class NotAProcessor:
    pass
'''


@pytest.fixture
def processors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The module's name, importable here and in engine processes started from now on."""
    (tmp_path / "my_processors.py").write_text(textwrap.dedent(PROCESSOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "my_processors"


def test_only_the_rows_that_opt_in_are_processed(tiny_model_dir: Path, processors: str) -> None:
    plain = make_llm(tiny_model_dir)
    prompts = ["The capital of France is", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, greedy)]
    llm = make_llm(tiny_model_dir, logits_processors=[f"{processors}:ForceToken"])
    forced = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args={"force_token": 7}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, extra_args={"force_token": 9}),
    ]
    outputs = llm.generate(prompts * 2, [*forced, greedy, greedy])  # batched together
    assert [out.outputs[0].token_ids for out in outputs] == [[7] * 8, [9] * 8, *expected]
    with pytest.raises(RequestRejected, match="ForceToken: force_token must be a token id") as refused:
        llm.generate(prompts[0], SamplingParams(extra_args={"force_token": "seven"}))
    assert refused.value.param == "extra_args"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ForceToken", "give it as package.module:Class"),
        ("no_such_module:ForceToken", "cannot be loaded"),
        ("{module}:Missing", "cannot be loaded"),
        ("{module}:NotAProcessor", "not a vmkv.engine.LogitsProcessor subclass"),
    ],
)
def test_a_processor_that_cannot_be_used_stops_the_engine_at_start(
    tiny_model_dir: Path, processors: str, name: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_model_dir, logits_processors=[name.format(module=processors)])


def test_the_server_takes_vllm_xargs_to_the_engine_process(tiny_model_dir: Path, processors: str) -> None:
    llm = AsyncProcessLLM(
        model=str(tiny_model_dir),
        kv_mode="paged",
        dtype="float32",
        max_model_len=128,
        num_threads=1,
        logits_processors=[f"{processors}.ForceToken"],
    )
    engine = EngineClient(llm)
    try:
        with LiveServer(build_app(engine, MODEL)) as server:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "vllm_xargs": {"force_token": 65}}
            text = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
            assert text == llm.tokenizer.decode([65] * 5)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
            answer = httpx.post(
                f"{server.url}/v1/chat/completions", json={**chat, "vllm_xargs": {"force_token": 66}}
            )
            assert answer.json()["choices"][0]["message"]["content"] == llm.tokenizer.decode([66] * 3)
            message = {**chat, "vllm_xargs": {"force_token": 67}}  # Anthropic's Messages API, as vLLM's
            blocks = httpx.post(f"{server.url}/v1/messages", json=message).json()["content"]
            assert blocks == [{"type": "text", "text": llm.tokenizer.decode([67] * 3)}]
            refused = httpx.post(
                f"{server.url}/v1/completions", json={**body, "vllm_xargs": {"force_token": -1}}
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs"
            # checked in the API process too: a stream is refused before it starts
            streamed = {**body, "vllm_xargs": {"force_token": -1}, "stream": True}
            refused = httpx.post(f"{server.url}/v1/completions", json=streamed)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs"
            assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        engine.shutdown()
