"""Batch-1 speculative decoding, vLLM's CPU build against vmkv, measured the same way in each.

    # the peer, with its own environment (benchmarks/peers/bench_serve.py installs it):
    LD_PRELOAD=<venv>/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=4 \\
        <venv>/bin/python benchmarks/peers/bench_speculative_peer.py --engine vllm --model DIR [--spec JSON]
    # vmkv, with its own:
    .venv/bin/python benchmarks/peers/bench_speculative_peer.py --engine vmkv --model DIR [--compile]

Runs the requests of benchmarks/speculative_workloads.py one at a time (greedy, 128 tokens at
most, the chat template applied), twice each, and prints per workload the median milliseconds
per output token after the first: the wall time of the request less that of the same request
cut to one token, over its output tokens less one. --spec none runs without speculation. One
JSON line per run, so runs with and without speculation, and of each engine, can alternate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculative_workloads import workloads  # noqa: E402 - benchmarks/, beside this folder

DEFAULT_SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
)


def build(args: argparse.Namespace):  # noqa: ANN201 - the engine's own LLM and SamplingParams
    spec = None if args.spec == "none" else json.loads(args.spec)
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model, dtype="bfloat16", max_model_len=2048, speculative_config=spec)
        return llm, SamplingParams, {"use_tqdm": False}
    from vmkv.engine import LLM, SamplingParams

    return LLM(args.model, compile_model=args.compile, speculative_config=spec), SamplingParams, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "vmkv"], required=True)
    parser.add_argument("--model", required=True, help="a local checkpoint directory")
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="speculative_config JSON, or none")
    parser.add_argument("--compile", action="store_true", help="vmkv: the compiled decoder")
    args = parser.parse_args()
    llm, params_class, options = build(args)
    tokenizer = llm.get_tokenizer() if args.engine == "vllm" else llm.engine.tokenizer
    llm.generate(["Hi"], params_class(max_tokens=4), **options)
    result = {"engine": args.engine, "spec": args.spec, "compiled": args.compile}
    for name, texts in workloads().items():
        chats = [[{"role": "user", "content": text}] for text in texts]
        prompts = [
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats
        ]
        per_token = []
        for _ in range(2):
            for prompt in prompts:
                start = time.perf_counter()
                llm.generate([prompt], params_class(temperature=0, max_tokens=1), **options)
                first = time.perf_counter()
                out = llm.generate([prompt], params_class(temperature=0, max_tokens=128), **options)[0]
                end = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                per_token.append(((end - first) - (first - start)) * 1000 / max(1, n - 1))
        result[name] = round(statistics.median(per_token), 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
