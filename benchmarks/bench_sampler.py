"""Time of one step's sampling, per sampling configuration, on a model's own next-token
distributions.

    python benchmarks/bench_sampler.py                     # SmolLM2-135M-Instruct, 64 rows
    python benchmarks/bench_sampler.py --rows 8 --rounds 7

The rows are real distributions: the model's logits at each token of continuations of the
oracle's chat prompts, sampled at temperature 1. Their shape decides the cost of top-p (a
flat Gaussian row is sorted whole; a model's rarely is), so random logits would mislead. Each
configuration draws `--rows` rows in one `Sampler` call, as one engine step does. Every round
times every configuration in turn (the median of `--calls` calls); the table gives the median
over rounds and the range of the round medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids
from vmkv.engine.sampler import Sampler, SampleRow
from vmkv.engine.sampling_params import SamplingParams
from vmkv.model.store import load_model, load_tokenizer, resolve_model

CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 1, top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "temperature 0.7, top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "temperature 0.7, top_k 50, top_p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    "temperature 0.7, min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
}
CONTINUATION_TOKENS = 48


def model_logits(model_name: str, seed: int) -> torch.Tensor:
    """[N, V] fp32 next-token logits along sampled continuations of the chat prompts."""
    path = resolve_model(model_name)
    model, tokenizer = load_model(path, dtype=torch.float32), load_tokenizer(path)
    torch.manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for ids in chat_prompt_ids(tokenizer, CHAT_PROMPTS):
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=CONTINUATION_TOKENS,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.eos_token_id,
            )
            rows += [step[0] for step in out.logits]
    return torch.stack(rows).float()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=64, help="rows per step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15, help="timed calls per configuration and round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logits = model_logits(args.model, args.seed)
    pick = torch.randperm(len(logits), generator=torch.Generator().manual_seed(args.seed))[: args.rows]
    logits = logits[pick].contiguous()
    configs = {name: [params] * len(logits) for name, params in CONFIGS.items()}
    configs["all of the above, row by row"] = [
        list(CONFIGS.values())[i % len(CONFIGS)] for i in range(len(logits))
    ]
    sampler = Sampler(seed=args.seed)
    medians: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, params in configs.items():
            rows = [SampleRow(p, None) for p in params]
            sampler(logits, rows)  # warm-up
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                sampler(logits, rows)
                times.append((time.perf_counter() - start) * 1e3)
            medians[name].append(statistics.median(times))
    print(
        f"{args.model}: {len(logits)} rows of {logits.shape[1]:,} logits, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, medians of {args.rounds} rounds"
    )
    print("| sampling | ms per step | round medians |")
    print("|---|---|---|")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f}-{max(values):.1f} |")


if __name__ == "__main__":
    main()
