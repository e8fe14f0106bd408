"""/v1/completions: one engine request per prompt, choice i * n + j being sample j of prompt i;
echo, logprobs in the completions shape, and their stream."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncGenerator
from contextlib import aclosing

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vmkv.engine import RequestRejected
from vmkv.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID
from vmkv.server.engine_client import EngineDeadError, RequestFailed
from vmkv.server.errors import bad_request
from vmkv.server.logprobs import LogprobFormatter
from vmkv.server.metrics import RequestTimer
from vmkv.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    engine_request_id,
    now,
)
from vmkv.server.refusals import check_supported, completion_refusals, sampling_refusals
from vmkv.server.serving import (
    Choice,
    ChoiceDelta,
    OpenAIServing,
    Submission,
    error_event,
    new_choices,
    usage,
)
from vmkv.server.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    sse_event,
)


class CompletionServing(OpenAIServing):
    def __init__(self, *args: object, enable_prompt_embeds: bool = False, stream_interval: int = 1) -> None:
        super().__init__(*args, stream_interval=stream_interval)
        self.enable_prompt_embeds = enable_prompt_embeds  # prompts as embeddings (--enable-prompt-embeds)

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        check_supported(completion_refusals(body) + sampling_refusals(body, self.tokenizer.is_fast))
        self.check_alive()
        request_id = self.response_id(request, body.request_id, "cmpl")
        engine_id = engine_request_id(request_id)
        wanted, body = body, candidates_body(body)  # with best_of, the engine samples the candidates
        submissions = []
        embeds = await self.prompt_embeds(body)
        prompts = embeds or completion_prompts(body)
        self.check_limits(len(prompts), body)
        structured = await self.structured_output(body)
        prompt_param = "prompt_embeds" if embeds else "prompt"
        if embeds:
            encoded = [[PLACEHOLDER_TOKEN_ID] * len(e) for e in embeds]
        else:
            encoded = await self.prompt_token_ids(prompts, body.add_special_tokens)
        for i, (prompt, whole) in enumerate(zip(prompts, encoded, strict=True)):
            kept = self.truncation(len(whole), body)
            prompt_ids = whole[kept]
            max_tokens = self.max_tokens_for(len(prompt_ids), body.max_tokens, prompt_param)
            submission = self.submission(
                f"{engine_id}-{i}",
                prompt_ids,
                body,
                max_tokens,
                body.logprobs,
                i * body.n,
                structured,
                prompt_param,
                prompt_embeds=prompt[kept] if embeds else None,
            )
            if body.echo:  # the prompt as the model saw it: its text unless cut or given as ids
                uncut = isinstance(prompt, str) and len(prompt_ids) == len(whole)
                submission.echo = prompt if uncut else self.tokenizer.decode(prompt_ids)
            submissions.append(submission)
        logprob_format = LogprobFormatter(self.tokenizer, bool(body.return_tokens_as_token_ids))
        timer = self.metrics.timer(request_id, body.session_id)
        if body.stream:
            return EventStreamResponse(
                self.completion_events(body, request_id, submissions, timer, logprob_format)
            )
        choices = await self.collect_or_answer_disconnect(request, submissions, timer)
        if isinstance(choices, Response):
            return choices
        counted = usage(submissions, choices)  # every candidate was generated
        if body.n > wanted.n:
            choices, body = best_choices(choices, body.n, wanted.n), wanted
        response = CompletionResponse(
            id=request_id,
            model=self.answer_model(submissions[0].lora_request),
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.echo + choice.text,
                    logprobs=self.echoed_logprobs(logprob_format, choice, body.logprobs)
                    if body.logprobs is not None
                    else None,
                    prompt_logprobs=logprob_format.prompt(choice.prompt_logprobs, body.prompt_logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_token_ids=choice.prompt_ids if body.return_token_ids else None,
                    token_ids=choice.token_ids if body.return_token_ids else None,
                )
                for choice in choices
            ],
            usage=counted,
        )
        return JSONResponse(response.model_dump())

    async def prompt_embeds(self, body: CompletionRequest) -> list[torch.Tensor]:
        """The request's prompts given as embeddings (none: it gives token ids or text), each
        decoded from vLLM's format (base64 of a torch.save'd tensor) on a worker thread."""
        if body.prompt_embeds is None:
            return []
        if not self.enable_prompt_embeds:
            raise bad_request(
                "this server takes no prompt embeddings; start it with --enable-prompt-embeds",
                "prompt_embeds",
            )
        if body.prompt not in (None, "", []):
            raise bad_request("give prompt or prompt_embeds, not both", "prompt")
        if body.echo:
            raise bad_request("a prompt given as embeddings has no text to echo", "echo")
        encoded = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else body.prompt_embeds
        if not encoded:
            raise bad_request("prompt_embeds is empty", "prompt_embeds")
        return [await asyncio.to_thread(load_prompt_embeds, text) for text in encoded]

    async def prompt_token_ids(
        self, prompts: list[str] | list[list[int]], add_special_tokens: bool
    ) -> list[list[int]]:
        if isinstance(prompts[0], str):
            return [await self.encode(text, add_special_tokens, param="prompt") for text in prompts]
        for token_ids in prompts:
            self.check_token_ids(token_ids, "prompt")
        return [list(token_ids) for token_ids in prompts]

    async def completion_events(
        self,
        body: CompletionRequest,
        request_id: str,
        submissions: list[Submission],
        timer: RequestTimer,
        logprob_format: LogprobFormatter,
    ) -> AsyncGenerator[str, None]:
        created = now()
        choices = new_choices(submissions)
        with_logprobs = body.logprobs is not None

        def chunk(chunk_choices: list[CompletionChoice], final_usage: bool = False) -> str:
            usage_ = usage(submissions, choices) if final_usage or body.continuous_usage else None
            return sse_event(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=self.answer_model(submissions[0].lora_request),
                    choices=chunk_choices,
                    usage=usage_,
                )
            )

        try:
            # The prompts first, as a chunk of their own; with logprobs they ride on each choice's
            # first chunk instead, since the prompt's logprobs arrive with the first token.
            if body.echo and not with_logprobs:
                echoed = []
                for choice in choices:
                    choice.started = True
                    prompt_ids = choice.prompt_ids if body.return_token_ids else None
                    echoed.append(
                        CompletionChoice(index=choice.index, text=choice.echo, prompt_token_ids=prompt_ids)
                    )
                yield chunk(echoed)
            async with aclosing(self.choice_deltas(submissions, choices, timer)) as steps:
                async for step in steps:
                    chunk_choices = [
                        CompletionChoice(
                            index=item.choice.index,
                            text=(item.choice.echo if echoes else "") + item.delta.text,
                            logprobs=(
                                self.echoed_logprobs(logprob_format, item.choice, body.logprobs, item)
                                if with_logprobs
                                else None
                            ),
                            prompt_logprobs=logprob_format.prompt(
                                item.delta.prompt_logprobs, body.prompt_logprobs
                            ),
                            finish_reason=item.delta.finish_reason,
                            stop_reason=item.delta.stop_reason,
                            prompt_token_ids=item.prompt_ids_once(body.return_token_ids),
                            token_ids=item.delta.token_ids if body.return_token_ids else None,
                        )
                        for item in step
                        if item.worth_sending(with_logprobs or bool(body.return_token_ids))
                        for echoes in [bool(item.choice.echo) and with_logprobs and item.text_start == 0]
                    ]
                    if chunk_choices:
                        yield chunk(chunk_choices)
            if body.include_usage:
                yield chunk([], final_usage=True)
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            yield error_event(error)
        yield DONE_EVENT

    def echoed_logprobs(
        self, logprob_format: LogprobFormatter, choice: Choice, k: int | None, step: ChoiceDelta | None = None
    ) -> CompletionLogprobs:
        """Logprobs of a choice's tokens (of one step's delta, if given), after the prompt's own
        when the prompt is echoed and this is the choice's start (vLLM's echo with logprobs;
        the first prompt token has none). Text offsets count the echoed prompt."""
        generated, text_start = (
            (choice.logprobs, 0) if step is None else (step.delta.logprobs or [], step.text_start)
        )
        result = logprob_format.completion(generated, len(choice.echo) + text_start)
        if not choice.echo or text_start != 0:
            return result
        prompt = logprob_format.echoed_prompt(choice.prompt_ids, choice.prompt_logprobs or [], k)
        for name in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
            getattr(prompt, name).extend(getattr(result, name))
        return prompt


def load_prompt_embeds(text: str) -> torch.Tensor:
    """A tensor from base64 of its torch.save bytes, loaded with weights_only (plain tensors,
    no code); what it holds is checked by the engine's rules (prompt_embeds.py)."""
    try:
        tensor = torch.load(
            io.BytesIO(base64.b64decode(text, validate=True)), weights_only=True, map_location="cpu"
        )
    except Exception as error:  # not base64, not a torch.save file, or not plain data
        message = f"prompt_embeds is not a base64-encoded torch.save tensor: {error}"
        raise bad_request(message, "prompt_embeds") from None
    if not isinstance(tensor, torch.Tensor):
        raise bad_request(f"prompt_embeds holds a {type(tensor).__name__}, not a tensor", "prompt_embeds")
    return tensor


def completion_prompts(body: CompletionRequest) -> list[str] | list[list[int]]:
    """The request's prompts: one text, several texts, one token-id list or several."""
    prompt = body.prompt
    if prompt is None:
        raise bad_request("prompt is required (or prompt_embeds)", "prompt")
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(item) == 0 for item in prompt):
        raise bad_request("the prompt is empty", "prompt")
    return prompt


def candidates_body(body: CompletionRequest) -> CompletionRequest:
    """The request the engine runs: with best_of above n, best_of samples per prompt, each with
    its tokens' log-probabilities (which pick the best) even where the answer shows none."""
    if not body.best_of or body.best_of == body.n:
        return body
    logprobs = 0 if body.logprobs is None else body.logprobs
    return body.model_copy(update={"n": body.best_of, "logprobs": logprobs})


def best_choices(choices: list[Choice], candidates: int, n: int) -> list[Choice]:
    """Each prompt's n candidates of the highest log-probability per token (OpenAI's best_of),
    best first, numbered as n choices per prompt."""
    best = []
    for start in range(0, len(choices), candidates):
        ranked = sorted(choices[start : start + candidates], key=mean_logprob, reverse=True)[:n]
        for j, choice in enumerate(ranked):
            choice.index = start // candidates * n + j
            best.append(choice)
    return best


def mean_logprob(choice: Choice) -> float:
    return (
        sum(t.logprob for t in choice.logprobs) / len(choice.logprobs) if choice.logprobs else float("-inf")
    )
