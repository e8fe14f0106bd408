"""LoRA adapters over HTTP: `--lora-modules` parsed, and vLLM's routes that load and unload
adapters while the server runs.

A served adapter is a model name: a request whose `model` is that name runs with the adapter
(engine_client.EngineClient.loras), and /v1/models lists it with the base model as its
parent. The routes are served only when runtime updates are allowed (`--allow-runtime-lora-
updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true): any client reaching them can
change what a model name serves. They answer as vLLM's do: plain text on success, an
OpenAI-style error otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from vmkv.server.engine_client import EngineClient, EngineDeadError
from vmkv.server.errors import APIError, bad_request
from vmkv.server.protocol import OpenAIModel, Text


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: served as model `name`, read from `path`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
            module = LoRAModule(fields["name"], fields["path"], fields.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"a JSON LoRA module needs string fields name and path: {text}") from error
    else:
        name, separator, path = text.partition("=")
        module = LoRAModule(name, path)
        if not separator:
            raise ValueError(f"a LoRA module is name=path or JSON, got {text!r}")
    if not (isinstance(module.name, str) and module.name and isinstance(module.path, str) and module.path):
        raise ValueError(f"a LoRA module needs a non-empty name and path: {text}")
    return module


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: Text
    lora_path: Text
    load_inplace: bool = False  # replace an adapter served under this name


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: Text
    lora_int_id: int | None = None


def lora_router(engine: EngineClient, base_model_name: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name == base_model_name:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if name in engine.loras and not body.load_inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            await engine.add_lora(name, body.lora_path)
        except ValueError as error:
            raise bad_request(str(error), "lora_path") from error
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        try:
            removed = await engine.remove_lora(name)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        if not removed:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
