"""What sleeping gives back, and what waking up costs, per KV layout.

    python benchmarks/bench_sleep.py [--model DIR] [--kv-modes paged vattention contiguous]
                                     [--kv-budget-mib 360] [--prompts 16] [--prompt-tokens 1000]
                                     [--compile]

Each layout runs in a process of its own (the resident set is per process): a workload that
fills the KV cache, then sleep at level 1 (the KV cache's memory), wake up, the workload
again (its greedy tokens must not change), sleep at level 2 (the weights too), wake up (the
checkpoint read again; a compiled decoder is not compiled again), the workload again. Prints
the process's resident memory (VmRSS) after each stage and the seconds each sleep and
wake-up took, as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from vmkv.engine import LLM, SamplingParams
from vmkv.model.store import DEFAULT_MODEL


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def measure(args: argparse.Namespace, kv_mode: str) -> dict[str, float | bool]:
    llm = LLM(
        args.model,
        kv_mode=kv_mode,
        dtype=args.dtype,
        kv_budget_bytes=args.kv_budget_mib << 20,
        compile_model=args.compile,
    )
    prompts = [[100 + i] + list(range(1000, 1000 + args.prompt_tokens - 1)) for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    row: dict[str, float | bool] = {"served": resident_mib()}
    for level in (1, 2):
        start = time.perf_counter()
        llm.sleep(level)
        row[f"sleep{level}_s"] = time.perf_counter() - start
        row[f"asleep{level}"] = resident_mib()
        start = time.perf_counter()
        llm.wake_up()
        row[f"wake{level}_s"] = time.perf_counter() - start
        again = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        row[f"same{level}"] = again == expected
    llm.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-modes", nargs="+", default=["paged", "vattention", "contiguous"])
    parser.add_argument("--kv-budget-mib", type=int, default=360)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--compile", action="store_true", help="compiled, as `vmkv serve` runs it")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this layout, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    workload = f"{args.prompts} prompts of {args.prompt_tokens} tokens"
    model = f"{args.dtype}, {'compiled' if args.compile else 'eager'}"
    print(f"KV budget {args.kv_budget_mib} MiB, {workload}, {model}; resident memory (VmRSS)")
    print("| layout | served | asleep, level 1 | asleep, level 2 | sleep 1 / 2 (s) | wake 1 / 2 (s) | same |")
    print("|---|---|---|---|---|---|---|")
    for kv_mode in args.kv_modes:
        child = subprocess.run(
            [sys.executable, *sys.argv, "--one", kv_mode], check=True, capture_output=True, text=True
        )
        r = json.loads(child.stdout.strip().splitlines()[-1])
        print(
            f"| {kv_mode} | {r['served']:.0f} MiB | {r['asleep1']:.0f} MiB | {r['asleep2']:.0f} MiB "
            f"| {r['sleep1_s']:.3f} / {r['sleep2_s']:.3f} | {r['wake1_s']:.3f} / {r['wake2_s']:.2f} "
            f"| {r['same1'] and r['same2']} |"
        )


if __name__ == "__main__":
    main()
