"""OpenAI-compatible HTTP server over the engine."""

from vmkv.server.app import build_app
from vmkv.server.engine_client import EngineClient
from vmkv.server.launcher import add_serve_arguments, serve_main

__all__ = ["EngineClient", "add_serve_arguments", "build_app", "serve_main"]
