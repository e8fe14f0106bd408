"""Embeddings: a pooling request computes its prompt and returns the final hidden states of its
last token (or their mean), L2-normalized: the same vector, within float rounding, as a plain
transformers forward of the unmodified model, in every KV layout, across prefill chunks, prefix
cache hits and preemption, beside generation it leaves unchanged; /v1/embeddings serves it to
the `openai` client over real HTTP."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from test_engine import SMALL_BUDGET, make_llm
from test_server import MODEL, LiveServer, Served, live_server

from vmkv import SamplingParams
from vmkv.engine.config import KV_MODES
from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids
from vmkv.model.store import load_tokenizer
from vmkv.server import build_app
from vmkv.server.drain import Drain
from vmkv.server.embeddings import checkpoint_pooling

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOLERANCE = 1e-5  # fp32: chunked attention sums in another order than one forward


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    return chat_prompt_ids(load_tokenizer(tiny_model_dir), CHAT_PROMPTS[:6])


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference(model: transformers.PreTrainedModel, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(dim=0), dim=0)


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    assert len(got) == expected.numel()
    assert (torch.tensor(got) - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("kv_mode", KV_MODES)
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_the_models_pooled_hidden_states_in_chunks(
    tiny_model_dir: Path,
    hf_model: transformers.PreTrainedModel,
    prompts: list[list[int]],
    kv_mode: str,
    pooling: str,
) -> None:
    """16-token chunks split every prompt; the second run of the same prompts reads the prefix
    cache where the pooling allows (the mean needs every row, so it computes them all again)."""
    llm = make_llm(tiny_model_dir, kv_mode, max_num_batched_tokens=16, max_num_seqs=4)
    for _ in range(2):
        for prompt, vector in zip(prompts, llm.embed(prompts, pooling), strict=True):
            assert_close(vector, reference(hf_model, prompt, pooling))
    llm.close()


def test_embeddings_survive_preemption_and_leave_generation_unchanged(
    tiny_model_dir: Path, hf_model: transformers.PreTrainedModel, prompts: list[list[int]]
) -> None:
    """A budget too small for the batch preempts requests mid-prompt; the pooled rows a
    recompute repeats count once, and the generations batched beside them are the ones made alone."""
    llm = make_llm(tiny_model_dir, "paged", kv_budget_bytes=SMALL_BUDGET)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]
    embed = SamplingParams(pooling="mean", max_tokens=1)
    outputs = llm.generate(prompts + prompts, [embed] * len(prompts) + [greedy] * len(prompts))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs[: len(prompts)], strict=True):
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        assert_close(out.embedding, reference(hf_model, prompt, "mean"))
    assert [out.outputs[0].token_ids for out in outputs[len(prompts) :]] == alone
    with pytest.raises(ValueError, match="n does not apply"):
        SamplingParams(pooling="last", n=2)
    llm.close()


def test_a_sentence_transformers_config_names_the_pooling(tmp_path: Path) -> None:
    assert checkpoint_pooling(str(tmp_path)) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert checkpoint_pooling(str(tmp_path)) == "mean"


# ------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    with live_server(tiny_model_dir, "vattention") as served:
        yield served


def test_the_openai_client_gets_each_inputs_embedding(
    served: Served, hf_model: transformers.PreTrainedModel
) -> None:
    """The client asks for base64 by default and decodes it; floats come as asked; texts are
    tokenized with the tokenizer's special tokens, as vLLM does; token ids go as they are."""
    client = served.openai()
    texts = ["The capital of France is", "Virtual memory maps pages."]
    response = client.embeddings.create(model=MODEL, input=texts)
    assert response.model == MODEL and [item.index for item in response.data] == [0, 1]
    ids = [served.engine.tokenizer(text)["input_ids"] for text in texts]
    for item, prompt in zip(response.data, ids, strict=True):
        assert_close(item.embedding, reference(hf_model, prompt, "last"))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    # The same prompt alone both times, so only the encoding differs: batched with another
    # prompt the GEMMs block differently (1.3e-7 apart on an AMX Xeon, bit-identical on others).
    alone = client.embeddings.create(model=MODEL, input=ids[0])
    floats = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert floats.data[0].embedding == alone.data[0].embedding
    same_width = client.embeddings.create(model=MODEL, input=texts[0], dimensions=served.engine.hidden_size)
    assert len(same_width.data[0].embedding) == served.engine.hidden_size


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [10**6]}, "input"),
        ({"input": "word " * 400}, "input"),
        ({"input": "x", "dimensions": 3}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "embed_dtype": "fp8_e4m3"}, "embed_dtype"),
        ({"input": "x", "use_activation": False}, "use_activation"),
        ({"input": "x", "padding": "max_length"}, "padding"),
        ({"input": "x", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ({"input": "x", "priority": 1}, "priority"),  # the server's policy is fcfs
        ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(served: Served, body: dict, param: str) -> None:
    response = httpx.post(f"{served.url}/v1/embeddings", json={"model": MODEL} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        served.openai().embeddings.create(model="another", input="x")
    assert httpx.get(f"{served.url}/health").status_code == 200


@pytest.mark.parametrize("embed_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_base64_embeddings_come_in_the_dtype_and_byte_order_asked(
    served: Served, embed_dtype: str, endianness: str
) -> None:
    body = {"model": MODEL, "input": "Virtual memory maps pages."}
    floats = httpx.post(f"{served.url}/v1/embeddings", json=body).json()["data"][0]["embedding"]
    asked = {**body, "encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}
    encoded = httpx.post(f"{served.url}/v1/embeddings", json=asked).json()["data"][0]["embedding"]
    raw = bytearray(base64.b64decode(encoded))
    width = 4 if embed_dtype == "float32" else 2
    assert len(raw) == width * len(floats)
    if endianness == "big" or (endianness == "native" and sys.byteorder == "big"):
        for start in range(0, len(raw), width):  # to little-endian, element by element
            raw[start : start + width] = raw[start : start + width][::-1]
    values = torch.frombuffer(raw, dtype=getattr(torch, embed_dtype)).float()
    assert torch.equal(values, torch.tensor(floats).to(getattr(torch, embed_dtype)).float())


def test_embedding_inputs_are_cut_as_asked(served: Served) -> None:
    long = list(range(5, 305))  # longer than the model's context
    body = {"model": MODEL, "input": long, "truncate_prompt_tokens": 16}
    right = httpx.post(f"{served.url}/v1/embeddings", json=body).json()
    assert right["usage"]["prompt_tokens"] == 16
    first = httpx.post(f"{served.url}/v1/embeddings", json={"model": MODEL, "input": long[:16]}).json()
    assert right["data"][0]["embedding"] == pytest.approx(first["data"][0]["embedding"], abs=1e-5)
    left = {**body, "truncation_side": "left"}
    last = httpx.post(f"{served.url}/v1/embeddings", json={"model": MODEL, "input": long[-16:]}).json()
    got = httpx.post(f"{served.url}/v1/embeddings", json=left).json()["data"][0]["embedding"]
    assert got == pytest.approx(last["data"][0]["embedding"], abs=1e-5)
    fits = httpx.post(f"{served.url}/v1/embeddings", json={**body, "truncate_prompt_tokens": -1}).json()
    assert fits["usage"]["prompt_tokens"] == served.engine.max_model_len - 1


# ------------------------------------------------------------------------------ score and rerank
def cosine(hf_model: transformers.PreTrainedModel, tokenizer: object, a: str, b: str) -> float:
    first, second = (reference(hf_model, tokenizer(text)["input_ids"], "last") for text in (a, b))
    return float(torch.nn.functional.cosine_similarity(first, second, dim=0))


def test_score_pairs_its_sides_one_to_many_and_in_order(
    served: Served, hf_model: transformers.PreTrainedModel
) -> None:
    tokenizer = served.engine.tokenizer
    query, documents = "Where is Paris?", ["Paris is in France.", "Pages map memory.", "Paris is in France."]
    one_to_many = httpx.post(
        f"{served.url}/score", json={"model": MODEL, "text_1": query, "text_2": documents}
    )
    assert one_to_many.status_code == 200, one_to_many.text
    body = one_to_many.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, document in zip(body["data"], documents, strict=True):
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(cosine(hf_model, tokenizer, query, document), abs=1e-3)
    # a text given twice is embedded once: the usage counts what was computed
    unique = [query, *documents[:2]]
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(text)["input_ids"]) for text in unique)
    in_order = httpx.post(
        f"{served.url}/v1/score", json={"queries": [query, documents[1]], "documents": documents[:2]}
    ).json()
    expected = [cosine(hf_model, tokenizer, query, documents[0]), 1.0]  # a text against itself
    assert [item["score"] for item in in_order["data"]] == pytest.approx(expected, abs=1e-3)


def test_rerank_orders_the_documents_by_relevance_and_keeps_the_top_n(served: Served) -> None:
    documents = ["Pages map memory.", "Paris is the capital of France.", "The sea is blue.", "France"]
    scores = httpx.post(f"{served.url}/score", json={"text_1": "France", "text_2": documents}).json()["data"]
    by_score = sorted(range(len(documents)), key=lambda i: -scores[i]["score"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": MODEL, "query": "France", "documents": documents, "top_n": 2}
        response = httpx.post(f"{served.url}{path}", json=body)
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [r["index"] for r in results] == by_score[:2]
        assert results[0]["document"] == {"text": documents[by_score[0]]}
        assert results[0]["relevance_score"] == pytest.approx(scores[by_score[0]]["score"], abs=1e-6)
    everything = httpx.post(f"{served.url}/rerank", json={"query": "France", "documents": documents}).json()
    assert [r["index"] for r in everything["results"]] == by_score  # the identical text ranks first
    assert everything["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": "a"}, None),
        ("/score", {"text_1": "a", "documents": ["b"]}, None),
        ("/score", {"text_1": "a", "text_2": []}, None),
        ("/score", {"text_1": "a", "text_2": "b", "instruction": "judge"}, "instruction"),
        ("/score", {"text_1": "a", "text_2": "word " * 400}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, None),
        ("/rerank", {"query": "", "documents": ["b"]}, "query"),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "chat_template_kwargs": {"x": 1}},
            "chat_template_kwargs",
        ),
    ],
)
def test_bad_score_and_rerank_requests_are_400s(
    served: Served, path: str, body: dict, param: str | None
) -> None:
    response = httpx.post(f"{served.url}{path}", json=body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert httpx.post(f"{served.url}{path}", json={**body, "model": "another"}).status_code in (400, 404)
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_truncation_cuts_each_text_before_it_is_embedded(served: Served) -> None:
    long = "word " * 400  # longer than the model's context
    cut = {"text_1": "word", "text_2": long, "truncate_prompt_tokens": 20}
    first = httpx.post(f"{served.url}/score", json=cut).json()
    assert first["usage"]["prompt_tokens"] == len(served.engine.tokenizer("word")["input_ids"]) + 20
    by_doc = httpx.post(
        f"{served.url}/score", json={**cut, "truncate_prompt_tokens": None, "max_tokens_per_doc": 20}
    )
    assert by_doc.json()["data"][0]["score"] == pytest.approx(first["data"][0]["score"], abs=1e-5)
    fits = httpx.post(f"{served.url}/score", json={**cut, "truncate_prompt_tokens": -1}).json()
    assert fits["usage"]["prompt_tokens"] == len(served.engine.tokenizer("word")["input_ids"]) + 255


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]
)
def test_a_drain_refuses_new_pooling_requests(served: Served, path: str) -> None:
    drain = Drain(build_app(served.engine, MODEL))
    bodies = {"embeddings": {"input": "x"}, "score": {"text_1": "a", "text_2": "b"}}
    body = bodies.get(path.rsplit("/", 1)[1], {"query": "a", "documents": ["b"]})
    with LiveServer(drain) as server:
        assert httpx.post(f"{server.url}{path}", json=body).status_code == 200
        drain.draining = True
        refused = httpx.post(f"{server.url}{path}", json=body)
    assert refused.status_code == 503 and refused.headers["retry-after"]
