"""What a client is told about the model and a refusal: the served name is never a server path,
and a request that can never fit the KV cache is a 400 naming the field to change."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, LiveServer

from vmkv.engine import AsyncLLM
from vmkv.model.store import DEFAULT_MODEL
from vmkv.server import EngineClient, build_app
from vmkv.server.launcher import served_model_name

CAPACITY_BYTES = 64 * 512  # the tiny fp32 model's KV is 512 B a token: 64 tokens, four 16-token blocks


def test_a_checkpoint_directory_is_served_under_its_base_name(tiny_model_dir: Path) -> None:
    def name(model: str, served: str | None = None) -> str:
        return served_model_name(argparse.Namespace(model=model, served_model_name=served))

    assert name(str(tiny_model_dir)) == tiny_model_dir.name
    assert name(f"{tiny_model_dir}/") == tiny_model_dir.name
    assert name(DEFAULT_MODEL) == DEFAULT_MODEL
    assert name(str(tiny_model_dir), "public") == "public"


@pytest.fixture(scope="module")
def small_cache(tiny_model_dir: Path) -> Iterator[str]:
    engine = EngineClient(
        AsyncLLM(
            model=str(tiny_model_dir),
            kv_mode="paged",
            dtype="float32",
            max_model_len=128,
            max_num_seqs=8,
            kv_budget_bytes=CAPACITY_BYTES,
        )
    )
    with LiveServer(build_app(engine, MODEL)) as server:
        yield server.url
    engine.shutdown()


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 100}, "max_tokens"),
        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 30, "n": 4}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 1},
            "messages",
        ),
    ],
)
def test_a_request_that_can_never_fit_the_cache_names_the_field(
    small_cache: str, route: str, body: dict, param: str
) -> None:
    response = httpx.post(f"{small_cache}{route}", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "can never fit the KV cache" in error["message"]
    assert error["param"] == param
