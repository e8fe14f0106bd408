"""Pause and sleep: memory really goes back, nothing in flight is lost or changed, requests
that come meanwhile wait, and wrong calls change nothing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_engine import make_llm
from test_server import MODEL, LiveServer, start_engine

from vmkv.engine import LLM, AsyncLLM, RequestOutput, SamplingParams
from vmkv.engine.config import KV_MODES
from vmkv.engine.errors import ControlRefused
from vmkv.engine.sleep import release_weights, restore_weights
from vmkv.model.tiny import build_tiny_model
from vmkv.server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The capital of France is", "Once upon a time", list(range(5, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def released(cache: object) -> bool:
    """Whether a closed cache holds no KV memory any more: its pool tensor or driver is gone."""
    if hasattr(cache, "mapping"):  # vattention: every page unmapped and the driver closed
        return cache.mapping.driver.closed
    return cache.kv.numel() == 0


def run_control(llm: LLM, name: str, *args: object) -> tuple[object, BaseException | None, list]:
    """(result, error, outputs) of an engine control call answered at once."""
    answers: list = []
    outputs = llm.engine.control(name, args, lambda result, error: answers.append((result, error)))
    assert len(answers) == 1
    return *answers[0], outputs


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_sleep_gives_the_kv_memory_back_and_the_woken_engine_answers_alike(
    tiny_model_dir: Path, kv_mode: str
) -> None:
    llm = make_llm(tiny_model_dir, kv_mode)
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    hits = llm.engine.stats().prefix_cache_hits
    cache = llm.engine.cache
    llm.sleep(1)
    assert released(cache)
    stats = llm.engine.stats()
    assert stats.memory.allocated_bytes == 0 and stats.free_tokens == 0
    assert llm.engine.runner is not None  # level 1 on the CPU: the weights are host memory already
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    assert llm.wake_up() is True
    assert (
        llm.engine.cache is not cache and llm.engine.cache.free_capacity() == llm.engine.info.capacity_tokens
    )
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    # the cached prefixes went with the memory, and the counters did not go back
    assert llm.engine.stats().prefix_cache_hits == hits
    llm.close()


def test_level_2_drops_the_weights_and_reloads_them_from_the_checkpoint(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, "vattention")
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(2)
    assert llm.engine.asleep == {"kv_cache", "weights"}
    assert all(p.numel() == 0 for p in llm.engine.runner.model.parameters())
    assert llm.wake_up(["kv_cache"]) is False  # the weights still sleep: nothing runs yet
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    assert llm.wake_up(["weights"]) is True
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    llm.close()


@pytest.mark.parametrize("fp32_gemm", [True, False], ids=["fp32-gemm", "native-gemm"])
def test_level_2_refills_packed_weights_under_the_compiled_decoder(
    tiny_model_dir: Path, fp32_gemm: bool
) -> None:
    """bf16 linears packed beside their weights (oneDNN's opaque layout with fp32_gemm; the
    CPU's native form otherwise), read by compiled graphs that must see the reloaded values."""
    llm = make_llm(tiny_model_dir, "paged", dtype="bfloat16", fp32_gemm=fp32_gemm, compile_model=True)
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    forward = llm.engine.runner._forward
    llm.sleep(2)
    assert llm.wake_up() is True
    assert llm.engine.runner._forward is forward
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    llm.close()


def test_a_checkpoint_that_no_longer_fits_leaves_the_engine_asleep(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    llm = make_llm(tiny_model_dir)
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(2)
    llm.engine.runner.model_path = str(build_tiny_model(tmp_path / "wider", hidden_size=96))
    with pytest.raises(ControlRefused, match="the checkpoint's weight tensor 0 is"):
        llm.wake_up()
    assert llm.engine.asleep == {"kv_cache", "weights"}  # nothing changed: wake it up again
    llm.engine.runner.model_path = str(tiny_model_dir)
    assert llm.wake_up() is True
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    llm.close()


def test_wrong_calls_are_refused_and_change_nothing(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    for name, args, match in [
        ("sleep", (3, "abort"), "level must be"),
        ("sleep", (True, "abort"), "level must be"),
        ("sleep", (1, "later"), "mode must be"),
        ("pause", ("drop",), "mode must be"),
        ("wake_up", (["weights", "gpu"],), "unknown tags"),
        ("wake_up", ("weights",), "list of strings"),
        ("sleep", (), "unknown control call"),
        ("rewind", (), "unknown control call"),
    ]:
        result, error, _ = run_control(llm, name, *args)
        assert result is None and isinstance(error, ValueError) and match in str(error), (name, args)
        assert llm.engine.paused is None and not llm.engine.asleep
    llm.sleep(1)
    _, error, _ = run_control(llm, "resume")
    assert isinstance(error, ControlRefused) and "wake it up first" in str(error)
    with pytest.raises(ValueError, match="level must be"):
        llm.sleep(5)
    assert llm.wake_up(["scheduling"]) is False  # names nothing to restore
    assert llm.wake_up() is True and llm.generate(PROMPTS[:1], GREEDY)
    llm.close()


def start(llm: LLM) -> list[str]:
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"r{i}", prompt, GREEDY)
    llm.engine.step()  # every prompt is prefilled in one step: all three are in flight
    llm.engine.step()
    return [f"r{i}" for i in range(len(PROMPTS))]


def finish(llm: LLM) -> dict[str, RequestOutput]:
    done = {}
    while llm.engine.has_work():
        done |= {out.request_id: out for out in llm.engine.step() if out.finished}
        llm.engine.settle()
    return done


def test_abort_mode_ends_whats_in_flight_and_holds_what_comes_later(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    start(llm)
    result, error, aborted = run_control(llm, "sleep", 1, "abort")
    assert (result, error) == (None, None)
    assert sorted(out.request_id for out in aborted) == ["r0", "r1", "r2"]
    assert {out.outputs[0].finish_reason for out in aborted} == {"abort"}
    llm.engine.add_request("late", PROMPTS[0], GREEDY)  # held while asleep: no step runs it
    assert not llm.engine.has_work() and llm.engine.stats().num_waiting == 1
    assert llm.wake_up() is True
    assert tokens(finish(llm).values()) == expected[:1]
    llm.close()


def test_wait_mode_answers_once_the_requests_in_flight_are_done(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, "vattention")
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    ids = start(llm)
    answers: list = []
    llm.engine.control("sleep", (1, "wait"), lambda result, error: answers.append((result, error)))
    assert answers == [] and llm.engine.paused == "wait"
    done = finish(llm)
    assert answers == [(None, None)] and llm.engine.asleep == {"kv_cache"}
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    assert {done[i].outputs[0].finish_reason for i in ids} == {"length"}
    llm.wake_up()
    llm.close()


@pytest.mark.parametrize("kv_mode", ["paged", "vattention"])
def test_kept_requests_survive_a_sleep_and_recompute_the_same_tokens(
    tiny_model_dir: Path, kv_mode: str
) -> None:
    llm = make_llm(tiny_model_dir, kv_mode)
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    ids = start(llm)
    _, error, aborted = run_control(llm, "sleep", 1, "keep")
    assert error is None and aborted == []
    assert not llm.engine.has_work() and llm.engine.stats().num_waiting == len(ids)
    llm.engine.add_request("late", PROMPTS[1], GREEDY)
    assert llm.wake_up() is True
    done = finish(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    assert done["late"].outputs[0].token_ids == expected[1]
    llm.close()


def test_resuming_before_a_wait_is_done_fails_the_waiting_call(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    start(llm)
    answers: list = []
    llm.engine.control("pause", ("wait",), lambda result, error: answers.append((result, error)))
    assert answers == []
    result, error, _ = run_control(llm, "resume")
    assert error is None and isinstance(answers[0][1], ControlRefused)
    assert len(finish(llm)) == len(PROMPTS)
    llm.close()


class TiedModel(torch.nn.Module):
    """Storages shared (a tied head), strided (a transposed copy) and viewed at an offset."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.proj.weight = torch.nn.Parameter(self.proj.weight.data.t().contiguous().t())
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(3.0)[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(x)) * self.scale[1])


def test_offloaded_weights_are_let_go_of_and_come_back_unchanged() -> None:
    torch.manual_seed(0)
    model = TiedModel()
    x = torch.arange(5)
    expected = model(x)
    released = release_weights(model, offload=True)
    assert len(released.slots) == 4  # the tied weight once
    assert all(p.numel() == 0 for p in model.parameters()) and model.scale is None
    restore_weights(released, torch.device("cpu"))
    assert torch.equal(model(x), expected)
    assert torch.equal(model.scale, torch.tensor([1.0, 2.0]))
    assert model.head.weight is model.embed.weight


def test_the_async_engine_sleeps_between_steps_and_holds_new_requests(tiny_model_dir: Path) -> None:
    llm = AsyncLLM(model=str(tiny_model_dir), kv_mode="paged", dtype="float32", max_model_len=128)

    async def last(prompt: str) -> RequestOutput:
        async for out in llm.generate(prompt, GREEDY):
            final = out
        return final

    async def scenario() -> None:
        expected = await last(PROMPTS[0])
        await llm.control("sleep", 1, "abort")
        assert await llm.control("state") == {"paused": True, "asleep": ["kv_cache"]}
        late = asyncio.ensure_future(last(PROMPTS[0]))
        await asyncio.sleep(0.2)
        assert not late.done()
        with pytest.raises(ValueError, match="level must be"):
            await llm.control("sleep", 9, "abort")
        assert await llm.control("wake_up", None) is True
        assert (await late).outputs[0].token_ids == expected.outputs[0].token_ids

    try:
        asyncio.run(scenario())
    finally:
        llm.shutdown()


def metric(http: httpx.Client, name: str) -> float:
    """The value of vmkv's gauge `name` in /metrics."""
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith(f"vmkv:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_the_sleep_routes_over_http(tiny_model_dir: Path) -> None:
    engine = start_engine(str(tiny_model_dir), "vattention")
    try:
        with LiveServer(build_app(engine, MODEL)) as plain:
            assert httpx.post(f"{plain.url}/sleep").status_code == 404  # only with --enable-sleep-mode
        with LiveServer(build_app(engine, MODEL, enable_sleep_mode=True)) as server:
            http = httpx.Client(base_url=server.url, timeout=30)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

            def complete() -> str:
                return (
                    client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
                    .choices[0]
                    .text
                )

            expected = complete()
            assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            assert http.get("/is_paused").json() == {"is_paused": True}
            assert metric(http, "engine_sleep_level") == 1.0 and metric(http, "engine_paused") == 1.0
            assert metric(http, "kv_cache_allocated_bytes") == 0.0
            bad = http.post("/sleep", params={"level": 7})
            assert bad.status_code == 400 and "level must be" in bad.json()["error"]["message"]
            assert http.post("/sleep", params={"mode": "soon"}).status_code == 400
            conflict = http.post("/resume")
            assert conflict.status_code == 409 and "wake it up first" in conflict.json()["error"]["message"]
            late: list[str] = []
            waiting = threading.Thread(target=lambda: late.append(complete()))
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive()  # held while the engine sleeps
            assert http.get("/health").status_code == 200
            woken = http.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])
            assert woken.json() == {"status": "awake", "tags": ["weights", "kv_cache"]}
            waiting.join(30)
            assert late == [expected]
            assert http.get("/is_sleeping").json() == {"is_sleeping": False}
            assert metric(http, "engine_sleep_level") == 0.0 and metric(http, "engine_paused") == 0.0
            assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
            assert http.post("/resume").json() == {"status": "resumed"}
            assert complete() == expected
    finally:
        engine.shutdown()
