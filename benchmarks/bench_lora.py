"""What serving LoRA adapters costs, offline, against the same engine without them.

    python benchmarks/bench_lora.py [--model DIR] [--kv-mode paged] [--rank 16] [--prompts 32]
                                    [--prompt-tokens 128] [--max-tokens 64] [--rounds 3] [--compile]

Four targets over two engines in one process: `off` (LoRA not enabled), and on an engine with
`enable_lora` and max_loras 2: `enabled` (no request names an adapter: the price of enabling),
`one` (every request with one adapter), `two` (half with each of two adapters, so most steps
run both). The adapters are random, of rank --rank on every linear of the decoder (q, k, v, o,
gate, up, down): the most an adapter adds. Each round runs every target once, in a new order
each round (A B C D, B C D A, ...); printed are medians over rounds of a wave's output tokens
per second (--prompts prompts of --prompt-tokens tokens, --max-tokens out each, greedy) and of
batch-1 decode milliseconds per token (one prompt, 64 tokens out), as a Markdown table with
each target's ratio to `off`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from vmkv.engine import LLM, LoRARequest, SamplingParams
from vmkv.model.store import DEFAULT_MODEL, resolve_model
from vmkv.model.tiny import build_random_lora

TARGETS = ("off", "enabled", "one", "two")
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DECODE_TOKENS = 64


def wave(llm: LLM, prompts: list[list[int]], max_tokens: int, loras: list[LoRARequest | None]) -> float:
    """Output tokens per second of the prompts run together."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    return sum(len(out.outputs[0].token_ids) for out in outputs) / (time.perf_counter() - start)


def decode_ms(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> float:
    """Batch-1 milliseconds per decoded token: DECODE_TOKENS out, less a one-token run."""
    times = []
    for max_tokens in (1, DECODE_TOKENS):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, lora_request=lora)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) * 1000 / (DECODE_TOKENS - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-mode", default="paged")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    options = {"kv_mode": args.kv_mode, "dtype": args.dtype, "compile_model": args.compile}
    with tempfile.TemporaryDirectory() as root:
        first, second = (
            LoRARequest(
                name,
                seed,
                str(build_random_lora(model, Path(root) / name, args.rank, targets=ALL_LINEARS, seed=seed)),
            )
            for seed, name in ((1, "first"), (2, "second"))
        )
        # a wave's prompts share no prefix: the prefix cache must not do the work
        prompts = [[1000 + i] + list(range(2000, 2000 + args.prompt_tokens - 1)) for i in range(args.prompts)]
        engines = {
            "off": LLM(model, enable_prefix_caching=False, **options),
            "on": LLM(model, enable_prefix_caching=False, enable_lora=True, max_loras=2, **options),
        }
        half = args.prompts // 2
        runs = {
            "off": (engines["off"], [None] * args.prompts, None),
            "enabled": (engines["on"], [None] * args.prompts, None),
            "one": (engines["on"], [first] * args.prompts, first),
            "two": (engines["on"], [first] * half + [second] * (args.prompts - half), first),
        }
        for llm, loras, lora in runs.values():  # warm-up: first calls, adapters loaded
            wave(llm, prompts[:2], 4, loras[:2])
            decode_ms(llm, prompts[0], lora)
        results: dict[str, dict[str, list[float]]] = {t: {"tok_s": [], "ms": []} for t in TARGETS}
        for round_index in range(args.rounds):
            order = TARGETS[round_index % len(TARGETS) :] + TARGETS[: round_index % len(TARGETS)]
            for target in order:
                llm, loras, lora = runs[target]
                results[target]["tok_s"].append(wave(llm, prompts, args.max_tokens, loras))
                results[target]["ms"].append(decode_ms(llm, prompts[0], lora))
                print(f"round {round_index + 1} {target}: {results[target]['tok_s'][-1]:.1f} tok/s, "
                      f"{results[target]['ms'][-1]:.2f} ms/token", flush=True)  # fmt: skip
    base = {key: statistics.median(values) for key, values in results["off"].items()}
    decoder = "compiled" if args.compile else "eager"
    shape = f"{args.prompts} x {args.prompt_tokens}/{args.max_tokens}, medians of {args.rounds} rounds"
    print(f"\n{args.kv_mode}, {args.dtype}, {decoder}, rank {args.rank}, {shape}\n")
    print("| target | wave out tok/s | vs off | batch-1 decode ms/token | vs off |")
    print("|---|---:|---:|---:|---:|")
    for target in TARGETS:
        tok_s, ms = (statistics.median(results[target][key]) for key in ("tok_s", "ms"))
        print(
            f"| {target} | {tok_s:.1f} | {tok_s / base['tok_s']:.2f}x | {ms:.2f} | {ms / base['ms']:.2f}x |"
        )


if __name__ == "__main__":
    main()
