"""The peer benchmark's own bookkeeping (benchmarks/peers/bench_serve.py), without a server:
the counters it reads around each served run and the table it makes of them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METRICS_TEXT = """\
# HELP vmkv:kv_map_calls_critical Map calls on the step thread.
# TYPE vmkv:kv_map_calls_critical counter
vmkv:kv_map_calls_critical{model_name="model",engine="0"} 480
vmkv:kv_map_calls_critical{model_name="model",engine="1"} 20
vmkv:kv_map_calls_background{model_name="model",engine="0"} 15840
vmkv:kv_map_seconds_critical{model_name="model",engine="0"} 0.0265
vmkv:kv_minor_faults{model_name="model",engine="0"} 9872
vmkv:kv_mapper_cpu_seconds{model_name="model",engine="0"} 0.78
vmkv:kv_units_total{model_name="model",engine="0"} 4369
vllm:num_preemptions_total{model_name="model"} 0
"""


def test_kv_counters_sum_each_counter_over_the_engines_and_ignore_the_rest(bench_serve, monkeypatch):
    monkeypatch.setattr(bench_serve.httpx, "get", lambda url, timeout: SimpleNamespace(text=METRICS_TEXT))
    assert bench_serve.kv_counters("http://127.0.0.1:1") == {
        "kv_map_calls_critical": 500.0,
        "kv_map_calls_background": 15840.0,
        "kv_map_seconds_critical": 0.0265,
        "kv_minor_faults": 9872.0,
        "kv_mapper_cpu_seconds": 0.78,
    }


def test_a_server_without_kv_counters_gives_none(bench_serve, monkeypatch):
    text = 'vllm:num_requests_running{model_name="model"} 0\n'
    monkeypatch.setattr(bench_serve.httpx, "get", lambda url, timeout: SimpleNamespace(text=text))
    assert bench_serve.kv_counters("http://127.0.0.1:1") == {}


def test_process_counters_count_the_faults_of_the_server_descendants(bench_serve):
    """A child that writes every 4 KiB page of 64 MiB it asked not to be huge takes a minor
    fault for each (half of them is the bound checked)."""
    code = (
        "import mmap, sys, time\n"
        "m = mmap.mmap(-1, 64 << 20)\n"
        "m.madvise(mmap.MADV_NOHUGEPAGE)\n"
        "for at in range(0, len(m), 4096): m[at] = 1\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    before = bench_serve.process_counters(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        after = bench_serve.process_counters(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert after["engine_minor_faults"] - before["engine_minor_faults"] >= (64 << 20) // 4096 // 2
    assert after["wall_s"] > before["wall_s"] and after["engine_cpu_s"] >= 0


def served(target: str, **counters: float) -> dict:
    run = {"target": target, "dtype": "bfloat16", "rate": "inf", "round": 0, "mode": "served"}
    return run | {"total_output_tokens": 8192, "duration": 14.0, "engine_minor_faults": 81920} | counters


def test_the_table_shows_faults_per_token_for_every_server_and_mapping_for_vattention(bench_serve):
    vattention = served(
        "vattention-compiled",
        kv_map_calls_critical=480,
        kv_map_calls_background=15840,
        kv_map_seconds_critical=0.028,
        kv_minor_faults=9830,
        kv_mapper_cpu_seconds=0.78,
    )
    groups = {("served", "inf", r["target"], "bfloat16"): [r] for r in (served("vllm"), vattention)}
    rows = {
        line.split(" | ")[0]: line for line in bench_serve.faults_and_mapping(groups) if line.startswith("| ")
    }
    assert rows["| vllm"] == "| vllm | bfloat16 | inf | 10.0 | – | – | – | – | – |"
    assert rows["| vattention-compiled"] == (
        "| vattention-compiled | bfloat16 | inf | 10.0 | 480 / 15,840 | 97.1% | 0.20% | 1.20 | 0.78 |"
    )


def test_the_table_is_left_out_without_counters(bench_serve):
    offline = {"target": "paged", "dtype": "bfloat16", "rate": "inf", "round": 0, "mode": "offline"}
    assert bench_serve.faults_and_mapping({("offline", "inf", "paged", "bfloat16"): [offline]}) == []


def test_each_round_is_divided_by_vllms_fastest_dtype_of_that_round_and_rate(bench_serve):
    def run(target: str, dtype: str, rate: str, round_index: int, tok_s: float) -> dict:
        return {"target": target, "dtype": dtype, "rate": rate, "round": round_index, "mode": "served"} | {
            "output_throughput": tok_s
        }

    runs = [
        run("vllm", "bfloat16", "inf", 0, 200.0),
        run("vllm", "float32", "inf", 0, 250.0),  # the faster dtype of round 0
        run("vllm", "bfloat16", "inf", 1, 300.0),
        run("vllm", "bfloat16", "8", 0, 100.0),
        run("paged", "bfloat16", "8", 0, 150.0),
        run("paged", "bfloat16", "inf", 1, 330.0),
        run("paged", "bfloat16", "inf", 0, 500.0),
        run("paged", "bfloat16", "2", 0, 90.0),  # no vLLM run at rate 2: no row
    ]
    rows = [line for line in bench_serve.against_peer(runs) if line.startswith("| paged")]
    assert rows == ["| paged | bfloat16 | 8 | 1.50 | 1.50 |", "| paged | bfloat16 | inf | 2.00 1.10 | 1.55 |"]
    assert bench_serve.against_peer([r for r in runs if r["target"] != "vllm"]) == []


def test_the_vs_vllm_column_divides_by_vllms_fastest_dtype_whichever_ran_last(bench_serve):
    def run(target: str, dtype: str, round_index: int, tok_s: float) -> dict:
        return {"target": target, "dtype": dtype, "rate": "inf", "round": round_index, "mode": "served"} | {
            "output_throughput": tok_s
        }

    runs = [
        run("vllm", "bfloat16", 0, 300.0),
        run("vllm", "bfloat16", 1, 320.0),
        run("vllm", "float32", 0, 200.0),  # slower, and inserted after bfloat16
        run("vllm", "float32", 1, 220.0),
        run("paged", "bfloat16", 0, 465.0),
        run("paged", "bfloat16", 1, 465.0),
    ]
    vs = {
        line.split(" | ")[0] + " " + line.split(" | ")[1]: line.split(" | ")[5]
        for line in bench_serve.markdown(runs).splitlines()
        if line.startswith("| ") and "served" in line
    }
    assert vs["| paged bfloat16"] == "1.50x"  # 465 / 310, bf16's median, not fp32's 210
    assert vs["| vllm float32"] == "0.68x"
