"""What one engine step's output message costs to cross from the engine process to the API process.

    python benchmarks/bench_ipc.py [--requests 64] [--rounds 2000]

A step of `--requests` decoding requests (one new token each, with stats) is sent from a
child process to this one, over ZeroMQ with msgpack by msgspec (what the server uses) and
over the obvious alternative (a multiprocessing pipe with pickle). Each message is
acknowledged before the next leaves, so the latency is one message's, not a queue's.
Prints the median one-way latency (send, cross, decode) and the codec costs, A B A B.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import time

import zmq

from vmkv.engine.ipc import RequestUpdate, SampleUpdate, StepOutputs, encoder, output_decoder
from vmkv.engine.llm_engine import EngineStats
from vmkv.kv_cache import KVMemory, KVStats

ADDRESS = "ipc://@vmkv-bench-ipc"


def step_message(num_requests: int) -> StepOutputs:
    stats = EngineStats(
        num_running=num_requests,
        num_waiting=0,
        num_swapped=0,
        num_running_seqs=num_requests,
        peak_running_seqs=num_requests,
        kv_usage=0.5,
        free_tokens=1 << 16,
        num_preemptions=0,
        num_steps=1,
        prompt_tokens=1 << 14,
        generation_tokens=1 << 13,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        memory=KVMemory(1 << 30, 1 << 29, 1 << 28),
        kv_stats=KVStats(  # about what a vattention cache reports
            unit="page",
            units_total=1 << 14,
            units_in_use=1 << 13,
            units_peak=1 << 13,
            map_calls_critical=12,
            map_calls_background=3456,
            map_seconds_critical=0.01,
            map_seconds_background=1.5,
            unmap_calls=789,
            minor_faults=123,
            page_sets_total=1 << 10,
            page_sets_free=1 << 9,
        ),
    )
    updates = [
        RequestUpdate(f"cmpl-{i:032x}-0", [SampleUpdate(0, [1000 + i], None, None, None)], finished=False)
        for i in range(num_requests)
    ]
    return StepOutputs(updates, stats)


def zmq_sender(rounds: int, num_requests: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.bind(ADDRESS)
    message = step_message(num_requests)
    for _ in range(rounds):
        socket.send(time.perf_counter_ns().to_bytes(8, "little") + encoder.encode(message))
        socket.recv()
    context.destroy(linger=1000)


def pipe_sender(connection: multiprocessing.connection.Connection, rounds: int, num_requests: int) -> None:
    message = step_message(num_requests)
    for _ in range(rounds):
        connection.send_bytes(pickle.dumps((time.perf_counter_ns(), message)))
        connection.recv_bytes()


def measure_zmq(rounds: int, num_requests: int) -> float:
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(ADDRESS)
    sender = multiprocessing.get_context("spawn").Process(target=zmq_sender, args=(rounds, num_requests))
    sender.start()
    latencies = []
    for _ in range(rounds):
        frame = socket.recv()
        output_decoder.decode(frame[8:])
        latencies.append(time.perf_counter_ns() - int.from_bytes(frame[:8], "little"))
        socket.send(b"")
    sender.join()
    context.destroy()
    return statistics.median(latencies) / 1e3


def measure_pipe(rounds: int, num_requests: int) -> float:
    here, there = multiprocessing.get_context("spawn").Pipe()
    sender = multiprocessing.get_context("spawn").Process(
        target=pipe_sender, args=(there, rounds, num_requests)
    )
    sender.start()
    latencies = []
    for _ in range(rounds):
        sent, _ = pickle.loads(here.recv_bytes())
        latencies.append(time.perf_counter_ns() - sent)
        here.send_bytes(b"")
    sender.join()
    return statistics.median(latencies) / 1e3


def codec_costs(num_requests: int, rounds: int) -> dict[str, float]:
    message = step_message(num_requests)
    frame, pickled = encoder.encode(message), pickle.dumps(message)

    def timed(work: object) -> float:
        start = time.perf_counter_ns()
        for _ in range(rounds):
            work()  # type: ignore[operator]
        return (time.perf_counter_ns() - start) / rounds / 1e3

    return {
        "msgspec encode": timed(lambda: encoder.encode(message)),
        "msgspec decode": timed(lambda: output_decoder.decode(frame)),
        "pickle dumps": timed(lambda: pickle.dumps(message)),
        "pickle loads": timed(lambda: pickle.loads(pickled)),
        "msgspec bytes": len(frame),
        "pickle bytes": len(pickled),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"zmq + msgspec": [], "pipe + pickle": []}
    for _ in range(2):  # A B A B
        results["zmq + msgspec"].append(measure_zmq(args.rounds, args.requests))
        results["pipe + pickle"].append(measure_pipe(args.rounds, args.requests))
    print(
        f"one step of {args.requests} requests, engine process -> API process, {args.rounds} messages a run"
    )
    print("| transport | one-way latency median µs (per run) |\n|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)}) |")
    print("\n| codec | µs or bytes |\n|---|---|")
    for name, value in codec_costs(args.requests, args.rounds).items():
        print(f"| {name} | {value:,.1f} |")


if __name__ == "__main__":
    main()
