"""/v1/embeddings: OpenAI's embeddings endpoint over the engine's pooling requests. Each input
is one engine request that computes its prompt and returns the final hidden states pooled
(the last token's, or the mean of all) and L2-normalized, sampling nothing; a list of inputs
runs as concurrent requests, batched by the scheduler like any others."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictBool, StrictInt

from vmkv.engine import LoRARequest, RequestRejected, SamplingParams
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
from vmkv.server.refusals import check_supported
from vmkv.server.serving import OpenAIServing

T = TypeVar("T")
MAX_INPUTS = 2048  # OpenAI's cap on inputs in one request
POOLING = ("last", "mean")


class PoolingFields(OpenAIModel):
    """vLLM's fields every pooling request (embeddings, score, rerank) takes."""

    model: Text | None = None
    user: Text | None = None
    cache_salt: NonEmptyText | None = Field(
        default=None, description="vLLM's: requests share cached prefixes only when their salts are equal."
    )
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None,
        description="vLLM's: the id the response carries (after its prefix); the X-Request-Id header wins.",
    )
    priority: StrictInt = Field(
        default=0, description="Lower runs first; needs the server's --scheduling-policy priority."
    )
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = Field(
        default=None, description="Keep this many tokens of each text (-1: all that fit), cut at its side."
    )
    truncation_side: Literal["left", "right"] = Field(
        default="right", description="right keeps a text's first tokens, left its last."
    )
    # vLLM's, for poolers and inputs this server does not have: refused when set
    use_activation: Any = None
    padding: Any = None
    mm_processor_kwargs: Any = None


class EmbeddingRequest(PoolingFields):
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)
        ]
    ) = Field(description="A text, a list of texts, a list of token ids, or a list of token-id lists.")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: each embedding's bytes, as embed_dtype and endianness say."
    )
    embed_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        default="float32", description="vLLM's: the number format of base64 embeddings."
    )
    endianness: Literal["native", "big", "little"] = Field(
        default="native", description="vLLM's: the byte order of base64 embeddings."
    )
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="Only the model's own width: its embeddings are not trained to be cut."
    )
    add_special_tokens: StrictBool = Field(
        default=True, description="vLLM's: text inputs are tokenized with the tokenizer's special tokens."
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
        lora = self.check_model(body.model)
        if body.dimensions not in (None, self.engine.hidden_size):
            raise bad_request(
                f"this model's embeddings have {self.engine.hidden_size} dimensions, and it is not trained "
                "for them to be cut",
                "dimensions",
            )
        check_pooling_fields(body)
        prompts = await self.prompts(body)
        request_id = self.response_id(request, body.request_id, "embd")
        vectors = await self.embed_all(request, request_id, prompts, body, "input", lora)
        if isinstance(vectors, Response):
            return vectors
        num_tokens = sum(len(prompt) for prompt in prompts)
        data = [Embedding(index=i, embedding=encoded(vector, body)) for i, vector in enumerate(vectors)]
        response = EmbeddingResponse(
            id=request_id,
            created=now(),
            model=self.answer_model(lora),
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def embed_all(
        self,
        request: Request,
        request_id: str,
        prompts: list[list[int]],
        body: PoolingFields,
        param: str,
        lora: LoRARequest | None,
    ) -> list[list[float]] | Response:
        """Each prompt's embedding, its engine requests run at once (with the body's cache salt and
        priority, and `lora`, the adapter its model name serves); the answer to send instead when
        the client went away. A prompt the engine refuses is a 400 naming `param`."""
        self.check_alive()
        try:
            self.engine.check_priority(body.priority)
        except RequestRejected as error:
            raise bad_request(str(error), "priority") from error
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
            self.engine.embed(f"{engine_id}-{i}", prompt, params, body.cache_salt, body.priority, lora)
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
            prompts.append(self.cut(item, body, 0, "input"))
        return prompts

    def cut(self, prompt: list[int], body: PoolingFields, max_tokens: int, param: str) -> list[int]:
        """The prompt cut to max_tokens (0: no cut) and to truncate_prompt_tokens (-1: all that
        fit beside nothing generated), at truncation_side; a 400 naming param if it is empty or
        still leaves no room in max_model_len."""
        keep = [limit for limit in (max_tokens, body.truncate_prompt_tokens) if limit]
        if body.truncate_prompt_tokens == -1:
            keep[-1] = self.engine.max_model_len - 1
        if keep and len(prompt) > min(keep):
            kept = min(keep)
            prompt = prompt[:kept] if body.truncation_side == "right" else prompt[len(prompt) - kept :]
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


def check_pooling_fields(body: PoolingFields) -> None:
    """A 400 naming a vLLM field for poolers or inputs this server does not have."""
    check_supported(
        [
            ("use_activation", body.use_activation is not None, "the pooler applies no activation"),
            ("padding", body.padding is not None, "prompts are never padded: decoders embed unpadded"),
            ("mm_processor_kwargs", body.mm_processor_kwargs is not None, "this server serves text models"),
        ]
    )


def encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    """The embedding as the request asks: floats, or base64 of its bytes in embed_dtype and the
    byte order of endianness (native: this machine's)."""
    if body.encoding_format == "float":
        return vector
    values = torch.tensor(vector, dtype=torch.float32).to(getattr(torch, body.embed_dtype))
    raw = values.view(torch.int16 if values.element_size() == 2 else torch.int32).numpy()
    if body.endianness != "native" and body.endianness != sys.byteorder:
        raw = raw.byteswap()
    return base64.b64encode(raw.tobytes()).decode("ascii")
