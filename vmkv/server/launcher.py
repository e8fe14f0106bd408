"""`vmkv serve`: build the engine, wrap it in the app, run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import uvicorn
from transformers import PreTrainedTokenizerBase

from vmkv.engine import AsyncLLM, AsyncProcessLLM, DataParallelLLM, EngineStartError
from vmkv.engine.args import (
    add_engine_arguments,
    engine_config,
    ignored_flags,
    non_negative_float,
    positive_int,
)
from vmkv.engine.data_parallel import ROUTINGS
from vmkv.engine.engine_info import EngineInfo
from vmkv.engine.gc_heap import freeze_start_up_heap
from vmkv.engine.lora import read_adapter_config
from vmkv.server.app import build_app
from vmkv.server.chat_template import load_chat_template
from vmkv.server.drain import DEFAULT_GRACE_SECONDS, Drain, DrainingServer
from vmkv.server.embeddings import POOLING, checkpoint_pooling
from vmkv.server.engine_client import EngineClient
from vmkv.server.guards import DEFAULT_MAX_BODY_BYTES
from vmkv.server.limits import RequestLimits
from vmkv.server.lora_routes import LoRAModule, parse_lora_module
from vmkv.server.reasoning import END as THINK_END
from vmkv.server.reasoning import REASONING_PARSERS
from vmkv.server.reasoning import START as THINK_START
from vmkv.server.response_store import DEFAULT_STORE_MIB, ResponseStore
from vmkv.server.tool_parser import START as TOOL_CALL_START
from vmkv.server.tool_parser import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "VMKV_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as `model` (default: the --model name, or a checkpoint "
        "directory's base name)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    server.add_argument("--port", type=port_number, default=8000)
    server.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[key for key in os.environ.get(API_KEY_ENV, "").split(",") if key],
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and "
        f"/version; repeat for several keys (env {API_KEY_ENV}, comma-separated)",
    )
    server.add_argument(
        "--metrics-without-key",
        action="store_true",
        help="with --api-key, let /metrics answer without a key (for a scraper on a private network)",
    )
    server.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    limits = RequestLimits()
    server.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=limits.max_prompts,
        help="prompts in one request",
    )
    server.add_argument(
        "--max-samples-per-request",
        type=positive_int,
        default=limits.max_samples,
        help="prompts x n in one request",
    )
    server.add_argument("--max-stop-strings", type=positive_int, default=limits.max_stop_strings)
    server.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=limits.max_waiting,
        help="requests queued in the engine; beyond, new ones get 429 with Retry-After",
    )
    server.add_argument(
        "--shutdown-grace-seconds",
        type=non_negative_float,
        default=DEFAULT_GRACE_SECONDS,
        help="on SIGTERM or Ctrl-C, how long requests in flight may run on before they are ended",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='read the tool calls a model makes with tool_choice "auto" in this format (hermes: '
        '<tool_call>{json}</tool_call>, Qwen2.5/Qwen3/Hermes); without it "auto" is refused',
    )
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's <think>...</think> from its answer into the message's `reasoning` "
        "(deepseek_r1: thinking from the start, the opening tag optional; qwen3: only an answer that "
        "opens with <think>)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="render chats with this Jinja template (a file, or the template itself) in place of the "
        "model's, e.g. for a checkpoint that has none",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (Jinja code this server then runs)",
    )
    server.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="a stream's tokens go out in chunks of at least this many (its first and last at once); "
        "a request's stream_interval may raise it",
    )
    server.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one line per finished request: its id, finish reasons, tokens and latencies (no text)",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer every request with an X-Request-Id header (its own, else a new one)",
    )
    server.add_argument(
        "--embedding-pooling",
        choices=POOLING,
        default=None,
        help="how /v1/embeddings pools a prompt's final hidden states: the last token's or the mean "
        "(default: what the checkpoint's sentence-transformers pooling config says, else last)",
    )
    server.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve /pause, /resume, /sleep and /wake_up (and /is_paused, /is_sleeping): an operator "
        "can stop the engine and give its KV and weights memory back (docs/server.md)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module_flag,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as models of these names, loaded at start "
        '(needs --enable-lora); vLLM\'s JSON form {"name": ..., "path": ...} works too',
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: vLLM's environment "
        "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    server.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's configuration and the chat template (vLLM's flag)",
    )
    server.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="let completions give prompts as embeddings (prompt_embeds: base64 of torch.save'd "
        "[tokens, hidden] tensors)",
    )
    server.add_argument(
        "--responses-store-mib",
        type=non_negative_float,
        default=DEFAULT_STORE_MIB,
        help="memory for /v1/responses answers kept to fetch, continue (previous_response_id) or run in "
        "the background; past it the least recently used go first; 0 keeps none",
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
    engine.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="engine processes, each with its own model copy and KV cache; requests go to the one "
        "holding their prompt's longest cached prefix, else the least loaded (docs/scale-out.md)",
    )
    engine.add_argument(
        "--data-parallel-routing",
        choices=ROUTINGS,
        default="prefix",
        help="how requests pick a replica (round-robin: the baseline, ignoring prefixes and load)",
    )
    add_engine_arguments(engine)


def lora_module_flag(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


async def load_lora_modules(engine: EngineClient, modules: list[LoRAModule]) -> None:
    for module in modules:
        await engine.add_lora(module.name, module.path, module.base_model_name)


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def log_capacity(info: EngineInfo, kv_mode: str, replicas: int) -> None:
    """What the KV cache holds, once at start (as vLLM logs its blocks and maximum concurrency),
    and a warning where not even one request of max_model_len tokens fits: longer ones get 400."""
    logger.info(
        "KV cache (%s%s): %s tokens, %.1f requests of max_model_len (%s) at once",
        info.kv_layout or kv_mode,
        f", each of {replicas} replicas" if replicas > 1 else "",
        f"{info.capacity_tokens:,}",
        info.capacity_tokens / info.max_model_len,
        f"{info.max_model_len:,}",
    )
    if info.capacity_tokens < info.max_model_len:
        logger.warning(
            "the KV cache holds %s tokens, fewer than max_model_len (%s): a request of more tokens "
            "than it holds is refused; a larger --kv-budget-mib or a smaller --max-model-len fixes it",
            f"{info.capacity_tokens:,}",
            f"{info.max_model_len:,}",
        )


def hidden_tags(
    tokenizer: PreTrainedTokenizerBase, tool_call_parser: str | None, reasoning_parser: str | None
) -> list[str]:
    """The tags the chosen parsers read that this tokenizer marks special, which detokenizing
    with skip_special_tokens (the default) drops from the text the parsers read."""
    tags = [TOOL_CALL_START] if tool_call_parser else []
    tags += [THINK_START, THINK_END] if reasoning_parser else []
    return [tag for tag in tags if tag in tokenizer.all_special_tokens]


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else a checkpoint directory's base name (never the whole path, which
    would show the server's file system to every client and metrics scraper), else --model."""
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.model).expanduser()
    return path.resolve().name if path.is_dir() else args.model


def serve_main(args: argparse.Namespace) -> None:
    """Serve until interrupted; the engine is shut down (KV freed) on the way out."""
    engine_settings = engine_config(args)
    if unread := ignored_flags(engine_settings):
        logger.warning(
            "%s only apply to --kv-mode vattention; --kv-mode %s ignores them",
            ", ".join(unread),
            engine_settings.kv_mode,
        )
    if args.data_parallel_size > 1 and not args.engine_process:
        raise SystemExit("vmkv: error: --data-parallel-size needs --engine-process")
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise SystemExit("vmkv: error: LoRA adapters need --enable-lora")
    try:
        for module in args.lora_modules:
            read_adapter_config(module.path, module.name)
    except ValueError as error:
        raise SystemExit(f"vmkv: error: --lora-modules: {error}") from error
    try:
        chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    except (ValueError, OSError) as error:
        raise SystemExit(f"vmkv: error: {error}") from error
    try:
        if args.data_parallel_size > 1:
            llm = DataParallelLLM(engine_settings, args.data_parallel_size, args.data_parallel_routing)
        elif args.engine_process:
            llm = AsyncProcessLLM(engine_settings)
        else:
            llm = AsyncLLM(engine_settings)
    except EngineStartError as error:
        raise SystemExit(f"vmkv: error: {error}") from error
    log_capacity(llm.info, args.kv_mode, args.data_parallel_size)
    engine = EngineClient(llm)
    try:
        asyncio.run(load_lora_modules(engine, args.lora_modules))
    except ValueError as error:
        engine.shutdown()
        raise SystemExit(f"vmkv: error: --lora-modules: {error}") from error
    for tag in hidden_tags(engine.tokenizer, args.tool_call_parser, args.reasoning_parser):
        logger.warning(
            "the tokenizer marks %s a special token: answers drop it (so the parser never sees it) "
            "unless a request sets skip_special_tokens to false",
            tag,
        )
    response_store = ResponseStore(int(args.responses_store_mib * 2**20))
    try:
        app = build_app(
            engine,
            served_model_name(args),
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
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            response_store=response_store,
            chat_template=chat_template,
            trust_request_chat_template=args.trust_request_chat_template,
            enable_prompt_embeds=args.enable_prompt_embeds,
            embedding_pooling=args.embedding_pooling or checkpoint_pooling(engine.model_path),
            request_id_headers=args.enable_request_id_headers,
            stream_interval=args.stream_interval,
            log_requests=args.enable_log_requests,
            enable_sleep_mode=args.enable_sleep_mode,
            enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
    except ValueError as error:
        engine.shutdown()
        raise SystemExit(f"vmkv: error: --chat-template: {error}") from error
    drain = Drain(app, background=lambda: response_store.num_running)
    freeze_start_up_heap()
    config = uvicorn.Config(
        drain, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    try:
        DrainingServer(config, drain, engine.shutdown, args.shutdown_grace_seconds).run()
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: uvicorn has stopped at once and re-raised it
    finally:
        engine.shutdown()
