"""What speculative decoding by n-gram prompt lookup gains, and costs, offline.

    python benchmarks/bench_speculative.py [--model DIR] [--kv-mode paged] [--compile]
        [--spec JSON] [--batch 1 16] [--max-tokens 128] [--rounds 3] [--json FILE]

Three engines in one process run the same greedy chat requests, their order rotating each
round: `off` (no speculation), `fixed` (--spec, vLLM's speculative_config, every proposed token
verified, as vLLM does) and `adaptive` (--spec with vmkv's adaptive draft length). Workloads:
`repeat` (repeat a paragraph), `edit` (add a docstring to a short function and return it) and
`open` (four of the oracle's open questions, whose answers seldom repeat their prompt: what
drafts cost when most are wrong). At --batch 1 the requests run one after the other; at a
larger batch that many run at once. Per target: TPOT, each request's decode milliseconds per
output token (first token to last), median over requests; and output tokens per second of the
whole run, which at a batch > 1 also depends on how the outputs' lengths fall (bf16 greedy
outputs may differ between the engines at a near-tie, so lengths may too: the last column says
in how many rounds the tokens were the same). Printed: medians over rounds, as a Markdown
table, with the acceptance rate (accepted / drafted tokens) and the mean acceptance length
(tokens a drafted sample gains in a step: 1 + accepted / drafts, as vLLM reports it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from speculative_workloads import workloads

from vmkv.engine import LLM, SamplingParams
from vmkv.model.store import DEFAULT_MODEL

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
)


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(median decode ms per output token of a request, first token to last; output tokens per
    second of the whole run; the outputs). Batch 1 runs the prompts one after the other; a
    larger batch runs that many requests at once (the prompts repeated)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    if batch == 1:
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    else:
        outputs = llm.generate((prompts * -(-batch // len(prompts)))[:batch], params)
    elapsed = time.perf_counter() - start
    tokens = [out.outputs[0].token_ids for out in outputs]
    per_token = [
        (out.metrics.finished_time - out.metrics.first_token_time) * 1000 / max(1, len(ids) - 1)
        for out, ids in zip(outputs, tokens, strict=True)
    ]
    return statistics.median(per_token), sum(map(len, tokens)) / elapsed, tokens


def spec_targets(spec: str) -> dict[str, str | None]:
    """The engines compared: no speculation, --spec verifying every proposed token (vLLM's way),
    and --spec with vmkv's adaptive draft length."""
    config = json.loads(spec)
    return {
        "off": None,
        "fixed": json.dumps(config | {"adaptive_length": False}),
        "adaptive": json.dumps(config | {"adaptive_length": True}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-mode", default="paged")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="vLLM's speculative_config (ngram)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    specs = spec_targets(args.spec)
    engines = {
        target: LLM(
            args.model,
            kv_mode=args.kv_mode,
            dtype=args.dtype,
            compile_model=args.compile,
            speculative_config=spec,
        )
        for target, spec in specs.items()
    }
    for llm in engines.values():  # the chat template, as a user's request would come
        llm.generate(["Hi"], SamplingParams(max_tokens=4))
    tokenizer = engines["off"].engine.tokenizer
    drafting = [target for target, spec in specs.items() if spec is not None]
    figures: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    same: dict[tuple[str, int, str], int] = {}
    acceptance: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for name, texts in workloads().items():
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            )
            for t in texts
        ]
        for batch in args.batch:
            for round_ in range(args.rounds):
                order = list(specs)[round_ % len(specs) :] + list(specs)[: round_ % len(specs)]
                tokens = {}
                for target in order:
                    before = engines[target].engine.stats()
                    tpot, rate, tokens[target] = run(engines[target], prompts, batch, args.max_tokens)
                    figures.setdefault((name, batch, target), []).append((tpot, rate))
                    if target in drafting:
                        after = engines[target].engine.stats()
                        drafted = after.spec_draft_tokens - before.spec_draft_tokens
                        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                        drafts = after.spec_drafts - before.spec_drafts
                        acceptance.setdefault((name, batch, target), []).append(
                            (accepted / max(1, drafted), 1 + accepted / max(1, drafts))
                        )
                for target in drafting:
                    key = (name, batch, target)
                    same[key] = same.get(key, 0) + (tokens["off"] == tokens[target])
            print(f"done: {name} batch {batch}", flush=True)

    print(f"\n{args.kv_mode}, {args.dtype}{', compiled' if args.compile else ''}, spec {args.spec}\n")
    print(
        "| workload | batch | TPOT off | TPOT fixed | TPOT adaptive | TPOT gain fixed | TPOT gain adaptive "
        "| throughput fixed | throughput adaptive | accepted / drafted fixed | accepted / drafted adaptive "
        "| mean acceptance length fixed | mean acceptance length adaptive | rounds with the same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in workloads():
        for batch in args.batch:
            medians = {
                target: [statistics.median(v) for v in zip(*figures[(name, batch, target)], strict=True)]
                for target in specs
            }
            rates = {
                target: [statistics.median(v) for v in zip(*acceptance[(name, batch, target)], strict=True)]
                for target in drafting
            }
            row = {
                "workload": name,
                "batch": batch,
                "tpot_ms": {target: m[0] for target, m in medians.items()},
                "tok_s": {target: m[1] for target, m in medians.items()},
                "acceptance": {target: r[0] for target, r in rates.items()},
                "acceptance_length": {target: r[1] for target, r in rates.items()},
                "same_tokens_rounds": {target: same[(name, batch, target)] for target in drafting},
            }
            rows.append(row)
            off, fixed, adaptive = (medians[t] for t in specs)
            print(
                f"| {name} | {batch} | {off[0]:.2f} ms | {fixed[0]:.2f} ms | {adaptive[0]:.2f} ms "
                f"| {off[0] / fixed[0]:.2f}x | {off[0] / adaptive[0]:.2f}x "
                f"| {fixed[1] / off[1]:.2f}x | {adaptive[1] / off[1]:.2f}x "
                f"| {rates['fixed'][0]:.2f} | {rates['adaptive'][0]:.2f} "
                f"| {rates['fixed'][1]:.2f} | {rates['adaptive'][1]:.2f} "
                f"| {same[(name, batch, 'fixed')]} / {same[(name, batch, 'adaptive')]} of {args.rounds} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
