"""/v1/embeddings: OpenAI's embeddings endpoint over the engine's pooling requests. Each input
is one engine request that computes its prompt and returns the final hidden states pooled
(the last token's, or the mean of all) and L2-normalized, sampling nothing; a list of inputs
runs as concurrent requests, batched by the scheduler like any others."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictBool, StrictInt

from vmkv.engine import RequestRejected, SamplingParams
from vmkv.server.errors import bad_request
from vmkv.server.protocol import (
    MAX_REQUEST_ID_CHARS,
    NonEmptyText,
    OpenAIModel,
    Text,
    TokenId,
    engine_request_id,
    now,
)
from vmkv.server.serving import OpenAIServing

T = TypeVar("T")
MAX_INPUTS = 2048  # OpenAI's cap on inputs in one request
POOLING = ("last", "mean")


class EmbeddingRequest(OpenAIModel):
    model: Text | None = None
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)
        ]
    ) = Field(description="A text, a list of texts, a list of token ids, or a list of token-id lists.")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: each embedding's little-endian float32 bytes."
    )
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="Only the model's own width: its embeddings are not trained to be cut."
    )
    user: Text | None = None
    add_special_tokens: StrictBool = Field(
        default=True, description="vLLM's: text inputs are tokenized with the tokenizer's special tokens."
    )
    cache_salt: NonEmptyText | None = Field(
        default=None, description="vLLM's: requests share cached prefixes only when their salts are equal."
    )
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None,
        description="vLLM's: the id the response carries (after its prefix); the X-Request-Id header wins.",
    )


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class EmbeddingServing(OpenAIServing):
    def __init__(self, *args: object, pooling: str = "last") -> None:
        super().__init__(*args)
        if pooling not in POOLING:
            raise ValueError(f"pooling must be one of {POOLING}, got {pooling!r}")
        self.pooling = pooling

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        self.check_model(body.model)
        if body.dimensions not in (None, self.engine.hidden_size):
            raise bad_request(
                f"this model's embeddings have {self.engine.hidden_size} dimensions, and it is not trained "
                "for them to be cut",
                "dimensions",
            )
        prompts = await self.prompts(body)
        request_id = self.response_id(request, body.request_id, "embd")
        vectors = await self.embed_all(request, request_id, prompts, body.cache_salt, "input")
        if isinstance(vectors, Response):
            return vectors
        num_tokens = sum(len(prompt) for prompt in prompts)
        data = [
            Embedding(index=i, embedding=encoded(vector, body.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        response = EmbeddingResponse(
            id=request_id,
            created=now(),
            model=self.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def embed_all(
        self, request: Request, request_id: str, prompts: list[list[int]], cache_salt: str | None, param: str
    ) -> list[list[float]] | Response:
        """Each prompt's embedding, its engine requests run at once; the answer to send instead
        when the client went away. A prompt the engine refuses is a 400 naming `param`."""
        self.check_alive()
        self.limits.check_queue(self.engine.stats().num_waiting)
        params = SamplingParams(pooling=self.pooling, max_tokens=1)
        for prompt in prompts:
            try:
                self.engine.validate(prompt, params)
            except RequestRejected as error:
                raise bad_request(str(error), param) from error
        timer = self.metrics.timer(request_id)
        engine_id = engine_request_id(request_id)
        runs = [
            self.engine.embed(f"{engine_id}-{i}", prompt, params, cache_salt)
            for i, prompt in enumerate(prompts)
        ]
        vectors = await self.answer_or_disconnect(request, all_of(runs))
        if not isinstance(vectors, Response):
            timer.on_finish(sum(len(prompt) for prompt in prompts), 0, 0, ["stop"] * len(prompts))
        return vectors

    async def prompts(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input as token ids: texts tokenized (a text too long for the model is a 400),
        token ids checked against the vocabulary."""
        given = body.input
        if isinstance(given, str):
            given = [given]
        if isinstance(given[0], int):
            given = [given]
        prompts = []
        for item in given:
            if isinstance(item, str):
                item = await self.encode(item, add_special_tokens=body.add_special_tokens, param="input")
            else:
                self.check_token_ids(item, "input")
            prompts.append(self.check_length(item, "input"))
        return prompts

    def check_length(self, prompt: list[int], param: str) -> list[int]:
        """The prompt, unless it is empty or leaves no room in max_model_len (a 400 naming param)."""
        if not prompt:
            raise bad_request(f"{param}: a text has no tokens", param)
        if len(prompt) >= self.engine.max_model_len:
            raise bad_request(
                f"{param}: a text has {len(prompt)} tokens; this model's maximum context length is "
                f"{self.engine.max_model_len}",
                param,
            )
        return prompt


async def all_of(runs: list[Coroutine[None, None, T]]) -> list[T]:
    """Every run's result; when one fails (or this is cancelled), the others are cancelled too,
    so their engine requests are aborted rather than left to finish for nobody."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def checkpoint_pooling(model_dir: str) -> str:
    """The pooling a sentence-transformers checkpoint declares (its 1_Pooling/config.json):
    mean or last token; "last" for any other checkpoint, as decoder models embed."""
    config = Path(model_dir, "1_Pooling", "config.json")
    try:
        modes = json.loads(config.read_text())
    except (OSError, ValueError):
        return "last"
    return "mean" if modes.get("pooling_mode_mean_tokens") else "last"


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
