"""Peers measured in the same run as our engine, on the same model and the same requests.

transformers' own continuous batching is always there: this drives the manager that
`generate_batch` wraps, adding requests one by one so that each keeps its own output
length and arrival time (generate_batch takes one max_new_tokens for all and submits
everything at once). Its KV cache gets the same byte budget and batch limits as ours.
Serving engines are peers over HTTP instead: the online benchmark targets any URL.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput

from vmkv.bench.metrics import RequestRecord
from vmkv.bench.offline import RunOutcome, Target
from vmkv.bench.workloads import Workload
from vmkv.engine import EngineConfig
from vmkv.model.store import load_model, resolve_model

TRANSFORMERS = "transformers"
TRANSFORMERS_PAGE_TOKENS = 256  # tokens per block in its cache (ContinuousBatchingConfig.page_size)
POLL_SECONDS = 0.005  # how long one wait for a result blocks before new arrivals are checked


def transformers_target(config: EngineConfig) -> Target:
    """transformers continuous batching with `config`'s model, dtype, KV budget and batch limits."""

    return Target(TRANSFORMERS, lambda workload: run_transformers(config, workload))


def run_transformers(config: EngineConfig, workload: Workload) -> RunOutcome:
    """Run the workload through a fresh manager after one warm-up request, as our engine gets."""
    ns = {r.n for r in workload.requests}
    if len(ns) != 1:
        raise ValueError("transformers continuous batching takes one n for all requests of a run")
    n = ns.pop()
    model = load_model(resolve_model(config.model), dtype=config.torch_dtype, attn_implementation="sdpa")
    model.to(config.device)
    generation = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in workload.requests),
        do_sample=n > 1,
        num_return_sequences=n,
        eos_token_id=-1,  # ignore_eos: every request produces exactly its max tokens
        pad_token_id=0,
    )
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=_batching_config(config, model.config, workload.max_seq_len * n),
        block=True,
        warmup=False,
    ) as manager:
        manager.add_request(list(range(1, 9)), request_id="warm-up", max_new_tokens=2)
        warm_up_samples = n  # every sample of the warm-up answers on its own: drain them all
        while warm_up_samples:
            warm_up_samples -= _next_result(manager) is not None
        return _drive(manager, workload, n)


def _batching_config(config: EngineConfig, hf: PretrainedConfig, longest: int) -> ContinuousBatchingConfig:
    """Our KV byte budget (but at least room for the longest request) and our batch limits."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
    bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * itemsize
    num_blocks = max(
        config.kv_budget_bytes // (TRANSFORMERS_PAGE_TOKENS * bytes_per_token),
        -(-longest // TRANSFORMERS_PAGE_TOKENS) + 1,
    )
    return ContinuousBatchingConfig(
        page_size=TRANSFORMERS_PAGE_TOKENS,
        num_blocks=num_blocks,
        max_batch_tokens=config.max_num_batched_tokens,
        max_requests_per_batch=config.max_num_seqs,
    )


def _next_result(manager: ContinuousBatchingManager) -> GenerationOutput | None:
    result = manager.get_result(timeout=POLL_SECONDS)
    if result is None and not manager.is_running():
        raise RuntimeError("transformers' generation thread stopped before finishing the workload")
    return result


def _drive(manager: ContinuousBatchingManager, workload: Workload, n: int) -> RunOutcome:
    """Add each request at its arrival time; a request is done when all its n samples are."""
    requests = workload.requests
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    records = [RequestRecord(r.prompt_len, 0, r.arrival, n=r.n) for r in requests]
    running = {str(i): n for i in range(len(records))}  # request -> samples not finished
    submitted = 0
    t0 = time.perf_counter()
    while running:
        now = time.perf_counter() - t0
        while submitted < len(order) and requests[order[submitted]].arrival <= now:
            i = order[submitted]
            manager.add_request(
                list(requests[i].prompt_ids),
                request_id=str(i),
                max_new_tokens=requests[i].max_tokens,
                record_timestamps=True,
            )
            submitted += 1
        result = _next_result(manager)
        if result is None:
            continue
        request_id, _, child = result.request_id.partition("__child#")
        record = records[int(request_id)]
        if result.error is not None:
            record.error = str(result.error)
        record.output_tokens += len(result.generated_tokens)
        stamps = [ts - t0 for ts in result.timestamps or []]
        if not child:  # the parent's tokens time the stream
            record.chunk_times = stamps
        record.end = max(record.end or 0.0, stamps[-1] if stamps else time.perf_counter() - t0)
        running[request_id] -= 1
        if not running[request_id]:
            del running[request_id]
    return RunOutcome(records, time.perf_counter() - t0)
