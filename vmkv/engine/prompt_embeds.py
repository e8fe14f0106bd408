"""Prompts given as embeddings instead of tokens (vLLM's prompt_embeds): a [P, hidden] tensor
the decoder takes in place of its embedding lookup, for soft prompts or another model's
projections.

Such a prompt has no token ids, yet the engine counts, schedules, caches and samples by them,
so it runs on P placeholder ids. Three things must not read them: the forward (the runner
feeds the embeddings for those positions), the prefix cache (the cache salt carries a digest
of the embeddings, so only equal embeddings share KV) and the repetition penalty (refused: it
would penalize the placeholder).
"""

from __future__ import annotations

import hashlib

import msgspec
import torch

from vmkv.engine.errors import RequestRejected
from vmkv.engine.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = 0  # what an embedded prompt's token ids read
PARAM = "prompt_embeds"


def prompt_rows(embeds: torch.Tensor) -> torch.Tensor:
    """A prompt's embeddings as rows on the CPU: [P, hidden] for a [1, P, hidden] batch of one."""
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    return embeds.detach().to("cpu").contiguous()


def check_prompt_embeds(embeds: torch.Tensor, hidden_size: int, params: SamplingParams) -> torch.Tensor:
    """The prompt's embeddings as [P, hidden] rows (prompt_rows), or RequestRejected saying what
    is wrong. A caller that has validated a prompt takes its rows with prompt_rows: the checks
    read every value."""
    embeds = prompt_rows(embeds)
    if embeds.dim() != 2 or embeds.shape[0] < 1 or embeds.shape[1] != hidden_size:
        raise RequestRejected(
            f"prompt_embeds must have the shape [tokens, {hidden_size}] (the model's hidden size), "
            f"got {list(embeds.shape)}",
            PARAM,
        )
    if not embeds.is_floating_point():
        raise RequestRejected(f"prompt_embeds must be floating point, got {embeds.dtype}", PARAM)
    if not bool(torch.isfinite(embeds).all()):
        raise RequestRejected("prompt_embeds must be finite (no NaN or infinity)", PARAM)
    if params.repetition_penalty != 1.0:
        raise RequestRejected(
            "repetition_penalty reads the prompt's tokens, and an embedded prompt has none",
            "repetition_penalty",
        )
    if params.prompt_logprobs is not None:
        raise RequestRejected(
            "prompt_logprobs score the prompt's tokens, and an embedded prompt has none", "prompt_logprobs"
        )
    return embeds


def embeds_cache_salt(embeds: torch.Tensor, cache_salt: str | None) -> str:
    """The cache salt of an embedded prompt: the caller's, and a digest of the embeddings, so
    only prompts with equal embeddings (in the same salt) share cached KV."""
    digest = hashlib.sha256(embeds.view(torch.uint8).numpy().tobytes())
    digest.update(f"{embeds.dtype}{list(embeds.shape)}".encode())
    return f"{cache_salt or ''}|prompt-embeds:{digest.hexdigest()}"


def text_context(prompt_ids: list[int], embedded: bool) -> list[int]:
    """The prompt tokens an incremental detokenizer reads as context: none for an embedded
    prompt, whose ids are placeholders."""
    return [] if embedded else prompt_ids


class EmbedsPayload(msgspec.Struct, array_like=True):
    """Embeddings as they cross between processes: raw bytes, shape and dtype."""

    data: bytes
    shape: list[int]
    dtype: str

    @classmethod
    def of(cls, embeds: torch.Tensor) -> EmbedsPayload:
        return cls(embeds.view(torch.uint8).numpy().tobytes(), list(embeds.shape), str(embeds.dtype))

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)
