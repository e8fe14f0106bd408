"""Tensor parallelism on one machine: what crosses between the ranks each step, and what it costs.

    python benchmarks/bench_tensor_parallel.py                         # default model, TP=3
    python benchmarks/bench_tensor_parallel.py --tiny --tensor-parallel-size 2
    python benchmarks/bench_tensor_parallel.py --kv-mode vattention    # any KV layout (default paged)
    python benchmarks/bench_tensor_parallel.py --collectives            # the two collectives alone

The same greedy workload (`requests` random prompts submitted at once) runs on one rank and
on N (gloo, one torch thread per rank). Per target: step count, mean step time, and for N
ranks the step message rank 0 broadcasts (mean and largest pickled size, mean send time) and
the all-reduce payload per step (2 per layer of [tokens, hidden], computed). It checks that
the N-rank outputs equal the one-rank ones. The default model's 9 heads and 3 KV heads divide
by 3, not 2.

--collectives times, between two otherwise idle gloo ranks on this machine, the two things
that cross between ranks in a decode step of `requests` sequences: one step message (as
rank 0 sends it: contexts of prompt_len tokens, 16-token blocks) and one all-reduce of the
[requests, hidden] fp32 hidden states (a step makes two per layer).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig

from vmkv.distributed import channel
from vmkv.distributed.messages import PagedStep, StepMessage
from vmkv.distributed.sharding import kv_storage_bytes
from vmkv.engine import LLM, SamplingParams
from vmkv.model.store import resolve_model
from vmkv.model.tiny import build_tiny_model


def run(args: argparse.Namespace, model: str, prompts: list[list[int]], tp: int) -> dict:
    llm = LLM(
        model,
        kv_mode=args.kv_mode,
        dtype="float32",
        num_threads=1,
        kv_budget_bytes=args.kv_budget_mib << 20,
        max_model_len=args.prompt_len + args.output_len,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(args.requests, 512),
        tensor_parallel_size=tp,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        engine = llm.engine
        steps = engine.stats().num_steps
        result = {
            "tokens": [out.outputs[0].token_ids for out in outputs],
            "steps": steps,
            "step_ms": 1e3 * seconds / steps,
        }
        if engine.tp is not None:
            sent = engine.tp.stats
            result |= {
                "message_bytes_mean": sent.message_bytes / sent.steps,
                "message_bytes_max": sent.largest_message_bytes,
                "send_us_mean": 1e6 * sent.send_seconds / sent.steps,
                "kv_bytes_per_rank": engine.tp.kv_bytes_per_rank(),
            }
        else:
            result["kv_bytes_per_rank"] = [kv_storage_bytes(engine.cache)]
        return result
    finally:
        llm.close()


def decode_message(batch: int, context: int, block_size: int = 16) -> StepMessage:
    """A decode step of `batch` sequences of `context` tokens, with block ids scattered as in a busy cache."""
    rng = random.Random(0)
    blocks = -(-(context + 1) // block_size)
    tables = [[rng.randrange(20000) for _ in range(blocks)] for _ in range(batch)]
    rows = [t[context // block_size] * block_size + context % block_size for t in tables]
    return StepMessage(
        [],
        [(i, context, 1) for i in range(batch)],
        PagedStep(tables, rows),
        [rng.randrange(49152) for _ in range(batch)],
        [context] * batch,
    )


def time_collectives(rank: int, args: argparse.Namespace, port: int, out: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    message = decode_message(args.requests, args.prompt_len)
    hidden = torch.randn(args.requests, args.hidden_size)
    rounds = 200
    for _ in range(2):  # the first round warms up
        start = time.perf_counter()
        for _ in range(rounds):
            size = channel.send(message, None) if rank == 0 else channel.receive(None)
        send_seconds = (time.perf_counter() - start) / rounds
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(hidden)
        reduce_seconds = (time.perf_counter() - start) / rounds
    if rank == 0:
        out.put(
            {
                "decode_batch": args.requests,
                "context": args.prompt_len,
                "message_bytes": size,
                "message_us": 1e6 * send_seconds,
                "all_reduce_bytes": hidden.numel() * 4,
                "all_reduce_us": 1e6 * reduce_seconds,
            }
        )
    dist.destroy_process_group()


def collectives(args: argparse.Namespace) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(time_collectives, args=(args, port, out), nprocs=2)
    return out.get()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="default: 3, or 2 with --tiny")
    parser.add_argument("--kv-mode", choices=["paged", "contiguous", "vattention"], default="paged")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-budget-mib", type=int, default=256)
    parser.add_argument("--collectives", action="store_true", help="time one step message and one all-reduce")
    parser.add_argument("--hidden-size", type=int, default=576, help="--collectives: the all-reduce's width")
    args = parser.parse_args()
    if args.collectives:
        print(json.dumps(collectives(args), indent=2))
        return
    tp = args.tensor_parallel_size or (2 if args.tiny else 3)
    model = build_tiny_model(tempfile.mkdtemp()) if args.tiny else resolve_model("SmolLM2-135M-Instruct")
    config = AutoConfig.from_pretrained(model, local_files_only=True)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    one, many = run(args, str(model), prompts, 1), run(args, str(model), prompts, tp)
    tokens = args.requests * (args.prompt_len + args.output_len - 1)  # the last token is never run
    all_reduce_bytes = 2 * config.num_hidden_layers * tokens * config.hidden_size * 4  # fp32
    report = {
        "model": str(model.name),
        "tensor_parallel_size": tp,
        "outputs_equal": one.pop("tokens") == many.pop("tokens"),
        "all_reduce_bytes_per_step_mean": all_reduce_bytes / many["steps"],
        "tp1": one,
        f"tp{tp}": many,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
