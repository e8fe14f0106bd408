"""The FastAPI application: routes, guards and error handlers over one running engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import PlainTextResponse, Response

from vmkv.engine import LoRARequest
from vmkv.server.chat import ChatServing
from vmkv.server.completions import CompletionServing
from vmkv.server.embeddings import EmbeddingRequest, EmbeddingResponse
from vmkv.server.engine_client import EngineClient, EngineDeadError
from vmkv.server.errors import APIError, error_response, install_error_handlers
from vmkv.server.guards import DEFAULT_MAX_BODY_BYTES, APIKeyGuard, BodySizeLimit, RequestIdHeaders
from vmkv.server.limits import RequestLimits
from vmkv.server.lora_routes import lora_router
from vmkv.server.messages import MessagesServing
from vmkv.server.messages_protocol import (
    AnthropicErrorResponse,
    MessageObject,
    MessagesInput,
    MessagesRequest,
    TokenCount,
)
from vmkv.server.metrics import CONTENT_TYPE, ServingMetrics
from vmkv.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from vmkv.server.reasoning import REASONING_PARSERS
from vmkv.server.response_store import DEFAULT_STORE_MIB, ResponseStore
from vmkv.server.responses import ResponsesServing
from vmkv.server.responses_protocol import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest
from vmkv.server.scores import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, ScoreServing
from vmkv.server.sleep_routes import sleep_router
from vmkv.server.tool_calls import template_tools
from vmkv.server.tool_parser import TOOL_CALL_PARSERS

ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


def stream_or_json(model: type) -> dict:
    """OpenAPI description of an endpoint answering JSON, or SSE when stream is true."""
    return {200: {"model": model, "content": {"text/event-stream": {}}}}


def package_version() -> str:
    try:
        return version("vmkv")
    except PackageNotFoundError:
        return "unknown"


def tokenizer_config(tokenizer: object, chat_template: str | None) -> dict:
    """What /tokenizer_info answers: the arguments the tokenizer was made with, as JSON (an
    AddedToken as its text, file paths left out), its class and the chat template in use."""

    def plain(value: object) -> object:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, str | int | float | bool) or value is None:
            return value
        return getattr(value, "content", str(value))  # tokenizers' AddedToken: its text

    config = {
        k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if not k.endswith("_file")
    }
    config = plain(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def build_app(
    engine: EngineClient,
    served_model_name: str,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    owns_engine: bool = False,
    open_metrics: bool = False,
    limits: RequestLimits | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    response_store: ResponseStore | None = None,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    enable_prompt_embeds: bool = False,
    embedding_pooling: str = "last",
    request_id_headers: bool = False,
    stream_interval: int = 1,
    log_requests: bool = False,
    enable_sleep_mode: bool = False,
    enable_tokenizer_info: bool = False,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """An app serving `engine` under the name `served_model_name`.

    With `owns_engine`, the app stops the engine when it stops (the server's own engine; apps
    that share one engine leave that to its owner). With `api_keys`, every route but the probes
    (/health, /version) wants `Authorization: Bearer <one of them>`; /metrics too unless
    `open_metrics`. `tool_call_parser` (one of TOOL_CALL_PARSERS) reads the calls a model makes
    with tool_choice "auto"; without one, "auto" is refused. `reasoning_parser` (one of
    REASONING_PARSERS) splits a reasoning model's thinking from its answer. `response_store`
    keeps /v1/responses answers (a store of DEFAULT_STORE_MIB without one). `chat_template`
    renders chats in place of the model's; with `trust_request_chat_template`, a request may
    bring its own. `enable_prompt_embeds` lets completions give prompts as embeddings.
    `embedding_pooling` ("last" or "mean") is how /v1/embeddings pools a prompt's hidden states.
    With `request_id_headers`, every answer carries an X-Request-Id header. A stream's tokens go
    out in chunks of at least `stream_interval` (a request may ask for more). With
    `log_requests`, every finished request logs one line (its id, tokens, latencies). With
    `enable_sleep_mode`, /pause, /resume, /sleep, /wake_up and their /is_* queries are served;
    with `enable_tokenizer_info`, /tokenizer_info. The LoRA adapters the engine client serves
    are models of their own (lora_routes.py); with `allow_runtime_lora_updating`, clients may
    load and unload them.
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
    serving_metrics = ServingMetrics(served_model_name, log_requests, engine.llm.info.max_loras)
    limits = limits or RequestLimits()
    completions = CompletionServing(
        engine,
        served_model_name,
        serving_metrics,
        limits,
        enable_prompt_embeds=enable_prompt_embeds,
        stream_interval=stream_interval,
    )
    chat = ChatServing(
        engine,
        served_model_name,
        serving_metrics,
        limits,
        tool_call_parser,
        reasoning_parser,
        chat_template,
        trust_request_chat_template,
        stream_interval,
    )
    store = response_store or ResponseStore(int(DEFAULT_STORE_MIB * 2**20))
    responses = ResponsesServing(chat, store)
    messages = MessagesServing(chat)
    # /v1/embeddings, /score and /rerank: one serving, as they embed alike
    pooling = ScoreServing(engine, served_model_name, serving_metrics, limits, pooling=embedding_pooling)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            # Stop the engine while the server drains, before uvicorn re-raises the signal that
            # stopped it (after which no `finally` of the caller would run).
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="vmkv",
        version=package_version(),
        description="OpenAI-compatible LLM serving.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if request_id_headers:
        app.add_middleware(RequestIdHeaders)
    if api_keys:  # added last, so it runs first
        app.add_middleware(APIKeyGuard, keys=list(api_keys), open_metrics=open_metrics)

    api = APIRouter(responses=ERROR_RESPONSES)

    @api.post("/v1/completions", response_model=None, responses=stream_or_json(CompletionResponse))
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @api.post("/v1/chat/completions", response_model=None, responses=stream_or_json(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @api.post("/v1/responses", response_model=None, responses=stream_or_json(ResponseObject))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @api.get("/v1/responses/{response_id}", response_model=None, responses=stream_or_json(ResponseObject))
    async def retrieve_response(
        response_id: str, stream: bool = False, starting_after: int | None = Query(default=None, ge=0)
    ) -> Response:
        return responses.retrieve(response_id, stream, starting_after)

    @api.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ) -> InputItemList:
        return responses.input_items(response_id, after, limit, order)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> ResponseObject:
        return await responses.cancel(response_id)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> ResponseDeleted:
        return await responses.delete(response_id)

    @api.post("/v1/embeddings", response_model=None, responses={200: {"model": EmbeddingResponse}})
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await pooling.create(body, request)

    @api.post("/score", response_model=None, responses={200: {"model": ScoreResponse}})
    @api.post("/v1/score", response_model=None, responses={200: {"model": ScoreResponse}})
    async def create_score(body: ScoreRequest, request: Request) -> Response:
        """vLLM's: the cosine similarity of the two sides' embeddings, pair by pair."""
        return await pooling.score(body, request)

    @api.post("/rerank", response_model=None, responses={200: {"model": RerankResponse}})
    @api.post("/v1/rerank", response_model=None, responses={200: {"model": RerankResponse}})
    @api.post("/v2/rerank", response_model=None, responses={200: {"model": RerankResponse}})
    async def rerank(body: RerankRequest, request: Request) -> Response:
        """vLLM's (Jina's and Cohere's shape): documents by their embeddings' similarity to the query."""
        return await pooling.rerank(body, request)

    anthropic_errors = {status: {"model": AnthropicErrorResponse} for status in ERROR_RESPONSES}

    @api.post(
        "/v1/messages",
        response_model=None,
        responses={**stream_or_json(MessageObject), **anthropic_errors},
    )
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API; errors come in its format."""
        return await messages.create(body, request)

    @api.post("/v1/messages/count_tokens", responses=anthropic_errors)
    async def count_message_tokens(body: MessagesInput) -> TokenCount:
        return await messages.count_tokens(body)

    def model_card(lora: LoRARequest | None = None) -> ModelCard:
        if lora is None:
            return ModelCard(id=served_model_name, root=engine.model_path, max_model_len=engine.max_model_len)
        return ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            max_model_len=engine.max_model_len,
            parent=lora.base_model_name or served_model_name,
        )

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(), *map(model_card, engine.loras.values())])

    @api.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        return model_card(chat.check_model(model))

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        """Forget every cached prompt prefix, so the next requests start cold (benchmarks)."""
        try:
            forgotten = await engine.control("reset_prefix_cache")
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        return ResetPrefixCacheResponse(forgotten=forgotten)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(body.model)
        if body.messages is not None:
            text = chat.render_chat(
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                template_tools(body.tools),
                chat.request_template(body.chat_template),
            )
            tokens = await chat.encode(text, add_special_tokens=False, param="messages")
        else:
            tokens = await chat.encode(
                body.prompt, add_special_tokens=body.add_special_tokens, param="prompt"
            )
        strings = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strings
        )

    if enable_tokenizer_info:

        @api.get("/tokenizer_info")
        async def tokenizer_info() -> dict:
            """vLLM's: the tokenizer's configuration (tokenizer_config.json's fields, file paths
            left out), its class, and the chat template the server renders with."""
            return tokenizer_config(engine.tokenizer, chat.chat_template)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(body.model)
        chat.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    @app.get("/health", response_class=Response, responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 with an empty body while the engine runs; 503 once it has died."""
        try:
            engine.check_alive()
        except EngineDeadError as error:
            return error_response(503, str(error))
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        kept = {
            "responses_stored": ("gauge", "Responses kept to fetch or continue.", len(store.entries)),
            "responses_stored_bytes": (
                "gauge",
                "What the kept responses count against --responses-store-mib.",
                store.num_bytes,
            ),
            "responses_running": ("gauge", "Background responses running.", store.num_running),
        }
        text = serving_metrics.render(engine.replica_stats(), kept)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.get("/version")
    async def server_version() -> VersionResponse:
        return VersionResponse(version=app.version)

    app.include_router(api)
    if enable_sleep_mode:
        app.include_router(sleep_router(engine))
    if allow_runtime_lora_updating:
        app.include_router(lora_router(engine, served_model_name))
    return app
