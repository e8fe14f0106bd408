"""What a front door must know about a running engine to check requests without it.

The engine-core process sends this once at start; the API process then validates every
request itself, so a request that could never run is refused without a round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vmkv.engine.errors import RequestRejected
from vmkv.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, check_prompt_embeds
from vmkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int  # the model's; token ids at or above it are refused
    capacity_tokens: int  # tokens the KV cache holds when empty
    eos_token_ids: frozenset[int]
    # the KV cache's allocation units (slots, blocks, pages): every sample holds one of its own
    kv_units: int
    kv_unit: str
    kv_layout: str = ""  # KVCache.layout, for the start-up log
    scheduling_policy: str = "fcfs"
    hidden_size: int = 0  # the width of a prompt given as embeddings
    takes_prompt_embeds: bool = True  # False under tensor parallelism: its workers read token ids
    max_loras: int = 0  # distinct LoRA adapters in a step; 0: the engine serves none

    def prompt_token_ids(
        self, tokenizer: object, prompt: str | Sequence[int]
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, its token ids); raises RequestRejected for a malformed prompt."""
        if isinstance(prompt, str):
            return prompt, tokenizer(prompt).input_ids  # type: ignore[operator]
        if not isinstance(prompt, Sequence):
            raise RequestRejected(
                f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}"
            )
        ids = list(prompt)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def prompt_embeds(self, embeds: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The checked [P, hidden] embeddings of a prompt, or RequestRejected."""
        if not self.takes_prompt_embeds:
            raise RequestRejected("prompt_embeds cannot run under tensor parallelism", "prompt_embeds")
        return check_prompt_embeds(embeds, self.hidden_size, params)

    def check_priority(self, priority: object) -> None:
        """Raises RequestRejected for a priority this engine cannot honour: any but 0 under fcfs."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise RequestRejected(f"priority must be a 64-bit integer, got {priority!r}", "priority")
        if priority and self.scheduling_policy != "priority":
            raise RequestRejected(
                "priority needs the priority scheduling policy (--scheduling-policy priority); this "
                "engine serves requests in arrival order",
                "priority",
            )

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raises RequestRejected if the request could never run on this engine."""
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty")
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if params.n > self.max_num_seqs:
            raise RequestRejected(f"n={params.n} exceeds max_num_seqs {self.max_num_seqs}", "n")
        if params.n > self.kv_units:
            raise RequestRejected(
                f"n={params.n} samples each need a {self.kv_unit} of the KV cache at once, which has "
                f"{self.kv_units}",
                "n",
            )
        if params.n * total > self.capacity_tokens:
            # the field to change: the prompt if it alone cannot fit, else max_tokens, else n
            blame = "prompt" if prompt_len >= self.capacity_tokens else "max_tokens"
            raise RequestRejected(
                f"{params.n} x {total} tokens can never fit the KV cache, which holds {self.capacity_tokens}",
                blame if total > self.capacity_tokens else "n",
            )

    def validate(
        self, tokenizer: object, prompt: str | Sequence[int] | torch.Tensor, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a request; returns (prompt text or None, prompt token ids). A tensor
        prompt is embeddings (prompt_embeds.py): its token ids are placeholders."""
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, torch.Tensor):
            text, prompt_ids = None, [PLACEHOLDER_TOKEN_ID] * len(self.prompt_embeds(prompt, params))
        else:
            text, prompt_ids = self.prompt_token_ids(tokenizer, prompt)
        self.check_fits(len(prompt_ids), params)
        token_id_params = {
            "bad_words": [t for word in params.bad_words_token_ids for t in word],
            "logit_bias": params.logit_bias or (),
            "logprob_token_ids": params.logprob_token_ids or (),
            "allowed_token_ids": params.allowed_token_ids or (),
        }
        for param, token_ids in token_id_params.items():
            if any(t >= self.vocab_size for t in token_ids):
                raise RequestRejected(
                    f"{param}: token ids must be below the vocabulary size {self.vocab_size}", param
                )
        return text, prompt_ids
