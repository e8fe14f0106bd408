"""`vmkv serve`: build the engine, wrap it in the app, run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import os

import uvicorn

from vmkv.engine import AsyncLLM, AsyncProcessLLM, EngineConfig, EngineStartError
from vmkv.engine.config import DTYPES, KV_MODES, PREEMPTION_MODES
from vmkv.model.store import DEFAULT_MODEL
from vmkv.server.app import build_app
from vmkv.server.drain import DEFAULT_GRACE_SECONDS, Drain, DrainingServer
from vmkv.server.engine_client import EngineClient
from vmkv.server.guards import DEFAULT_MAX_BODY_BYTES
from vmkv.server.limits import RequestLimits

API_KEY_ENV = "VMKV_API_KEY"
MIB = 1 << 20


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    server = parser.add_argument_group("server")
    server.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint directory")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as `model` (default: the --model argument)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[key for key in os.environ.get(API_KEY_ENV, "").split(",") if key],
        help="require 'Authorization: Bearer KEY' on every route but /health and /version; "
        f"repeat for several keys (env {API_KEY_ENV}, comma-separated)",
    )
    server.add_argument(
        "--metrics-without-key",
        action="store_true",
        help="with --api-key, let /metrics answer without a key (for a scraper on a private network)",
    )
    server.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    limits = RequestLimits()
    server.add_argument(
        "--max-prompts-per-request",
        type=_positive_int,
        default=limits.max_prompts,
        help="prompts in one request",
    )
    server.add_argument(
        "--max-samples-per-request",
        type=_positive_int,
        default=limits.max_samples,
        help="prompts x n in one request",
    )
    server.add_argument("--max-stop-strings", type=_positive_int, default=limits.max_stop_strings)
    server.add_argument(
        "--max-waiting-requests",
        type=_positive_int,
        default=limits.max_waiting,
        help="requests queued in the engine; beyond, new ones get 429 with Retry-After",
    )
    server.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help="on SIGTERM or Ctrl-C, how long requests in flight may run on before they are ended",
    )
    server.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process (default: faster, see docs/server.md); "
        "--no-engine-process steps it on a thread of the server process",
    )
    engine.add_argument("--kv-mode", choices=KV_MODES, default=defaults.kv_mode)
    engine.add_argument("--dtype", choices=list(DTYPES), default=defaults.dtype)
    engine.add_argument("--device", default=defaults.device)
    engine.add_argument(
        "--kv-budget-mib",
        type=_positive_int,
        default=defaults.kv_budget_bytes // MIB,
        help="KV cache size in MiB",
    )
    engine.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=defaults.max_model_len,
        help="longest prompt + generation, in tokens",
    )
    engine.add_argument(
        "--num-threads",
        type=_positive_int,
        default=None,
        help="torch threads of the engine (default: one per core; fewer where other work keeps a core busy)",
    )
    engine.add_argument("--max-num-seqs", type=_positive_int, default=defaults.max_num_seqs)
    engine.add_argument(
        "--max-num-batched-tokens", type=_positive_int, default=defaults.max_num_batched_tokens
    )
    engine.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=defaults.preemption_mode)
    engine.add_argument(
        "--block-size", type=_positive_int, default=defaults.block_size, help="tokens per block (paged mode)"
    )
    engine.add_argument(
        "--no-prefix-caching", action="store_true", help="turn prefix caching off (paged mode)"
    )
    engine.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=defaults.compile_model,
        help="run the model under torch.compile, compiled once at start (default: off, see docs/engine.md)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        kv_mode=args.kv_mode,
        dtype=args.dtype,
        device=args.device,
        kv_budget_bytes=args.kv_budget_mib * MIB,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        compile_model=args.compile,
    )


def serve_main(args: argparse.Namespace) -> None:
    """Serve until interrupted; the engine is shut down (KV freed) on the way out."""
    engine_settings = engine_config(args)
    try:
        llm = AsyncProcessLLM(engine_settings) if args.engine_process else AsyncLLM(engine_settings)
    except EngineStartError as error:
        raise SystemExit(f"vmkv: error: {error}") from error
    engine = EngineClient(llm)
    app = build_app(
        engine,
        args.served_model_name or args.model,
        api_keys=args.api_keys,
        open_metrics=args.metrics_without_key,
        limits=RequestLimits(
            max_prompts=args.max_prompts_per_request,
            max_samples=args.max_samples_per_request,
            max_stop_strings=args.max_stop_strings,
            max_waiting=args.max_waiting_requests,
        ),
        max_body_bytes=args.max_body_bytes,
        owns_engine=True,
    )
    drain = Drain(app)
    config = uvicorn.Config(
        drain, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    try:
        DrainingServer(config, drain, engine.shutdown, args.shutdown_grace_seconds).run()
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: uvicorn has stopped at once and re-raised it
    finally:
        engine.shutdown()
