"""`LLM`: the offline front door. Submit every prompt, run the engine until all finish."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.lora import LoRARequest
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int] | torch.Tensor  # a tensor: [tokens, hidden] embeddings (prompt_embeds.py)
Conversation = Sequence[dict]  # chat messages: {"role": ..., "content": ...}


class LLM:
    """LLM(model=..., kv_mode="vattention" | "paged" | "contiguous", **EngineConfig fields)."""

    def __init__(self, model: str = EngineConfig.model, **kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or embeddings: a [tokens, hidden]
        tensor, or vLLM's {"prompt_embeds": tensor}); outputs come in prompt order.

        Every request is validated before any runs, so a rejected one (RequestRejected)
        leaves the engine untouched. Cached prefixes are shared only among requests with the
        same cache_salt. `priority`, one per prompt, orders them under the priority policy.
        lora_request runs every prompt with that LoRA adapter, or, a list, each with its own.
        """
        if self.engine.paused is not None:
            raise RuntimeError("the engine is asleep: call wake_up() first")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priorities, loras, strict=True):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p, cache_salt, rank, lora)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, object] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one conversation or a list, each rendered with the model's chat template
        as the server's chat endpoint renders it (vLLM's LLM.chat): `tools` go to templates that
        describe them, chat_template_kwargs are the template's own variables,
        continue_final_message leaves the last message open for the answer to continue, and
        `chat_template` (Jinja text) renders in place of the model's template."""
        if not (chat_template or self.tokenizer.chat_template):
            raise ValueError("this model has no chat template; give one, or use generate() with a prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer(
                self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    **(chat_template_kwargs or {}),
                ),
                add_special_tokens=False,  # the template wrote them
            )["input_ids"]
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: Literal["last", "mean"] = "last"
    ) -> list[list[float]]:
        """Each prompt's embedding: the final hidden states of its last token (decoder models
        trained for embeddings pool so) or the mean over its tokens, L2-normalized (vLLM's
        LLM.embed). Nothing is generated; the prompt's KV is written and freed like any other."""
        params = SamplingParams(pooling=pooling, max_tokens=1)
        return [out.embedding for out in self.generate(prompts, params)]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, so the next prompts start cold; returns the entries
        (blocks, chunks) forgotten."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Give memory back until wake_up() (vLLM's LLM.sleep; levels in vmkv/engine/sleep.py):
        1 the KV cache's (and an accelerator's weights, moved to host memory), 2 the weights' too,
        reloaded from the checkpoint at wake-up. Cached prefixes are forgotten."""
        self._control("sleep", level, "abort")

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Restore what sleep() gave back, all of it or what the tags name ("weights",
        "kv_cache"); returns whether the engine runs again."""
        return self._control("wake_up", None if tags is None else list(tags))

    def _control(self, name: str, *args: object) -> object:
        answers: list[tuple[object, BaseException | None]] = []
        self.engine.control(name, args, lambda result, error: answers.append((result, error)))
        result, error = answers[0]  # nothing runs between generate calls: answered at once
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        self.engine.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A str, a tensor, a {"prompt_embeds": tensor} or a flat list of ints is one prompt;
    anything else is a list of prompts."""
    if isinstance(prompts, str | torch.Tensor | dict):
        prompts = [prompts]
    prompts = [p["prompt_embeds"] if isinstance(p, dict) and "prompt_embeds" in p else p for p in prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    return prompts
