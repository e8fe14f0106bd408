"""Beam search over HTTP: vmkv (beams forked in the KV cache) against vLLM's CPU build (beams
stepped from its front door over the prefix cache), in one run.

    python benchmarks/peers/bench_beam_search.py
    python benchmarks/peers/bench_beam_search.py --width 4 --max-tokens 64 --rounds 2

Each round starts every target in turn (the order turns each round, as bench_serve.py does),
sends each chat prompt as one beam-search completion (`use_beam_search`, n = width,
ignore_eos so every target writes the same number of tokens) one after the other, then all
at once, and stops the server. Reported: the median latency of one request alone, the wall
time of the concurrent batch (medians over rounds), and how often each target's answer (the
token ids of every beam, best first) equals the first target's of the same dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_serve import install_peer, rotated, running_server, served_model, targets_and_dtypes

from vmkv.engine.oracle import CHAT_PROMPTS, chat_prompt_ids
from vmkv.model.store import load_tokenizer

HERE = Path(__file__).resolve().parent


def main() -> None:
    args = parse_args()
    peer_python = install_peer(args.peer_venv)
    model = served_model(args.model)
    prompts = chat_prompt_ids(load_tokenizer(model), CHAT_PROMPTS[: args.num_prompts])
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_index in range(args.rounds):
        for target, dtype in rotated(targets_and_dtypes(args), round_index):
            runs.append(measure(args, peer_python, model, target, dtype, round_index, prompts))
            (args.out / "beam_search.json").write_text(json.dumps(runs, indent=1))
    table = markdown(args, runs)
    (args.out / "beam_search.md").write_text(table)
    print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: the pulled default model)")
    parser.add_argument("--targets", nargs="+", default=["vllm", "vattention", "paged"])
    parser.add_argument("--width", type=int, default=4, help="beams per request (the request's n)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4, help="chat prompts, short to long")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; tables show medians")
    parser.add_argument("--dtype", default="bfloat16", help="vmkv's dtype")
    parser.add_argument("--peer-dtypes", nargs="+", help="default: bfloat16, and float32 without native bf16")
    parser.add_argument("--vmkv-args", default="", help="extra `vmkv serve` flags")
    parser.add_argument("--kv-budget-mib", type=int, default=4096, help="KV cache of every target")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--peer-all-cores", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--peer-venv", type=Path, default=HERE / ".venv-vllm")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--port", type=int, default=0, help="0: a free loopback port")
    return parser.parse_args()


def measure(
    args: argparse.Namespace,
    peer_python: Path,
    model: str,
    target: str,
    dtype: str,
    round_index: int,
    prompts: list[list[int]],
) -> dict:
    print(f"[round {round_index}] {target} ({dtype})", flush=True)
    log_name = f"server-beam-{target}-{dtype}-{round_index}.log"
    with (
        running_server(args, peer_python, model, target, dtype, log_name) as (url, _),
        httpx.Client(base_url=url, timeout=3600) as client,
    ):
        search(client, args, prompts[0])  # warm-up: first-call costs are not beam search's
        alone, answers = [], []
        for prompt in prompts:
            start = time.perf_counter()
            answers.append(search(client, args, prompt))
            alone.append(time.perf_counter() - start)
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: search(client, args, p), prompts))
        together = time.perf_counter() - start
    return {
        "target": target,
        "dtype": dtype,
        "round": round_index,
        "alone_s": alone,
        "together_s": together,
        "answers": answers,
    }


def search(client: httpx.Client, args: argparse.Namespace, prompt: list[int]) -> list[list[int]]:
    """One beam-search completion; the token ids of its beams, best first."""
    body = {
        "model": "model",
        "prompt": prompt,
        "n": args.width,
        "max_tokens": args.max_tokens,
        "use_beam_search": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c.get("token_ids") or [] for c in choices]


def markdown(args: argparse.Namespace, runs: list[dict]) -> str:
    """Medians per target, and its answers against the first target's of the same dtype and
    round: equal (every beam, in order), or the same beams in another order (near-equal scores)."""
    keys = list(dict.fromkeys((r["target"], r["dtype"]) for r in runs))
    first_of_dtype: dict[str, tuple[str, str]] = {}
    for key in keys:
        first_of_dtype.setdefault(key[1], key)
    lines = [
        f"Beam search, width {args.width}, {args.max_tokens} tokens (ignore_eos), {args.num_prompts} chat "
        f"prompts; medians over {args.rounds} rounds",
        "",
        "| target | dtype | one request alone (s) | all at once (s) | answers equal to the first's "
        "| same beams, any order |",
        "|---|---|---|---|---|---|",
    ]
    for key in keys:
        mine = {r["round"]: r for r in runs if (r["target"], r["dtype"]) == key}
        base = {r["round"]: r for r in runs if (r["target"], r["dtype"]) == first_of_dtype[key[1]]}
        pairs = [
            (a, b)
            for round_index, run in mine.items()
            if round_index in base
            for a, b in zip(run["answers"], base[round_index]["answers"], strict=True)
        ]
        equal = sum(a == b for a, b in pairs)
        same_set = sum(sorted(a) == sorted(b) for a, b in pairs)
        alone = statistics.median(t for r in mine.values() for t in r["alone_s"])
        together = statistics.median(r["together_s"] for r in mine.values())
        lines.append(
            f"| {key[0]} | {key[1]} | {alone:.2f} | {together:.2f} | {equal}/{len(pairs)} "
            f"| {same_set}/{len(pairs)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
