"""vLLM's /score and /rerank over the engine's embeddings: each text is embedded (the pooling
/v1/embeddings uses) and a pair scores the cosine similarity of its two embeddings, as vLLM
scores with an embedding model (a bi-encoder). A text given twice is embedded once.

/score pairs its two sides 1:1, 1:N (the one against each) or N:N (in order); /rerank scores
one query against documents and returns them most relevant first (Jina's and Cohere's shape,
which their clients and RAG frameworks call)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictInt, model_validator

from vmkv.engine import LoRARequest
from vmkv.server.embeddings import MAX_INPUTS, EmbeddingServing, PoolingFields, check_pooling_fields
from vmkv.server.errors import bad_request
from vmkv.server.protocol import Text, now
from vmkv.server.refusals import check_supported

Texts = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoringFields(PoolingFields):
    max_tokens_per_query: Annotated[StrictInt, Field(ge=0)] = Field(
        default=0, description="vLLM's: cut each query to this many tokens (0: no cut)."
    )
    max_tokens_per_doc: Annotated[StrictInt, Field(ge=0)] = Field(
        default=0, description="vLLM's: cut each document to this many tokens (0: no cut)."
    )
    # vLLM's, for cross-encoders and score templates: refused when set
    instruction: Any = None
    chat_template_kwargs: Any = None


class ScoreRequest(ScoringFields):
    """The two sides under any of vLLM's names for them: text_1/text_2, queries/documents,
    queries/items or data_1/data_2."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    @model_validator(mode="after")
    def _one_pair_of_sides(self) -> ScoreRequest:
        named = {name for pair in SIDES for name in pair if getattr(self, name) is not None}
        if not any({first, second} == named for first, second in SIDES):
            if len(named) < 2:
                raise ValueError("give the two sides to score: text_1 and text_2 (or queries and documents)")
            raise ValueError(f"give one pair of sides, not {', '.join(sorted(named))}")
        return self

    def sides(self) -> tuple[list[str], list[str]]:
        for first, second in SIDES:
            if getattr(self, first) is not None and getattr(self, second) is not None:
                return as_list(getattr(self, first)), as_list(getattr(self, second))
        raise AssertionError("validated: one pair is given")


class RerankRequest(ScoringFields):
    query: Text
    documents: Texts
    top_n: Annotated[StrictInt, Field(ge=0)] = Field(default=0, description="Return this many (0: all).")


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


class ScoreServing(EmbeddingServing):
    """/v1/embeddings (the base's create) and, over the same embeddings, /score and /rerank."""

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        queries, documents = body.sides()
        if len(queries) != 1 and len(queries) != len(documents):
            raise bad_request(
                f"the sides must be 1:1, 1:N or N:N; they are {len(queries)}:{len(documents)}", "text_1"
            )
        request_id = self.response_id(request, body.request_id, "score")
        lora = self.check_model(body.model)
        scores = await self.similarities(request, request_id, body, queries, documents, lora)
        if isinstance(scores, Response):
            return scores
        similarity, num_tokens = scores
        response = ScoreResponse(
            id=request_id,
            created=now(),
            model=self.answer_model(lora),
            data=[ScoreData(index=i, score=score) for i, score in enumerate(similarity)],
            usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        documents = as_list(body.documents)
        request_id = self.response_id(request, body.request_id, "rerank")
        lora = self.check_model(body.model)
        scores = await self.similarities(request, request_id, body, [body.query], documents, lora)
        if isinstance(scores, Response):
            return scores
        similarity, num_tokens = scores
        results = [
            RerankResult(index=i, document=RerankDocument(text=text), relevance_score=score)
            for i, (text, score) in enumerate(zip(documents, similarity, strict=True))
        ]
        results.sort(key=lambda result: result.relevance_score, reverse=True)
        response = RerankResponse(
            id=request_id,
            model=self.answer_model(lora),
            usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            results=results[: body.top_n or None],
        )
        return JSONResponse(response.model_dump())

    async def similarities(
        self,
        request: Request,
        request_id: str,
        body: ScoringFields,
        queries: list[str],
        documents: list[str],
        lora: LoRARequest | None,
    ) -> tuple[list[float], int] | Response:
        """The cosine similarity of each (query, document) pair, a single query against every
        document, and the tokens embedded (with `lora`, the model name's adapter); or the
        answer to send when the client went away."""
        templated = "it is for templated scoring models; this server scores with its model's embeddings"
        check_supported(
            [
                ("instruction", body.instruction is not None, templated),
                ("chat_template_kwargs", body.chat_template_kwargs is not None, templated),
            ]
        )
        check_pooling_fields(body)
        query_ids = [await self.tokens(text, body, body.max_tokens_per_query, "query") for text in queries]
        document_ids = [await self.tokens(t, body, body.max_tokens_per_doc, "documents") for t in documents]
        unique = list(dict.fromkeys(tuple(ids) for ids in query_ids + document_ids))
        prompts = [list(ids) for ids in unique]
        vectors = await self.embed_all(request, request_id, prompts, body, "documents", lora)
        if isinstance(vectors, Response):
            return vectors
        by_prompt = dict(zip(unique, vectors, strict=True))
        first = torch.tensor([by_prompt[tuple(ids)] for ids in query_ids])
        second = torch.tensor([by_prompt[tuple(ids)] for ids in document_ids])
        similarity = torch.nn.functional.cosine_similarity(first, second, dim=-1)
        return similarity.tolist(), sum(len(ids) for ids in unique)

    async def tokens(self, text: str, body: ScoringFields, max_tokens: int, param: str) -> list[int]:
        """The text's token ids, cut as the request asks (EmbeddingServing.cut)."""
        return self.cut(
            await self.encode(text, add_special_tokens=True, param=param), body, max_tokens, param
        )
