"""What a client is told about the model and a refusal: the served name is never a server path,
and a request that can never fit the KV cache is a 400 naming the field to change."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, LiveServer

from vmkv.engine import AsyncLLM
from vmkv.engine.engine_info import EngineInfo
from vmkv.model.store import DEFAULT_MODEL, load_tokenizer
from vmkv.server import EngineClient, build_app
from vmkv.server.launcher import hidden_tags, log_capacity, served_model_name

CAPACITY_BYTES = 64 * 512  # the tiny fp32 model's KV is 512 B a token: 64 tokens, four 16-token blocks


def test_a_checkpoint_directory_is_served_under_its_base_name(tiny_model_dir: Path) -> None:
    def name(model: str, served: str | None = None) -> str:
        return served_model_name(argparse.Namespace(model=model, served_model_name=served))

    assert name(str(tiny_model_dir)) == tiny_model_dir.name
    assert name(f"{tiny_model_dir}/") == tiny_model_dir.name
    assert name(DEFAULT_MODEL) == DEFAULT_MODEL
    assert name(str(tiny_model_dir), "public") == "public"


def test_parser_tags_a_tokenizer_marks_special_are_named_at_start(tiny_model_dir: Path) -> None:
    """Detokenizing with skip_special_tokens drops a special token, so a parser whose tag is one
    would never see it: the server warns at start (vLLM's Hermes parser turns the skipping off)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    assert hidden_tags(tokenizer, "hermes", "qwen3") == []
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</think>"]})
    assert hidden_tags(tokenizer, "hermes", "qwen3") == ["<tool_call>", "</think>"]
    assert hidden_tags(tokenizer, None, None) == []


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


def test_the_start_log_says_what_the_kv_cache_holds_and_warns_when_one_long_request_cannot_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def info(capacity: int) -> EngineInfo:
        return EngineInfo("m", 2048, 64, 100, capacity, frozenset({2}), capacity // 16, "block")

    with caplog.at_level("INFO", logger="vmkv.server.launcher"):
        log_capacity(info(8192), "paged", 1)
    assert "KV cache (paged): 8,192 tokens, 4.0 requests of max_model_len (2,048) at once" in caplog.text
    assert "WARNING" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="vmkv.server.launcher"):
        log_capacity(info(45), "vattention", 2)
    assert "KV cache (vattention, each of 2 replicas): 45 tokens" in caplog.text
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert "fewer than max_model_len (2,048)" in caplog.records[1].getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="vmkv.server.launcher"):  # the layout the cache chose, where given
        log_capacity(
            dataclasses.replace(info(8192), kv_layout="vattention, token-major, 16 KiB pages"),
            "vattention",
            1,
        )
    assert "KV cache (vattention, token-major, 16 KiB pages): 8,192 tokens" in caplog.text
