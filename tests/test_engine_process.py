"""The engine in its own process: same outputs as the engine that detokenizes itself, a clear
error when it cannot start, and no process, socket or shared memory left behind however the
server stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from vmkv.engine import (
    LLM,
    AsyncProcessLLM,
    EngineConfig,
    EngineStartError,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from vmkv.engine.engine_core import EngineCore
from vmkv.engine.ipc import AddRequest, Command, encoder, new_addresses

ENGINE = {
    "kv_mode": "paged",
    "dtype": "float32",
    "max_model_len": 128,
    "kv_budget_bytes": 8 << 20,
    "num_threads": 1,
}
PROMPTS = ["The capital of France is", "Once upon a time", [5, 6, 7, 8, 9]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, stop=["e", "ou"]),  # stop strings, cut from the text
    # forks, seeds, logprobs, and stop strings that end some samples while their siblings run on
    SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=16, logprobs=2, stop=["e"]),
    SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[65, 101], ignore_eos=True),
]


def summary(out: RequestOutput) -> list[tuple]:
    return [
        (s.index, s.text, s.token_ids, s.finish_reason, s.stop_reason)
        for s in sorted(out.outputs, key=lambda s: s.index)
    ]


def assert_same_logprobs(got: RequestOutput, expected: RequestOutput) -> None:
    """Same tokens, values equal but for the last bits: requests batched differently round differently."""
    for a, b in zip(got.outputs, expected.outputs, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        for top_a, top_b in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert top_a.keys() == top_b.keys()
            assert all(abs(top_a[t] - top_b[t]) < 1e-4 for t in top_a)


def test_process_outputs_equal_the_engine_that_detokenizes_itself(tiny_model_dir: Path) -> None:
    """Detokenization and stop strings move to the API process; the results must not change."""
    offline = LLM(str(tiny_model_dir), **ENGINE)
    expected = offline.generate(PROMPTS, PARAMS)
    offline.close()

    llm = AsyncProcessLLM(model=str(tiny_model_dir), **ENGINE)

    async def last(prompt: str | list[int], params: SamplingParams) -> RequestOutput:
        async for out in llm.generate(prompt, params):
            final = out
        return final

    async def run_all() -> list[RequestOutput]:
        return await asyncio.gather(*(last(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)))

    try:
        outputs = asyncio.run(run_all())
    finally:
        llm.shutdown()
    assert [summary(out) for out in outputs] == [summary(out) for out in expected]
    for got, want in zip(outputs, expected, strict=True):
        assert_same_logprobs(got, want)
    # the cases are exercised: a stop string ends a single sample, and one of several
    assert any(s.stop_reason in ("e", "ou") for s in outputs[0].outputs)
    assert {s.finish_reason for s in outputs[1].outputs} == {"stop", "length"}
    assert llm.dead_reason == "the engine has been shut down"


def test_the_core_sends_each_token_once_and_refuses_a_duplicate_id(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), **ENGINE)
    core = EngineCore(LLMEngine(config, detokenize=False), *new_addresses())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        assert core.apply(AddRequest("a", [5, 6, 7], params, None)) == []
        [rejected] = core.apply(AddRequest("a", [5, 6, 7], params, None))
        assert rejected.finished and "already in use" in rejected.rejected
        sent: list[int] = []
        while core.engine.has_unfinished_requests():
            for update in map(core.update, core.step()):
                sent += update.samples[0].new_token_ids
        assert core.sent == {}  # nothing kept for a finished request
    finally:
        core.close()
    offline = LLM(str(tiny_model_dir), **ENGINE)
    assert sent == offline.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    offline.close()


@contextlib.contextmanager
def core_and_sender(model_dir: Path) -> Iterator[tuple[EngineCore, zmq.Socket]]:
    """An EngineCore over the tiny model and a socket that sends to its commands address, as the
    API process's does; both closed after."""
    commands, outputs = new_addresses()
    core = EngineCore(
        LLMEngine(EngineConfig(model=str(model_dir), **ENGINE), detokenize=False), commands, outputs
    )
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(commands)
    try:
        yield core, push
    finally:
        push.close(linger=0)
        context.destroy(linger=0)
        core.close()


def test_the_engine_hears_of_a_prompt_as_it_arrives_and_applies_it_between_steps(
    tiny_model_dir: Path,
) -> None:
    """The receiver thread tells the engine of a new prompt at once, while the loop is busy (here:
    not receiving), so the KV cache may back it before the step that admits it; the loop applies
    the command only when it receives."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with core_and_sender(tiny_model_dir) as (core, push):
        heard: list[list[tuple]] = []
        core.engine.prompts_arrived = heard.append  # the instance's, which the receiver thread calls
        push.send(
            encoder.encode(
                [AddRequest("a", [5, 6, 7], params, "salt"), AddRequest("b", [8, 9], params, None)]
            )
        )
        deadline = time.monotonic() + 30
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard == [[([5, 6, 7], "salt"), ([8, 9], None)]]
        assert not core.engine.has_unfinished_requests()  # not applied yet
        assert core.receive(wait=True) == []
        assert [g.request_id for g in core.engine.scheduler.waiting] == ["a", "b"]


def test_a_frame_the_receiver_cannot_decode_stops_the_loop_instead_of_leaving_it_waiting(
    tiny_model_dir: Path,
) -> None:
    with core_and_sender(tiny_model_dir) as (core, push):
        push.send(b"not msgpack commands")
        with pytest.raises(msgspec.DecodeError):
            core.receive(wait=True)


def test_a_commands_priority_reaches_the_scheduler_and_fcfs_refuses_one(tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)

    def wire(command: AddRequest) -> Command:  # as the socket carries it
        return msgspec.msgpack.decode(msgspec.msgpack.encode(command), type=Command)

    core = EngineCore(
        LLMEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE), detokenize=False), *new_addresses()
    )
    try:
        [rejected] = core.apply(wire(AddRequest("a", [5, 6, 7], params, None, priority=1)))
        assert "scheduling-policy priority" in rejected.rejected
    finally:
        core.close()
    config = EngineConfig(model=str(tiny_model_dir), scheduling_policy="priority", **ENGINE)
    core = EngineCore(LLMEngine(config, detokenize=False), *new_addresses())
    try:
        for request_id, priority in [("late", 9), ("soon", -3), ("plain", 0)]:
            assert core.apply(wire(AddRequest(request_id, [5, 6, 7], params, None, priority))) == []
        assert [g.request_id for g in core.engine.scheduler.waiting] == ["soon", "plain", "late"]
    finally:
        core.close()


def test_one_engine_serves_event_loops_one_after_another_and_at_once(tiny_model_dir: Path) -> None:
    llm = AsyncProcessLLM(model=str(tiny_model_dir), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def token_ids() -> list[int]:
        async for out in llm.generate("Hello", params):
            final = out
        return final.outputs[0].token_ids

    try:
        first = asyncio.run(token_ids())
        assert asyncio.run(token_ids()) == first  # a new loop after the first one closed
        results: list[list[int]] = []
        threads = [
            threading.Thread(target=lambda: results.append(asyncio.run(token_ids()))) for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [first] * 3  # three loops on three threads at once
    finally:
        llm.shutdown()


def test_an_engine_that_cannot_start_says_why(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineStartError, match="could not start: ValueError: max_model_len 1000000 exceeds"):
        AsyncProcessLLM(model=str(tiny_model_dir), **{**ENGINE, "max_model_len": 1_000_000})


# ------------------------------------------------------------------------- the server's processes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def engine_addresses(engine_pid: int) -> set[str]:
    """The sockets that engine was told to bind, from its command line."""
    args = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    return {
        arg.decode().split("=", 1)[1].removeprefix("ipc://")
        for arg in args
        if arg.startswith((b"--commands=", b"--outputs="))
    }


def unix_sockets() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}


@contextlib.contextmanager
def vmkv_serve(
    model_dir: Path, *flags: str, stderr: int | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`vmkv serve` as a user starts it, on a free loopback port, until it is healthy."""
    port = free_port()
    command = [sys.executable, "-m", "vmkv.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    # one torch thread: the server, its engine and this client share the cores, and a parallel
    # region waits for whichever of its threads another process has descheduled
    command += ["--dtype", "float32", "--kv-budget-mib", "8", "--num-threads", "1", "--log-level", "warning"]
    command += ["--no-compile"]  # what these tests check does not depend on it; compiling takes a minute
    command += flags
    process = subprocess.Popen(command, stderr=stderr, text=stderr is not None)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, "vmkv serve exited"
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 120, "vmkv serve did not become healthy")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def server(tiny_model_dir: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    with vmkv_serve(tiny_model_dir, "--max-model-len", "128") as served:
        yield served


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_server_leaves_no_process_socket_or_shared_memory(
    server: tuple[subprocess.Popen, str], signum: int
) -> None:
    process, url = server
    shm_before = set(os.listdir("/dev/shm"))
    [engine_pid] = children(process.pid)
    sockets = engine_addresses(engine_pid)
    assert len(sockets) == 2 and sockets <= unix_sockets(), "the engine's sockets should exist while it runs"
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    assert (
        httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 4
    )
    process.send_signal(signum)
    assert process.wait(timeout=30) in (0, -signum)  # uvicorn re-raises the signal once drained
    wait_until(lambda: not alive(engine_pid), 15, "the engine process outlived the server")
    assert not sockets & unix_sockets()
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_both_processes_freeze_their_start_up_heap_before_serving(tiny_model_dir: Path) -> None:
    with vmkv_serve(tiny_model_dir, "--max-model-len", "128", stderr=subprocess.PIPE) as (process, _):
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=30)
    froze = [line for line in log.splitlines() if "start-up objects for the garbage collector" in line]
    assert [line.split(":")[0] for line in froze] == ["vmkv engine", "vmkv"], log


def test_a_killed_server_takes_its_engine_along(server: tuple[subprocess.Popen, str]) -> None:
    process, _ = server
    [engine_pid] = children(process.pid)
    process.kill()
    process.wait()
    wait_until(lambda: not alive(engine_pid), 15, "the engine process was orphaned")


def test_sigterm_drains_finishes_what_it_can_and_ends_the_rest_cleanly(tiny_model_dir: Path) -> None:
    grace = ("--shutdown-grace-seconds", "1.5", "--max-model-len", "2048")
    with vmkv_serve(tiny_model_dir, *grace) as (process, url), httpx.Client(base_url=url, timeout=60) as http:
        [engine_pid] = children(process.pid)
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "ignore_eos": True, "stream": True}
        long_events: list[str] = []
        first_event = threading.Event()

        def stream_long() -> None:  # far longer than the grace period
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "max_tokens": 1900}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        long_events.append(line.removeprefix("data: "))
                        first_event.set()

        long = threading.Thread(target=stream_long)
        long.start()
        assert first_event.wait(30)
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 16}) as short:
            process.send_signal(signal.SIGTERM)
            refused = http.post("/v1/completions", json={**body, "stream": False})
            short_events = [
                line.removeprefix("data: ") for line in short.iter_lines() if line.startswith("data: ")
            ]
        long.join(timeout=60)
        assert process.wait(timeout=30) == 0

    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "shutting down" in refused.json()["error"]["message"]
    assert short_events[-1] == "[DONE]"  # finished within the grace period, whole
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"  # cut after the grace period, with a reason
    assert json.loads(long_events[-2])["error"]["code"] == 503
    wait_until(lambda: not alive(engine_pid), 15, "the engine process outlived the server")


def resident_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])


def test_a_sleeping_server_gives_its_kv_memory_back_and_stops_cleanly_with_requests_held(
    tiny_model_dir: Path,
) -> None:
    flags = ("--enable-sleep-mode", "--kv-mode", "paged", "--kv-budget-mib", "64")
    flags += ("--shutdown-grace-seconds", "1")
    with vmkv_serve(tiny_model_dir, *flags) as (process, url), httpx.Client(base_url=url, timeout=30) as http:
        [engine_pid] = children(process.pid)
        before = resident_kib(engine_pid)  # the paged pool is zeroed at start: resident
        assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        assert before - resident_kib(engine_pid) > 48 * 1024  # most of the 64 MiB pool went back
        model = http.get("/v1/models").json()["data"][0]["id"]
        held: list[httpx.Response] = []
        body = {"model": model, "prompt": "Hello", "max_tokens": 4}
        waiting = threading.Thread(target=lambda: held.append(http.post("/v1/completions", json=body)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # held while the engine sleeps
        process.send_signal(signal.SIGTERM)
        waiting.join(30)
        assert process.wait(timeout=30) == 0
    assert held[0].status_code == 503  # the grace period ended with it still held: a clear error
    wait_until(lambda: not alive(engine_pid), 15, "the engine process outlived the server")
