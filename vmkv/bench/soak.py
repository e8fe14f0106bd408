"""Soak run: `vmkv serve` under a steady request rate over real HTTP, with clients that hang up
part way and requests that end early on stop strings, while the server's and the engine's
resident memory and the KV layout's mapped pages / blocks are sampled from /proc and /metrics.

Passing means: nothing failed, the server went idle with every KV byte freed and its whole
capacity free, and neither resident memory nor the layout's units grew from the first third of
the run (after warm-up) to the last. With `burst`, an overload lands a third of the way in
(many of the longest requests at once), so the last third also shows whether memory came back
after it. `benchmarks/soak.py` runs it for minutes; a few seconds of it run in the test
suite (tests/test_soak.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STOPS = ["e", " th", "o w", "\n"]  # short stop strings: some requests end early on them


@dataclass
class SoakConfig:
    model: str
    kv_mode: str
    seconds: float = 60.0
    rate: float = 4.0  # requests per second, evenly spaced
    disconnect_share: float = 0.2  # requests whose client hangs up part way
    stop_share: float = 0.3  # requests with a stop string
    max_tokens: int = 48
    max_prompt_tokens: int = 120
    seed: int = 0
    sample_every: float = 1.0  # seconds between memory samples
    # An overload in the middle of the run: this many requests of the longest prompt and
    # max_tokens at once, when a third of the run has passed. The last third then shows
    # whether memory came back after it.
    burst: int = 0
    kv_budget_mib: int = 16  # small, so the tiny model's runs map, evict and preempt
    server_args: tuple[str, ...] = (
        *("--dtype", "float32", "--max-model-len", "256"),
        "--no-compile",  # leaks do not depend on it, and a run should not start with a minute's compile
    )


@dataclass
class Sample:
    t: float
    server_rss_mib: float
    engine_rss_mib: float
    kv_allocated_bytes: float
    kv_units_in_use: float  # pages (vattention), blocks (paged), slots (contiguous)
    kv_pages_mapped: float  # vattention's page mappings; 0 elsewhere
    running: float
    waiting: float


@dataclass
class SoakResult:
    config: SoakConfig
    completed: int = 0
    disconnected: int = 0  # the client hung up on purpose
    failed: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle: dict[str, float] = field(default_factory=dict)  # /metrics once idle at the end

    def growth(self, name: str) -> float:
        """Median of the last third of the samples minus the median of the first third after
        warm-up (the first sixth of the run is skipped)."""
        values = [getattr(s, name) for s in self.samples]
        start = len(values) // 6
        third = max(1, (len(values) - start) // 3)
        return statistics.median(values[-third:]) - statistics.median(values[start : start + third])

    def engine_growth_beyond_mappings(self) -> float:
        """Engine RSS growth (MiB) beyond the KV pages the cache mapped into it meanwhile.
        vattention maps pages on demand and keeps freed ones for reuse (on /metrics as allocated
        and mapped), so that part of its RSS is the cache's by design, bounded by the budget;
        paged and contiguous map nothing (their pools are allocated up front)."""
        held = [s for s in self.samples if s.kv_units_in_use]
        page_bytes = held[0].kv_allocated_bytes / held[0].kv_units_in_use if held else 0.0
        return self.growth("engine_rss_mib") - self.growth("kv_pages_mapped") * page_bytes / 2**20

    @property
    def leaked_bytes(self) -> float:
        return self.idle.get("vmkv:kv_cache_used_bytes", 0.0)

    def around_burst(self, name: str) -> tuple[float, float, float]:
        """A sample's value just before the burst (median of the last three), its peak after it,
        and the median over the last third of the run (what it came back to)."""
        at, samples = self.config.seconds / 3, self.samples
        before = [s for s in samples if s.t < at][-3:] or samples[:1]
        third = samples[-max(1, len(samples) // 3) :]
        return (
            statistics.median(getattr(s, name) for s in before),
            max(getattr(s, name) for s in samples if s.t >= at),
            statistics.median(getattr(s, name) for s in third),
        )

    def burst_report(self) -> str:
        """RSS and KV allocated just before the burst, at their peak and over the last third."""
        c, samples = self.config, self.samples
        if not c.burst:
            return ""
        at = c.seconds / 3
        parts = []
        for name, label in (("server_rss_mib", "server RSS"), ("engine_rss_mib", "engine RSS")):
            base, peak, last = self.around_burst(name)
            parts.append(f"{label} {base:.0f} -> peak {peak:.0f} -> {last:.0f} MiB")
        base, peak, last = (b / 2**20 for b in self.around_burst("kv_allocated_bytes"))
        parts.append(f"KV allocated {base:.1f} -> peak {peak:.1f} -> {last:.1f} MiB")
        queued = max(s.running + s.waiting for s in samples)
        head = f"burst of {c.burst} at {at:.0f} s (up to {queued:.0f} requests in the engine)"
        return f"{head}: {', '.join(parts)}"

    def summary(self) -> str:
        c, samples = self.config, self.samples
        peak_server = max(s.server_rss_mib for s in samples)
        peak_engine = max(s.engine_rss_mib for s in samples)
        burst = f"; {report}" if (report := self.burst_report()) else ""
        return (
            f"{c.kv_mode}: {c.seconds:.0f} s at {c.rate} req/s: completed {self.completed}, "
            f"disconnected {self.disconnected}, failed {len(self.failed)}; growth first -> last third: "
            f"server RSS {self.growth('server_rss_mib'):+.1f} MiB, engine RSS "
            f"{self.growth('engine_rss_mib'):+.1f} MiB "
            f"({self.engine_growth_beyond_mappings():+.1f} beyond KV mappings), KV allocated "
            f"{self.growth('kv_allocated_bytes') / 2**20:+.2f} MiB, units in use "
            f"{self.growth('kv_units_in_use'):+.1f}, pages mapped {self.growth('kv_pages_mapped'):+.1f}; "
            f"idle at the end: running {self.idle.get('vllm:num_requests_running', -1):.0f}, "
            f"KV used {self.leaked_bytes:.0f} B; peak RSS server {peak_server:.0f} MiB, "
            f"engine {peak_engine:.0f} MiB{burst}"
        )


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def child_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def scrape(text: str) -> dict[str, float]:
    """Prometheus samples by metric name, labels dropped (one model per server)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{", 1)[0]] = float(value)
    return samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vmkv serve` in a subprocess on a free loopback port."""

    def __init__(self, config: SoakConfig) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "vmkv.cli",
            "serve",
            "--model",
            config.model,
            "--kv-mode",
            config.kv_mode,
        ]
        command += [
            "--port",
            str(self.port),
            "--num-threads",
            "1",
            "--log-level",
            "warning",
            *("--kv-budget-mib", str(config.kv_budget_mib)),
            *config.server_args,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vmkv serve exited: {self.process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError("vmkv serve did not start")

    @property
    def engine_pid(self) -> int:
        children = child_pids(self.process.pid)
        return children[0] if children else self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def one_request(
    client: httpx.AsyncClient,
    config: SoakConfig,
    rng: random.Random,
    result: SoakResult,
    longest: bool = False,
) -> None:
    """A random completion: streamed or not, maybe with a stop string, maybe abandoned.
    longest: the burst's kind, the longest prompt and max_tokens, run to the end."""
    prompt_len = config.max_prompt_tokens if longest else rng.randrange(4, config.max_prompt_tokens)
    body = {
        "model": Path(config.model).name,
        "prompt": [rng.randrange(5, 250) for _ in range(prompt_len)],
        "max_tokens": config.max_tokens if longest else rng.randrange(1, config.max_tokens),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.6,
    }
    if not longest and rng.random() < config.stop_share:
        body["stop"] = [rng.choice(STOPS)]
    hang_up = not longest and rng.random() < config.disconnect_share
    hang_up_after = rng.randrange(1, 6) if hang_up else None
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.failed.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                    return
                events = 0
                async for line in response.aiter_lines():
                    if is_error_event(line):
                        result.failed.append(line[:200])
                        return
                    events += line.startswith("data: ")
                    if hang_up_after is not None and events >= hang_up_after:
                        result.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
            result.completed += 1
            return
        request = client.post("/v1/completions", json=body)
        if hang_up_after is not None:
            try:
                await asyncio.wait_for(request, timeout=0.02 * hang_up_after)
            except TimeoutError:
                result.disconnected += 1
                return
            result.completed += 1
            return
        response = await request
        if response.status_code != 200:
            result.failed.append(f"HTTP {response.status_code}: {response.text[:200]}")
        else:
            result.completed += 1
    except httpx.HTTPError as error:
        result.failed.append(repr(error))


def is_error_event(line: str) -> bool:
    """An SSE event carrying an OpenAI-style error object, or one no client could read (a
    completion whose text is the word "error" is not one: matching the substring once failed a
    healthy request)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    try:
        return "error" in json.loads(line.removeprefix("data: "))
    except json.JSONDecodeError:
        return True


async def sample_loop(
    server: Server, client: httpx.AsyncClient, config: SoakConfig, result: SoakResult, t0: float
) -> None:
    engine_pid = server.engine_pid
    while True:
        metrics = scrape((await client.get("/metrics")).text)
        result.samples.append(
            Sample(
                t=time.monotonic() - t0,
                server_rss_mib=rss_mib(server.process.pid),
                engine_rss_mib=rss_mib(engine_pid),
                kv_allocated_bytes=metrics.get("vmkv:kv_cache_allocated_bytes", 0.0),
                kv_units_in_use=metrics.get("vmkv:kv_units_in_use", 0.0),
                kv_pages_mapped=metrics.get("vmkv:kv_pages_mapped", 0.0),
                running=metrics.get("vllm:num_requests_running", 0.0),
                waiting=metrics.get("vllm:num_requests_waiting", 0.0),
            )
        )
        await asyncio.sleep(config.sample_every)


async def drive(server: Server, config: SoakConfig) -> SoakResult:
    result = SoakResult(config)
    rng = random.Random(config.seed)
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        t0 = time.monotonic()
        sampler = asyncio.ensure_future(sample_loop(server, client, config, result, t0))
        tasks = []
        n, burst_due = 0, config.burst > 0
        while (now := time.monotonic() - t0) < config.seconds:
            tasks.append(
                asyncio.ensure_future(one_request(client, config, random.Random(rng.random()), result))
            )
            if burst_due and now >= config.seconds / 3:
                burst_due = False
                tasks += [
                    asyncio.ensure_future(
                        one_request(client, config, random.Random(rng.random()), result, True)
                    )
                    for _ in range(config.burst)
                ]
            n += 1
            await asyncio.sleep(max(0.0, n / config.rate - now))
        await asyncio.gather(*tasks)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # idle: nothing running, every KV unit given back
            result.idle = scrape((await client.get("/metrics")).text)
            if (
                result.idle.get("vllm:num_requests_running", 1) == 0
                and result.idle.get("vllm:num_requests_waiting", 1) == 0
            ):
                break
            await asyncio.sleep(0.1)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return result


def run_soak(config: SoakConfig) -> SoakResult:
    """Start a server, drive it for config.seconds, wait until it is idle, stop it."""
    server = Server(config)
    try:
        server.wait_ready()
        return asyncio.run(drive(server, config))
    finally:
        server.stop()
