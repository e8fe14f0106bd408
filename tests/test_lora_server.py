"""LoRA adapters over HTTP: a served adapter is a model name every endpoint takes, listed with
its base model as parent; operators load and unload adapters at run time where allowed; wrong
names and paths get clear 4xx answers and change nothing. A real uvicorn over the engine in
its own process, driven by the `openai` client and httpx, and `vmkv serve` as a user starts it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_engine_process import vmkv_serve
from test_server import KV_BUDGET_BYTES, MAX_MODEL_LEN, MODEL, LiveServer

from vmkv.engine import LLM, AsyncProcessLLM, DataParallelLLM, EngineConfig, LoRARequest, SamplingParams
from vmkv.model.tiny import build_random_lora
from vmkv.server import EngineClient, build_app
from vmkv.server.lora_routes import LoRAModule, parse_lora_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Once upon a time"
ENGINE = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_budget_bytes": KV_BUDGET_BYTES}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-loras")
    return {
        "first": build_random_lora(tiny_model_dir, root / "first", seed=1),
        "second": build_random_lora(tiny_model_dir, root / "second", seed=2, targets=("o_proj", "up_proj")),
    }


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[tuple[str, EngineClient]]:
    """The tiny model with adapter "first" served from the start and runtime updates allowed."""
    llm = AsyncProcessLLM(model=str(tiny_model_dir), num_threads=1, enable_lora=True, max_loras=2, **ENGINE)
    engine = EngineClient(llm)
    asyncio.run(engine.add_lora("first", str(adapter_dirs["first"])))
    with LiveServer(build_app(engine, MODEL, allow_runtime_lora_updating=True)) as server:
        yield server.url, engine
    engine.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def completion_ids(url: str, model: str) -> list[int]:
    answer = client(url).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert answer.model == model
    return answer.choices[0].token_ids


def test_a_served_adapter_answers_as_the_engine_does_with_it(
    served: tuple[str, EngineClient], tiny_model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    url, _ = served
    offline = LLM(str(tiny_model_dir), enable_lora=True, **ENGINE)
    prompt = offline.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("first", 1, str(adapter_dirs["first"]))
    expected = offline.generate([prompt], params, lora_request=lora)[0].outputs[0].token_ids
    base = offline.generate([prompt], params)[0].outputs[0].token_ids
    offline.close()
    assert completion_ids(url, "first") == expected
    assert completion_ids(url, MODEL) == base != expected


def test_every_endpoint_takes_an_adapters_name_and_answers_under_it(served: tuple[str, EngineClient]) -> None:
    url, _ = served
    models = {card.id: card for card in client(url).models.list().data}
    assert models["first"].parent == MODEL and models["first"].root.endswith("first")
    assert client(url).models.retrieve("first").id == "first"
    messages = [{"role": "user", "content": PROMPT}]
    chunks = list(
        client(url).chat.completions.create(model="first", messages=messages, max_tokens=4, stream=True)
    )
    assert chunks and {chunk.model for chunk in chunks} == {"first"}
    embedded = {
        model: client(url).embeddings.create(model=model, input=PROMPT).data[0].embedding
        for model in (MODEL, "first")
    }
    assert embedded[MODEL] != embedded["first"]
    response = client(url).responses.create(model="first", input=PROMPT, max_output_tokens=4)
    assert response.model == "first"


def test_metrics_name_the_adapters_running_and_waiting_as_vllm_does(
    served: tuple[str, EngineClient], tiny_model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    url, _ = served
    [info] = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith("vllm:lora_")]
    assert info.startswith("vllm:lora_requests_info{") and 'max_lora="2"' in info
    assert 'running_lora_adapters=""' in info  # nothing runs between the tests
    # the engine's own report while requests run
    llm = LLM(str(tiny_model_dir), enable_lora=True, max_num_batched_tokens=64, max_num_seqs=8, **ENGINE)
    lora = LoRARequest("first", 1, str(adapter_dirs["first"]))
    for i in range(4):
        llm.engine.add_request(str(i), list(range(5, 60)), SamplingParams(max_tokens=4), lora_request=lora)
    llm.engine.add_request("base", [5, 6], SamplingParams(max_tokens=4))
    llm.engine.step()
    stats = llm.engine.stats()
    assert stats.running_loras == ("first",) and stats.waiting_loras == ("first",)
    llm.close()


def test_an_unknown_model_name_is_a_404_naming_what_is_served(served: tuple[str, EngineClient]) -> None:
    url, _ = served
    with pytest.raises(openai.NotFoundError, match="first") as refused:
        client(url).completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert refused.value.body["param"] == "model"


def test_operators_load_and_unload_adapters_while_the_server_runs(
    served: tuple[str, EngineClient], adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    url, engine = served
    load = {"lora_name": "second", "lora_path": str(adapter_dirs["second"])}
    answer = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert answer.status_code == 200 and "added successfully" in answer.text
    tokens = completion_ids(url, "second")
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    replaced = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"load_inplace": True})
    assert replaced.status_code == 200 and completion_ids(url, "second") == tokens
    # a path with no adapter: refused, nothing served under the name
    broken = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(tmp_path)}
    )
    assert broken.status_code == 400 and "adapter_config.json" in broken.json()["error"]["message"]
    assert "third" not in engine.loras
    base_name = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"lora_name": MODEL})
    assert base_name.status_code == 400
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 404
    assert "second" not in {card.id for card in client(url).models.list().data}
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="second", prompt=PROMPT, max_tokens=2)
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_update_routes_exist_only_where_allowed(tiny_model_dir: Path) -> None:
    llm = AsyncProcessLLM(model=str(tiny_model_dir), num_threads=1, enable_lora=True, **ENGINE)
    engine = EngineClient(llm)
    with LiveServer(build_app(engine, MODEL)) as server:
        body = {"lora_name": "x", "lora_path": "/nowhere"}
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 404
    engine.shutdown()


def test_lora_module_flags_parse_both_forms() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    given = '{"name": "sql", "path": "/a", "base_model_name": "base"}'
    assert parse_lora_module(given) == LoRAModule("sql", "/a", "base")
    for wrong in ("sql", "=/a", "sql=", '{"name": "sql"}', "{not json"):
        with pytest.raises(ValueError, match="LoRA module"):
            parse_lora_module(wrong)


def test_vmkv_serve_serves_its_lora_modules_and_refuses_a_bad_one(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    flags = ["--max-model-len", "128", "--enable-lora", "--lora-modules", f"first={adapter_dirs['first']}"]
    with vmkv_serve(tiny_model_dir, *flags) as (_, url):
        assert "first" in {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]}
        assert len(completion_ids(url, "first")) == 8
    command = [sys.executable, "-m", "vmkv.cli", "serve", "--model", str(tiny_model_dir), "--no-compile"]
    without = subprocess.run(
        [*command, "--lora-modules", "a=/b"], capture_output=True, text=True, timeout=120
    )
    assert without.returncode != 0 and "--enable-lora" in without.stderr
    bad = [
        *command,
        "--dtype",
        "float32",
        "--kv-budget-mib",
        "8",
        "--enable-lora",
        "--lora-modules",
        f"x={tmp_path}",
    ]
    refused = subprocess.run(bad, capture_output=True, text=True, timeout=120)
    assert (
        refused.returncode != 0
        and "--lora-modules" in refused.stderr
        and "adapter_config.json" in refused.stderr
        and "KV cache" not in refused.stderr  # refused before an engine (and its compile) was built
    )


def test_data_parallel_replicas_each_serve_the_adapters(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    config = EngineConfig(model=str(tiny_model_dir), enable_lora=True, num_threads=1, **ENGINE)
    offline = LLM(str(tiny_model_dir), enable_lora=True, **ENGINE)
    lora = LoRARequest("first", 1, str(adapter_dirs["first"]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = offline.tokenizer(PROMPT)["input_ids"]
    expected = offline.generate([prompt], params, lora_request=lora)[0].outputs[0].token_ids
    offline.close()
    replicas = DataParallelLLM(config, 2, routing="round-robin")
    engine = EngineClient(replicas)

    async def run() -> list[list[int]]:
        await engine.add_lora("first", str(adapter_dirs["first"]))
        answers = []
        for i in range(2):  # round-robin: one request on each replica
            outputs = replicas.generate(prompt, params, f"r{i}", lora_request=engine.lora_request("first"))
            answers.append([output async for output in outputs][-1].outputs[0].token_ids)
        assert await replicas.control("list_loras") == ["first"]
        return answers

    try:
        assert asyncio.run(run()) == [expected, expected]
    finally:
        engine.shutdown()
