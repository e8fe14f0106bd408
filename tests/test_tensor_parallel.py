"""Tensor parallelism over gloo, every rank its own process: TP=2 gives TP=1's greedy fp32 outputs
in every KV layout with preemption, prefix hits, copy-on-write and swap forced, from one KV
manager whose decisions the other rank repeats on half the KV bytes; configurations that would
cut a head are refused; a killed rank, or one stopped without exiting, fails its requests with a
clear error, the server answers 503 and no process is left behind. In one process, the KV
contract's state machine drives rank 0's recording cache while a replica fed its log must hold
the very same KV after every step."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from attention_reference import reference_attention
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_engine_process import alive, children, free_port, vmkv_serve, wait_until
from test_kv_contract import MAX_LEN, Q_HEADS, SCALE, SHAPE, ContractLifecycle, build
from vmkv.paging import PagedKVCache

from vmkv.contiguous import ContiguousKVCache
from vmkv.distributed.errors import TensorParallelConfigError
from vmkv.distributed.messages import StepMessage
from vmkv.distributed.recording import RecordingContiguousKVCache, RecordingPagedKVCache
from vmkv.distributed.recording_vattention import RecordingVAttentionKVCache
from vmkv.distributed.replica import VATTENTION_FOLLOWER, Replica
from vmkv.distributed.sharding import check_divides, kv_storage_bytes
from vmkv.engine import LLM, AsyncProcessLLM, EngineConfig, EngineDead, RequestRejected, SamplingParams
from vmkv.engine.llm_engine import EngineStats
from vmkv.kv_cache import SeqStep
from vmkv.model.store import load_model
from vmkv.vattention import VAttentionKVCache

# 4 attention heads and 2 KV heads (tests/conftest.py's tiny Llama): both divide by 2
BASE = {"dtype": "float32", "num_threads": 1, "max_num_seqs": 8, "max_num_batched_tokens": 64}
# budgets small enough that the six requests below preempt one another
CASES = {
    "paged-recompute": {"kv_mode": "paged", "preemption_mode": "recompute", "block_size": 8,
                        "kv_budget_bytes": 80 << 10, "max_model_len": 128},
    "paged-swap": {"kv_mode": "paged", "preemption_mode": "swap", "block_size": 8,
                   "kv_budget_bytes": 80 << 10, "max_model_len": 128},
    "contiguous-swap": {"kv_mode": "contiguous", "preemption_mode": "swap",
                        "kv_budget_bytes": 256 << 10, "max_model_len": 256},
    "vattention-recompute": {"kv_mode": "vattention", "preemption_mode": "recompute", "page_size": 4096,
                             "kv_budget_bytes": 80 << 10, "max_model_len": 128},
    "vattention-swap": {"kv_mode": "vattention", "preemption_mode": "swap", "page_size": 4096,
                        "kv_budget_bytes": 80 << 10, "max_model_len": 128},
}  # fmt: skip
SHARED = list(range(5, 22))  # a shared prompt prefix: two full blocks of 8 hit the prefix cache
PROMPTS = [SHARED + [30 + i] * (i + 2) for i in range(6)]
# n = 2 forks a request's prompt: copy-on-write of its last block (paged), a slot copy (contiguous)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=1 + i % 2) for i in range(6)]


@dataclass
class Run:
    tokens: list[list[list[int]]]  # request -> sample -> token ids
    stats: EngineStats
    kv_bytes: list[int]  # per rank
    messages: int  # steps sent to the other ranks
    embeddings: list[list[float]]  # LLM.embed of two prompts, after the generations


def run(model: Path, case: dict, tensor_parallel_size: int, **options: object) -> Run:
    llm = LLM(str(model), **BASE, **case, tensor_parallel_size=tensor_parallel_size, **options)
    try:
        if tensor_parallel_size > 1:  # the workers read token ids: a prompt of embeddings has none
            with pytest.raises(RequestRejected, match="tensor parallelism"):
                llm.generate([torch.zeros(4, llm.engine.info.hidden_size)], PARAMS[0])
        outputs = llm.generate(PROMPTS, PARAMS)
        engine = llm.engine
        tp = engine.tp
        stats = engine.stats()
        return Run(
            [[sample.token_ids for sample in out.outputs] for out in outputs],
            stats,
            [kv_storage_bytes(engine.cache)] if tp is None else tp.kv_bytes_per_rank(),
            0 if tp is None else tp.stats.steps,
            llm.embed(PROMPTS[:2], pooling="mean"),
        )
    finally:
        llm.close()


@pytest.fixture(scope="module", params=list(CASES))
def runs(request: pytest.FixtureRequest, tiny_model_dir: Path) -> tuple[Run, Run]:
    case = CASES[request.param]
    return run(tiny_model_dir, case, 1), run(tiny_model_dir, case, 2)


def test_two_ranks_give_one_rank_s_greedy_outputs_under_preemption(runs: tuple[Run, Run]) -> None:
    one, two = runs
    assert one.stats.num_preemptions > 0, "the budget should force preemption"
    assert two.tokens == one.tokens
    # the hidden states the ranks' sums assemble pool to the one rank's embeddings
    assert torch.allclose(torch.tensor(two.embeddings), torch.tensor(one.embeddings), atol=1e-5)


def test_the_kv_manager_decides_once_and_the_other_rank_follows(runs: tuple[Run, Run]) -> None:
    one, two = runs
    kv_one, kv_two = one.stats.kv_stats, two.stats.kv_stats
    # every step reached the other rank in one message
    assert two.messages == two.stats.num_steps
    if kv_one.unit == "page":
        # a rank's page of half the KV heads holds twice the tokens, so vattention's decisions at
        # TP=2 are not TP=1's: they are made once, on rank 0, and this workload makes all kinds
        assert two.stats.num_preemptions > 0, "the budget should force preemption at TP=2 too"
        assert kv_two.prefix_cache_hits > 0 and kv_two.fork_shared_pages > 0 and kv_two.fork_copied_pages > 0
        assert (kv_two.swap_out_bytes > 0) == (one.stats.kv_stats.swap_out_bytes > 0)
        return
    # rank 0's cache made exactly the one-rank engine's decisions ...
    assert two.stats.num_preemptions == one.stats.num_preemptions
    assert kv_two.units_total == kv_one.units_total and kv_two.units_peak == kv_one.units_peak
    if kv_one.unit == "block":
        assert kv_one.prefix_cache_hits > 0 and kv_one.cow_copies > 0, "the workload should share blocks"
        assert (kv_two.prefix_cache_hits, kv_two.cow_copies) == (kv_one.prefix_cache_hits, kv_one.cow_copies)
    # ... moving half the bytes, since it holds half the KV heads
    assert kv_two.swap_out_bytes * 2 == kv_one.swap_out_bytes


def test_each_rank_holds_half_the_kv_bytes(runs: tuple[Run, Run]) -> None:
    one, two = runs
    [whole] = one.kv_bytes
    assert two.kv_bytes == [whole // 2, whole // 2]


def test_a_rank_started_apart_joins_through_the_rendezvous(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on another machine: the worker is started by hand with torchrun's variables only,
    before rank 0 exists, and finds the group and the engine's config through the TCP store."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")
    worker = subprocess.Popen([sys.executable, "-m", "vmkv.distributed.worker"], env=env)
    try:
        case = CASES["paged-recompute"]
        two = run(tiny_model_dir, case, 2, tensor_parallel_local_ranks=1)
        assert worker.wait(timeout=30) == 0, "the worker should stop when rank 0 closes"
    finally:
        if worker.poll() is None:
            worker.kill()
    assert two.tokens == run(tiny_model_dir, case, 1).tokens


def test_ranks_started_apart_need_a_known_rendezvous(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="set MASTER_ADDR .* and MASTER_PORT"):
        LLM(
            str(tiny_model_dir),
            **BASE,
            kv_mode="paged",
            tensor_parallel_size=2,
            tensor_parallel_local_ranks=1,
        )


def test_a_split_that_would_cut_a_head_is_refused_naming_the_model_s_counts(tiny_model_dir: Path) -> None:
    config = load_model(tiny_model_dir).config
    check_divides(config, 2)
    with pytest.raises(TensorParallelConfigError, match="4 attention heads, 2 KV heads and 128 MLP columns"):
        check_divides(config, 4)
    with pytest.raises(TensorParallelConfigError, match="must divide the model's 4 attention heads"):
        LLM(str(tiny_model_dir), **BASE, kv_mode="paged", tensor_parallel_size=4)  # refused before any worker


def test_modes_without_tensor_parallelism_are_refused_up_front() -> None:
    EngineConfig(kv_mode="vattention", tensor_parallel_size=2)  # every layout runs
    with pytest.raises(ValueError, match="compile_model"):
        EngineConfig(kv_mode="paged", compile_model=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(kv_mode="paged", tensor_parallel_size=0)


# ------------------------------------------------------------------- the log, in one process


class ReplicatedLifecycle(ContractLifecycle):
    """The contract's random lifecycles on rank 0's recording cache; after each step a replica
    applies the log, plans the step itself and attends with the same new K/V: its attention
    must match the reference and its storage must equal rank 0's, bit for bit (vattention:
    every resident sequence's computed tokens, since a page rank 0 gave back to the OS reads
    zero there and stale on the replica until written)."""

    @initialize(layout=st.sampled_from(["paged", "contiguous", "vattention"]), option=st.integers(0, 7))
    def start(self, layout: str, option: int) -> None:
        if layout == "paged":  # the contract test's paged sizes, with and without prefix caching
            args = (SHAPE, MAX_LEN, 20 * 8 * SHAPE.bytes_per_token)
            options = {"block_size": 8, "enable_prefix_caching": option % 2 == 1, "model_id": "m"}
            self.cache, follower = RecordingPagedKVCache(*args, **options), PagedKVCache(*args, **options)
        elif layout == "vattention":  # the contract test's variants (orders, sharing, reclamation)
            variant = build(layout, option)
            args = (SHAPE, MAX_LEN, variant.pool.num_sets * variant.geometry.page_set_bytes)
            config = variant.config
            variant.close()
            self.cache = RecordingVAttentionKVCache(*args, config=config, model_id="m")
            follower = VAttentionKVCache(*args, config=config, model_id="m", **VATTENTION_FOLLOWER)
        else:
            args = (SHAPE, MAX_LEN, 3 * MAX_LEN * SHAPE.bytes_per_token)
            self.cache, follower = RecordingContiguousKVCache(*args), ContiguousKVCache(*args)
        self.replica = Replica(follower)
        self.capacity = self.cache.free_capacity()
        self.salts = {}
        self.history = []

    def run_step(self, data: st.DataObject, chosen: set[int] | None = None) -> list[SeqStep]:
        """Every step rank 0 runs (the step and decode_step rules), replayed on the replica."""
        steps = super().run_step(data, chosen)
        if self.cache.log.step is None:  # nothing was pending: no step ran
            return steps
        self.replicate_step()
        return steps

    def replicate_step(self) -> None:
        ops, steps, layout = self.cache.log.take()
        self.replica.apply(ops)
        plan = self.replica.plan(StepMessage(ops, steps, layout, [], []))
        seq_steps = [SeqStep(*s) for s in steps]
        tokens = sum(s.num_new for s in seq_steps)
        for layer in range(SHAPE.num_layers):
            # the contract's K/V are a function of the prefix, and computed now counts these tokens
            new = torch.cat(
                [self.truth(s.seq_id, layer, s.context_len, s.num_cached) for s in seq_steps], dim=1
            )
            q = torch.randn(tokens, Q_HEADS, SHAPE.head_dim, generator=self.gen)
            out = self.replica.cache.attend(layer, q, new[0].contiguous(), new[1].contiguous(), plan, SCALE)
            contexts = [self.truth(s.seq_id, layer, s.context_len) for s in seq_steps]
            ref = reference_attention(q, [c[0] for c in contexts], [c[1] for c in contexts], seq_steps, SCALE)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
        if isinstance(self.cache, VAttentionKVCache):  # what its sequences hold (free pages may differ)
            views = zip(self.cache.mapping.tensors(), self.replica.cache.mapping.tensors(), strict=True)
            for mine, theirs in views:
                for seq_id in self.resident():
                    slot, computed = self.cache.seqs[seq_id].slot, self.computed[seq_id]
                    assert torch.equal(theirs[slot, :computed], mine[slot, :computed])
        else:
            assert torch.equal(self.replica.cache.kv, self.cache.kv)

    # Speculative decoding is refused with tensor parallelism (EngineConfig): the ranks' caches
    # never truncate, so the contract's truncating rules are not theirs.
    speculative_step = None
    drop_reserved = None

    def teardown(self) -> None:
        super().teardown()
        if self.cache is not None:
            self.replica.cache.close()


ReplicatedLifecycle.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_a_replica_fed_rank_0_s_log_holds_rank_0_s_kv = pytest.mark.usefixtures("one_torch_thread")(
    ReplicatedLifecycle.TestCase
)


# ----------------------------------------------------------------------------- a rank that dies


# a rank that stops without exiting is taken as hung after this many seconds without a heartbeat
HUNG_TIMEOUT = 3.0
LOSSES = {  # how a rank is lost -> what the error says of it
    "killed": (signal.SIGKILL, "exited (killed by signal 9)"),
    "stopped": (signal.SIGSTOP, "stopped responding: no heartbeat for"),
}


@pytest.mark.parametrize(
    ("engine_process", "loss"),
    [(True, "killed"), (False, "killed"), (True, "stopped")],
    ids=["engine-process-killed", "engine-thread-killed", "engine-process-stopped"],
)
def test_losing_a_rank_fails_its_requests_and_the_server_answers_503(
    tiny_model_dir: Path, engine_process: bool, loss: str
) -> None:
    """Killed, or stopped without exiting (SIGSTOP): a stopped rank is noticed by its silent
    heartbeat within the timeout, killed, and reported as hung, not after the group's timeout."""
    how, said = LOSSES[loss]
    flags = ["--kv-mode", "paged", "--tensor-parallel-size", "2", "--max-model-len", "2048"]
    flags += ["--tensor-parallel-timeout", str(HUNG_TIMEOUT)]
    flags += [] if engine_process else ["--no-engine-process"]
    with vmkv_serve(tiny_model_dir, *flags) as (process, url), httpx.Client(base_url=url, timeout=60) as http:
        # rank 0 is the engine process, or the server's own process when the engine is a thread
        [rank_0] = children(process.pid) if engine_process else [process.pid]
        [worker] = children(rank_0)
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        os.kill(worker, how)
        reader.join(timeout=60)
        assert not reader.is_alive(), "the stream should end, not hang"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and f"tensor-parallel rank 1 (pid {worker}) {said}" in error["message"], (
            error
        )
        refused = http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503
        assert "tensor-parallel rank 1" in refused.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        if engine_process:
            wait_until(lambda: not alive(rank_0), 30, "the engine should stop once a rank is gone")
        wait_until(lambda: not alive(worker), 30, "a stopped rank should not be left behind")


def test_killing_rank_0_takes_the_workers_along(tiny_model_dir: Path) -> None:
    engine = AsyncProcessLLM(model=str(tiny_model_dir), **BASE, kv_mode="paged", tensor_parallel_size=2)
    try:
        [worker] = children(engine.pid)

        async def generate() -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outputs = [out async for out in engine.generate([5, 6, 7], params)]
            return outputs[-1].outputs[0].token_ids

        assert len(asyncio.run(generate())) == 8
        os.kill(engine.pid, signal.SIGKILL)
        wait_until(lambda: not alive(worker), 30, "the worker outlived its rank 0")
        with pytest.raises(EngineDead):
            asyncio.run(generate())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_rank_lost_while_the_engine_is_idle_stops_it_with_that_reason(
    tiny_model_dir: Path, loss: str
) -> None:
    how, said = LOSSES[loss]
    engine = AsyncProcessLLM(
        model=str(tiny_model_dir),
        **BASE,
        kv_mode="paged",
        tensor_parallel_size=2,
        tensor_parallel_timeout=HUNG_TIMEOUT,
    )
    try:
        [worker] = children(engine.pid)
        os.kill(worker, how)
        wait_until(lambda: engine.dead_reason is not None, 30, "an idle engine should notice a lost rank")
        assert f"tensor-parallel rank 1 (pid {worker}) {said}" in engine.dead_reason
        wait_until(lambda: not alive(engine.pid), 30, "the engine should stop once a rank is gone")
        wait_until(lambda: not alive(worker), 30, "a stopped rank should not be left behind")
    finally:
        engine.shutdown()
