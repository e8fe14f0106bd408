"""What speculative decoding gains a client of `vmkv serve`, one streamed request at a time.

    python benchmarks/bench_speculative_served.py [--kv-mode vattention] [--compile]
        [--spec JSON] [--rounds 2] [--max-tokens 128]

Two servers, `off` (no speculation) and `on` (--speculative-config JSON, the adaptive draft
length included), started in turn on a loopback port, their order turning each round (off on,
on off, ...). Each round sends the workloads of bench_speculative.py (`repeat`, `edit`, `open`)
with the real `openai` client, streaming, greedy, one request after the other, once to warm up
and once measured. Per request: the time from its first content event to its last over its
completion tokens less one (as a client sees decoding: accepted drafts arrive together);
printed, the median over a workload's requests, then the median over rounds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

import httpx
from bench_speculative import DEFAULT_SPEC
from openai import OpenAI
from speculative_workloads import workloads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(flags: list[str], port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "vmkv.cli", "serve", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vmkv serve {' '.join(flags)} exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("vmkv serve did not start within 600 s")


def decode_ms_per_token(client: OpenAI, model: str, text: str, max_tokens: int) -> float:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    times, tokens = [], 0
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            times.append(time.perf_counter())
        if event.usage:
            tokens = event.usage.completion_tokens
    return (times[-1] - times[0]) * 1000 / max(1, tokens - 1)


def run(port: int, max_tokens: int) -> dict[str, float]:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    return {
        name: statistics.median(decode_ms_per_token(client, model, text, max_tokens) for text in texts)
        for name, texts in workloads().items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-mode", default="vattention")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="the `on` server's --speculative-config")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    common = ["--kv-mode", args.kv_mode] + (["--compile"] if args.compile else [])
    targets = {"off": common, "on": [*common, "--speculative-config", args.spec]}
    figures: dict[str, list[dict[str, float]]] = {target: [] for target in targets}
    for round_ in range(args.rounds):
        for target in list(targets)[round_ % 2 :] + list(targets)[: round_ % 2]:
            port = free_port()
            server = start(targets[target], port)
            try:
                run(port, args.max_tokens)  # warm-up
                figures[target].append(run(port, args.max_tokens))
            finally:
                server.terminate()
                server.wait(60)
            print(f"round {round_ + 1} {target}: {figures[target][-1]}", flush=True)

    print(f"\nserved, {args.kv_mode}{', compiled' if args.compile else ''}, spec {args.spec}\n")
    print("| workload | ms per token off | ms per token on | gain | rounds off | rounds on |")
    print("|---|---:|---:|---:|---|---|")
    for name in workloads():
        runs = {target: [f[name] for f in figures[target]] for target in targets}
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        print(
            f"| {name} | {off:.2f} | {on:.2f} | {off / on:.2f}x "
            f"| {', '.join(f'{v:.2f}' for v in runs['off'])} | {', '.join(f'{v:.2f}' for v in runs['on'])} |"
        )


if __name__ == "__main__":
    main()
