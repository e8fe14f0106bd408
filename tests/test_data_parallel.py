"""Data parallelism: the prefix router's choices, then two engine processes behind one front
end giving the single engine's outputs, sending a shared prefix where it is cached and new
work where the load is least, and serving HTTP."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, LiveServer
from transformers import AutoModelForCausalLM

from vmkv import LLM, SamplingParams
from vmkv.engine import DataParallelLLM, EngineConfig
from vmkv.engine.data_parallel import PrefixRouter
from vmkv.server import EngineClient, build_app

BLOCK = 4


# --------------------------------------------------------------------------------- the router
def test_the_chain_keys_full_blocks_by_salt_and_everything_before_them() -> None:
    router = PrefixRouter(2, BLOCK, max_imbalance_tokens=8)
    a = router.chain(list(range(10)), None)
    assert len(a) == 2  # two full blocks; the last two tokens are not a block
    assert router.chain(list(range(10)), None) == a
    assert router.chain(list(range(8)) + [99, 98], None) == a  # the partial block does not count
    assert router.chain([0, 1, 2, 3, 9, 9, 9, 9], None)[0] == a[0]
    assert router.chain([0, 1, 2, 3, 9, 9, 9, 9], None)[1] != a[1]
    assert not set(router.chain(list(range(10)), "tenant")) & set(a)  # another salt shares nothing


def test_the_longest_remembered_prefix_wins_unless_its_replica_is_overloaded() -> None:
    router = PrefixRouter(3, BLOCK, max_imbalance_tokens=8)
    prompt = router.chain(list(range(12)), None)
    assert router.pick(prompt, [5, 3, 3]) == 1  # nothing remembered: least loaded, lowest index
    router.record(2, prompt[:1])
    router.record(0, prompt)
    # three blocks beat one while the holder's extra load is at most 8 + the 12 tokens it saves
    assert router.pick(prompt, [20, 0, 0]) == 0
    assert router.pick(prompt, [21, 0, 0]) == 1
    assert router.pick(prompt[:1], [4, 0, 2]) == 2  # an equal match: the less loaded holder
    assert router.pick(router.chain([7] * 12, None), [4, 0, 2]) == 1


def test_a_router_refuses_what_cannot_route() -> None:
    with pytest.raises(ValueError):
        PrefixRouter(0, BLOCK, 8)
    with pytest.raises(ValueError):
        DataParallelLLM(EngineConfig(), 0)
    with pytest.raises(ValueError, match="routing"):
        DataParallelLLM(EngineConfig(), 2, routing="random")


# ---------------------------------------------------------------------- two engine processes
@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> DataParallelLLM:
    config = EngineConfig(
        model=str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=128, block_size=BLOCK
    )
    llm = DataParallelLLM(config, 2)
    yield llm
    llm.shutdown()


def prompt_tokens(llm: DataParallelLLM) -> list[int]:
    return [s.prompt_tokens for s in llm.replica_stats()]


async def run(llm: DataParallelLLM, prompt: list[int]) -> list[int]:
    outputs = [out async for out in llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))]
    return outputs[-1].outputs[0].token_ids


def test_replicas_share_out_the_work_and_keep_a_prefix_where_it_is_cached(
    replicas: DataParallelLLM, tiny_model_dir: Path
) -> None:
    assert replicas.size == 2 and all(os.path.exists(f"/proc/{pid}") for pid in replicas.pids)
    shared = list(range(5, 37))  # 8 full blocks
    prompts = [shared + [40, 41], shared + [50, 51], list(range(60, 90))]
    single = LLM(str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=128)
    expected = [
        o.outputs[0].token_ids
        for o in single.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    ]
    single.engine.close()

    before = prompt_tokens(replicas)
    assert asyncio.run(run(replicas, prompts[0])) == expected[0]
    first = [a - b for a, b in zip(prompt_tokens(replicas), before, strict=True)]
    holder = first.index(max(first))
    hits_before = replicas.replica_stats()[holder].prefix_cache_hits
    assert asyncio.run(run(replicas, prompts[1])) == expected[1]  # the shared prefix: same replica
    assert replicas.replica_stats()[holder].prefix_cache_hits - hits_before == len(shared)

    async def together() -> list[list[int]]:  # in flight at once: the second goes where the load is not
        return await asyncio.gather(run(replicas, prompts[2]), run(replicas, [7] * 30))

    before = prompt_tokens(replicas)
    outputs = asyncio.run(together())
    assert outputs[0] == expected[2]
    assert all(a > b for a, b in zip(prompt_tokens(replicas), before, strict=True))
    total = replicas.stats()
    assert total.prompt_tokens == sum(prompt_tokens(replicas))
    assert total.kv_stats.prefix_cache_hits == sum(s.prefix_cache_hits for s in replicas.replica_stats())


def test_an_embedded_prompt_goes_where_its_embeddings_are_cached(
    replicas: DataParallelLLM, tiny_model_dir: Path
) -> None:
    prompt = list(range(100, 134))
    with torch.no_grad():
        embeds = AutoModelForCausalLM.from_pretrained(tiny_model_dir).get_input_embeddings()(
            torch.tensor(prompt)
        )
    expected = asyncio.run(run(replicas, prompt))
    before = [s.prefix_cache_hits for s in replicas.replica_stats()]
    assert asyncio.run(run(replicas, embeds)) == expected
    assert asyncio.run(run(replicas, embeds.clone())) == expected
    hits = [s.prefix_cache_hits - b for s, b in zip(replicas.replica_stats(), before, strict=True)]
    assert sorted(hits) == [0, 32]  # the second found the first's 4 full blocks: the same replica


def test_a_reset_forgets_every_replicas_prefixes_and_where_they_went(replicas: DataParallelLLM) -> None:
    prompt = list(range(140, 180))
    asyncio.run(run(replicas, prompt))
    assert asyncio.run(replicas.reset_prefix_cache()) >= 4
    assert not any(replicas.router.prefixes)
    hits = sum(s.prefix_cache_hits for s in replicas.replica_stats())
    asyncio.run(run(replicas, prompt))
    assert sum(s.prefix_cache_hits for s in replicas.replica_stats()) == hits


def test_every_replica_sleeps_and_wakes_together(replicas: DataParallelLLM) -> None:
    prompt = list(range(200, 230))
    expected = asyncio.run(run(replicas, prompt))

    async def scenario() -> None:
        await replicas.control("sleep", 1, "abort")
        assert await replicas.control("state") == {"paused": True, "asleep": ["kv_cache"]}
        assert all(s.memory.allocated_bytes == 0 for s in replicas.replica_stats())
        with pytest.raises(ValueError, match="level must be"):
            await replicas.control("sleep", 4, "abort")
        assert await replicas.control("wake_up", ["kv_cache"]) is True
        assert await replicas.control("state") == {"paused": False, "asleep": []}

    asyncio.run(scenario())
    assert asyncio.run(run(replicas, prompt)) == expected


def test_replicas_serve_http(replicas: DataParallelLLM) -> None:
    with LiveServer(build_app(EngineClient(replicas), MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=4, temperature=0.0)
        assert out.usage.completion_tokens == 4
        families = {
            f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        }
    # what the engines report comes per replica; what the front end measured, once
    queries = {s.labels["replica"]: s.value for s in families["vllm:prefix_cache_queries"].samples}
    assert queries == {str(r): s.prefix_cache_queries for r, s in enumerate(replicas.replica_stats())}
    assert [s.labels.get("replica") for s in families["vllm:generation_tokens"].samples] == [None]
    assert {s.labels["replica"] for s in families["vmkv:kv_cache_allocated_bytes"].samples} == {"0", "1"}
