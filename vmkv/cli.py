"""The `vmkv` command: one function per subcommand, wired up with argparse."""

from __future__ import annotations

import argparse
import logging
import sys

from transformers.utils import logging as transformers_logging

from vmkv.bench.cli import add_bench_arguments, bench_main
from vmkv.engine import LLM, SamplingParams
from vmkv.engine.args import positive_int
from vmkv.engine.config import KV_MODES
from vmkv.engine.oracle import chat_prompt_ids
from vmkv.model.store import DEFAULT_MODEL, UnknownModelError, resolve_model
from vmkv.server.launcher import add_serve_arguments, serve_main


def complete_chat(llm: LLM, prompt: str, max_tokens: int) -> str:
    """Greedy chat completion of one user message, through the engine (the same path as serving)."""
    ids = chat_prompt_ids(llm.tokenizer, [prompt])[0]
    output = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return output.outputs[0].text.strip()


def cmd_pull(args: argparse.Namespace) -> None:
    print(resolve_model(args.model))


def cmd_chat(args: argparse.Namespace) -> None:
    # one answer cannot win back a compile (~30 s)
    llm = LLM(str(resolve_model(args.model)), kv_mode=args.kv_mode, compile_model=False)
    try:
        print(complete_chat(llm, args.prompt, args.max_tokens))
    finally:
        llm.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmkv", description="vmkv: a KV-cache engine for LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="download and convert a model, print its checkpoint directory")
    pull.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint directory")
    pull.set_defaults(handler=cmd_pull)

    chat = commands.add_parser("chat", help="print a greedy chat completion of PROMPT")
    chat.add_argument("prompt", metavar="PROMPT")
    chat.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint directory")
    chat.add_argument("--max-tokens", type=positive_int, default=128, help="most new tokens to generate")
    chat.add_argument("--kv-mode", choices=KV_MODES, default="vattention", help="the KV cache layout")
    chat.set_defaults(handler=cmd_chat)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    serve.set_defaults(handler=serve_main)

    bench = commands.add_parser("bench", help="A/B benchmark of the KV layouts (report, JSON, plots)")
    add_bench_arguments(bench)
    bench.set_defaults(handler=bench_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="vmkv: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the bench's output
    transformers_logging.disable_progress_bar()
    try:
        args.handler(args)
    except UnknownModelError as error:
        parser.exit(2, f"vmkv: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
