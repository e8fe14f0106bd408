"""Online benchmark: a streaming OpenAI-compatible client against any server URL.

The same client measures our server (one child process per KV mode, started here) and
any other server given by URL (a peer engine), so their figures are comparable. It
sends prompts as token ids to /v1/completions with stream=true and
stream_options.include_usage, and follows the common benchmark-client semantics: TTFT
is the time to the first chunk carrying choices, ITL the gaps between chunks, output
tokens come from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from vmkv.bench.metrics import RequestRecord
from vmkv.bench.offline import RunOutcome, Target
from vmkv.bench.workloads import BenchRequest, Workload
from vmkv.engine import EngineConfig
from vmkv.engine.args import engine_flags

SERVER_START_SECONDS = 300.0
# Runs `vmkv serve` from the installed package, whatever the `vmkv` command is wired to.
_SERVE = (
    "import argparse, sys\n"
    "from vmkv.server import add_serve_arguments, serve_main\n"
    "parser = argparse.ArgumentParser(prog='vmkv serve')\n"
    "add_serve_arguments(parser)\n"
    "serve_main(parser.parse_args(sys.argv[1:]))\n"
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_arguments(
    config: EngineConfig, port: int, host: str = "127.0.0.1", data_parallel_size: int = 1
) -> list[str]:
    """`vmkv serve` flags for the same engine settings as an offline run (on each replica)."""
    flags = [*engine_flags(config), "--host", host, "--port", str(port), "--log-level", "warning"]
    return flags + (["--data-parallel-size", str(data_parallel_size)] if data_parallel_size > 1 else [])


class ServerProcess:
    """Our server for one engine config, in a child process so that it never shares the client's GIL."""

    def __init__(
        self, config: EngineConfig, log_path: Path, host: str = "127.0.0.1", data_parallel_size: int = 1
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._args = serve_arguments(config, self.port, host, data_parallel_size)
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        """Spawn the server; wait_healthy() waits for it (start several, then wait: they load in parallel)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, *self._args], stdout=log, stderr=subprocess.STDOUT
            )

    def wait_healthy(self, timeout_s: float = SERVER_START_SECONDS) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise RuntimeError(
                    f"the {self.config.kv_mode} server is not running (exit code {code}); see {self.log_path}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the {self.config.kv_mode} server was not healthy after {timeout_s:.0f} s")

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


# --------------------------------------------------------------------- client
def completion_payload(model: str, request: BenchRequest, index: int) -> dict:
    payload = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_tokens,
        "n": request.n,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0 if request.n == 1 else 1.0,
    }
    if request.n > 1:
        payload["seed"] = index
    return payload


async def stream_completion(
    client: httpx.AsyncClient, model: str, request: BenchRequest, index: int, t0: float
) -> RequestRecord:
    """Send one request when its arrival time comes and record what the stream brings."""
    delay = request.arrival - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    record = RequestRecord(request.prompt_len, 0, time.perf_counter() - t0, n=request.n)
    chunks = 0
    try:
        async with client.stream(
            "POST", "/v1/completions", json=completion_payload(model, request, index)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - t0
                if chunk.get("choices"):
                    record.chunk_times.append(now)
                    chunks += 1
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"]["completion_tokens"])
                    record.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
        record.end = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if not record.output_tokens:  # a server without usage: fall back to one token per chunk
        record.output_tokens = chunks
    return record


async def discover_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _run(
    base_url: str, workload: Workload, model: str | None, api_key: str | None, timeout_s: float
) -> RunOutcome:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(workload.requests) + 1, max_keepalive_connections=16)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0)
    ) as client:
        model = model or await discover_model(client)
        t0 = time.perf_counter()
        records = await asyncio.gather(
            *(stream_completion(client, model, r, i, t0) for i, r in enumerate(workload.requests))
        )
        duration = time.perf_counter() - t0
    return RunOutcome(list(records), duration)


def run_online(
    base_url: str,
    workload: Workload,
    model: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> RunOutcome:
    """Stream the workload to base_url; the server's /metrics is diffed over the run when it has one."""
    before = scrape_metrics(base_url, api_key)
    outcome = asyncio.run(_run(base_url, workload, model, api_key, timeout_s))
    after = scrape_metrics(base_url, api_key)
    if before is not None and after is not None:
        outcome.server_metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return outcome


def warm_up(base_url: str, api_key: str | None = None) -> None:
    """One short request, so the first measured request does not pay the server's one-time costs."""
    run_online(base_url, Workload("warm-up", (BenchRequest(tuple(range(10, 18)), 2),)), api_key=api_key)


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled view of a Prometheus text page: name -> value, summed over label sets;
    histogram buckets are dropped (their _sum and _count stay)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1).endswith("_bucket"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


def scrape_metrics(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    return parse_prometheus(response.text) if response.status_code == 200 else None


def url_target(name: str, base_url: str, api_key: str | None = None) -> Target:
    """Any OpenAI-compatible server, already running."""
    return Target(name, lambda workload: run_online(base_url, workload, api_key=api_key))


def parse_peer_urls(items: Sequence[str]) -> list[tuple[str, str]]:
    """['vllm=http://127.0.0.1:8001'] -> [('vllm', 'http://127.0.0.1:8001')]."""
    peers = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"a peer is NAME=http://HOST:PORT, got {item!r}")
        peers.append((name, url.rstrip("/")))
    return peers
