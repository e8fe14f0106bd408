"""Sharing in vattention against paged prefix caching and against no sharing (issue 14).

Two small scenarios on the engine, each target built fresh per round, rounds interleaved
(A B C A B C) and reported as medians:
- shared prefix: request A (a ~600-token prefix + its own question) runs to its first token;
  then request B (the same prefix + another question) is timed to its first token (TTFT of
  the second request, the prefix hit's gain) with the KV physically held at peak, split in
  vattention into the pages backing sequences (theirs and cached chunks) and the reserve of
  pre-mapped idle slots for the next admissions;
- n = 4: one request of four greedy samples of 64 tokens after the same prefix; KV physically
  held at peak. Forks share full pages in both vattention targets; only prefix caching differs.
- beam search: one request of four beams of 64 tokens after the same prefix (beams fork and
  are freed every step); KV physically held at peak, against the KV of four unshared copies,
  and the request's wall time.

    python benchmarks/bench_sharing.py --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmkv import LLM, SamplingParams
from vmkv.model.store import pull_default_model

TARGETS = {
    "vattention, prefix caching": {"kv_mode": "vattention", "enable_prefix_caching": True},
    "vattention, no prefix caching": {"kv_mode": "vattention", "enable_prefix_caching": False},
    "paged, prefix caching": {"kv_mode": "paged", "enable_prefix_caching": True},
    "paged, no prefix caching": {"kv_mode": "paged", "enable_prefix_caching": False},
}


def peak_mib(llm: LLM) -> dict[str, float]:
    """Physical KV held at peak: pages (vattention) or blocks (paged), shared ones once; in
    vattention also each maximum apart: pages backing sequences, and the pre-mapped reserve."""
    cache, stats = llm.engine.cache, llm.engine.cache.stats()
    if stats.unit != "page":
        held = stats.units_peak * cache.block_bytes / 2**20
        return {"held": held, "backing": held, "reserve": 0.0}
    set_mib = cache.geometry.page_set_bytes / 2**20
    return {
        "held": stats.units_peak * cache.geometry.page_size / 2**20,
        "backing": cache.peaks.backing * set_mib,
        "reserve": cache.peaks.reserve * set_mib,
    }


def run(model: str, options: dict, prefix: list[int], dtype: str, page_size: int | None) -> dict[str, float]:
    options = options | {"dtype": dtype, "kv_budget_bytes": 256 << 20, "max_model_len": 2048}
    if page_size is not None and options["kv_mode"] == "vattention":
        options["page_size"] = page_size
    llm = LLM(model, **options)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([1, 2, 3], first)  # warm-up: kernels built, allocator primed
    llm.generate(prefix + [400, 401, 402], first)
    before = llm.engine.cache.stats()
    start = time.perf_counter()
    out = llm.generate(prefix + [500, 501], first)[0]
    ttft = time.perf_counter() - start
    kv = llm.engine.cache.stats().since(before)
    result = {"ttft_ms": ttft * 1e3, "hit": kv.prefix_cache_hits}
    result |= {f"{k}_mib": v for k, v in peak_mib(llm).items()}
    result["map_ms"] = (kv.map_seconds_critical or 0.0) * 1e3
    assert out.outputs[0].token_ids
    llm.close()
    llm = LLM(model, **options)
    samples = SamplingParams(n=4, temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prefix, samples)
    result |= {f"n4_{k}_mib": v for k, v in peak_mib(llm).items()}
    llm.close()
    llm = LLM(model, **options)
    beams = SamplingParams(n=4, use_beam_search=True, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prefix, beams)
    result["beam_s"] = time.perf_counter() - start
    result |= {f"beam_{k}_mib": v for k, v in peak_mib(llm).items()}
    shape = llm.engine.runner.kv_shape
    token_bytes = shape.num_layers * shape.bytes_per_token_per_layer
    result["beam_unshared_mib"] = 4 * (len(prefix) + 64) * token_bytes / 2**20
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefix-len", type=int, default=600)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--page-size", type=int, default=None, help="vattention's page size (default: its own)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = str(pull_default_model())
    prefix = [(37 * i) % 20000 + 100 for i in range(args.prefix_len)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in TARGETS}
    for _ in range(args.rounds):
        for name, options in TARGETS.items():
            results[name].append(run(model, options, prefix, args.dtype, args.page_size))
    print(
        "| target | TTFT of the second request (ms) | prompt tokens hit | critical map ms | "
        "peak KV held / backing sequences / pre-mapped reserve, shared prefix (MiB) | "
        "the same, n = 4 (MiB) | beam search, 4 x 64: the same / four unshared copies (MiB), wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {med['ttft_ms']:.0f} | {med['hit']:.0f} | {med['map_ms']:.1f} | "
            f"{med['held_mib']:.1f} / {med['backing_mib']:.1f} / {med['reserve_mib']:.1f} | "
            f"{med['n4_held_mib']:.1f} / {med['n4_backing_mib']:.1f} / {med['n4_reserve_mib']:.1f} | "
            f"{med['beam_held_mib']:.1f} / {med['beam_backing_mib']:.1f} / {med['beam_reserve_mib']:.1f} / "
            f"{med['beam_unshared_mib']:.1f}, {med['beam_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
