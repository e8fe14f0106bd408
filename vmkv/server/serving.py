"""What both generation endpoints share: turn an OpenAI request into engine requests and their
outputs back (completions.py and chat.py build on it).

Every check (model name, lengths, token ids, what the engine would refuse) happens before
anything reaches the engine, so a refused request leaves no trace. Each prompt becomes
one engine request whose n samples share the prompt's KV; its outputs arrive as per-step
deltas, which a stream forwards and a plain response accumulates.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from fastapi import Request
from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from vmkv.engine import LoRARequest, RequestRejected, SamplingParams
from vmkv.engine.outputs import PromptLogprob
from vmkv.engine.repetition import RepetitionDetection
from vmkv.engine.sampling_params import StructuredOutput
from vmkv.engine.structured_output import check_structured
from vmkv.server.engine_client import EngineClient, EngineDeadError, RequestFailed, SampleDelta, TokenLogprob
from vmkv.server.errors import APIError, bad_request, error_body
from vmkv.server.limits import RequestLimits
from vmkv.server.metrics import RequestTimer, ServingMetrics
from vmkv.server.protocol import (
    MAX_REQUEST_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    RepetitionDetectionParams,
    SamplingFields,
    Usage,
)
from vmkv.server.streaming import (
    ClientDisconnected,
    merge,
    sse_event,
    until_disconnected,
)
from vmkv.server.structured_request import structured_specs

# The status nginx made the convention for "client closed the request"; nobody is left to read it.
CLIENT_CLOSED_REQUEST = 499
T = TypeVar("T")
# SamplingParams fields under their names in the API, where these differ
API_NAMES = {"bad_words_token_ids": "bad_words", "structured": "response_format", "extra_args": "vllm_xargs"}


def api_param(engine_param: str | None) -> str | None:
    """The request field a RequestRejected's param names."""
    return API_NAMES.get(engine_param, engine_param)


@dataclass
class Submission:
    """One prompt's engine request; its samples are choices choice_offset .. choice_offset + n - 1."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    choice_offset: int
    cache_salt: str | None
    priority: int = 0
    echo: str = ""  # text each choice starts with (the prompt, or chat's last assistant message)
    prompt_embeds: torch.Tensor | None = None  # the prompt itself: its prompt_ids are placeholders
    stream_interval: int = 1  # a stream's new tokens are sent once this many have come
    lora_request: LoRARequest | None = None  # the adapter the request's model name serves


@dataclass
class Choice:
    """A sample's output so far."""

    index: int
    prompt_ids: list[int] | None  # for echo with logprobs and return_token_ids (None: embeddings)
    echo: str = ""  # sent before the first generated text
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_cached_tokens: int = 0  # its request's prompt tokens the prefix cache held
    started: bool = False  # a stream has sent a chunk of it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, delta: SampleDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs.extend(delta.logprobs or [])
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class ChoiceDelta:
    """A delta with the choice it belongs to and where its text starts in that choice."""

    choice: Choice
    delta: SampleDelta
    text_start: int

    def worth_sending(self, with_tokens: bool, with_text: bool = True) -> bool:
        """Whether a chunk should carry it: new text (unless the caller judges the text itself),
        the finish, or, when the request sees tokens (logprobs or token ids), new tokens."""
        delta = self.delta
        return (
            (with_text and bool(delta.text))
            or delta.finish_reason is not None
            or (with_tokens and bool(delta.token_ids))
        )

    def prompt_ids_once(self, wanted: bool | None) -> list[int] | None:
        """The prompt's token ids on the choice's first chunk of a stream, if the request wants them."""
        first, self.choice.started = not self.choice.started, True
        return self.choice.prompt_ids if wanted and first else None


# Texts longer than this are tokenized on a worker thread, so the event loop keeps serving.
INLINE_TOKENIZE_CHARS = 8192
# Normalization can merge characters (NFC composition), so a text of C characters may hold as
# few as C / (2 x the longest token); the bound below allows twice that and more.
PROMPT_CHARS_SLACK = 4


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: ServingMetrics,
        limits: RequestLimits,
        stream_interval: int = 1,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        # a stream's tokens go out in chunks of at least this many (its first and last at once):
        # fewer, larger events for this process to frame and the client to parse
        self.stream_interval = stream_interval
        # No text longer than this fits max_model_len, whatever it says: refused untokenized.
        longest_token = max(len(token) for token in engine.tokenizer.get_vocab())
        self.max_prompt_chars = PROMPT_CHARS_SLACK * engine.max_model_len * longest_token

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @staticmethod
    def response_id(request: Request | None, given: str | None, prefix: str) -> str:
        """The id a response carries: `prefix-` and the request's X-Request-Id header, else the
        body's request_id, else a new one (vLLM's rule), so a caller can trace its requests."""
        header = request.headers.get("x-request-id") if request is not None else None
        if header is not None and not 0 < len(header) <= MAX_REQUEST_ID_CHARS:
            raise bad_request(
                f"X-Request-Id must have 1 to {MAX_REQUEST_ID_CHARS} characters", "X-Request-Id"
            )
        return f"{prefix}-{header or given or uuid.uuid4().hex}"

    # ---------------------------------------------------------------- checks shared by endpoints
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model name serves (None: the base model), or a 404."""
        if name is None or name == self.model_name:
            return None
        lora = self.engine.lora_request(name)
        if lora is None:
            served = ", ".join(repr(n) for n in [self.model_name, *self.engine.loras])
            raise APIError(404, f"model {name!r} does not exist; this server serves {served}", "model")
        return lora

    def answer_model(self, lora: LoRARequest | None) -> str:
        """The model name an answer carries: the adapter's, for a request run with one."""
        return self.model_name if lora is None else lora.lora_name

    def check_alive(self) -> None:
        try:
            self.engine.check_alive()
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error

    def check_limits(self, num_prompts: int, body: SamplingFields) -> None:
        """400 for a request asking too much; 429 while the engine's queue is full."""
        self.limits.check(num_prompts, body.n, len(body.stop_strings))
        self.limits.check_queue(self.engine.stats().num_waiting)

    def check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        vocab_size = self.engine.vocab_size
        if any(token_id >= vocab_size for token_id in token_ids):
            raise bad_request(f"token ids must be below the vocabulary size {vocab_size}", param)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as it would start the text and, where that differs in its first
        token only, as it would follow a space (vLLM's rule), so the word is banned in both places."""
        sequences = []
        for word in words:
            alone = self.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]
            spaced = self.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
            if not alone:
                raise bad_request(f"bad word {word!r} has no tokens", "bad_words")
            sequences.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return sequences

    async def structured_output(
        self, body: SamplingFields, more: list[tuple[str, StructuredOutput | None]] = ()
    ) -> StructuredOutput | None:
        """The request's output constraint, from whichever of response_format, structured_outputs,
        guided_* or `more` (a chat's forced tool calls) names one (two at once is a 400); a spec
        that does not parse is a 400 too. It is parsed on a worker thread: a large schema must not
        stall every stream on the event loop."""
        found = [(param, spec) for param, spec in [*structured_specs(body), *more] if spec is not None]
        if len(found) > 1:
            raise bad_request(
                f"give one output constraint, not {found[0][0]} and {found[1][0]} together", found[1][0]
            )
        if not found:
            return None
        param, spec = found[0]
        try:
            await asyncio.to_thread(check_structured, spec)
        except ValueError as error:
            raise bad_request(f"{param} is not a valid {spec.kind} constraint: {error}", param) from None
        return spec

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text`; a text far too long is refused before any tokenizing, and a long
        one is tokenized off the event loop (a 4 MB prompt once held every stream for 3 s)."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"the text has {len(text)} characters; no text over {self.max_prompt_chars} fits this "
                f"model's maximum context length of {self.engine.max_model_len} tokens",
                param,
            )
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        encoding = await asyncio.to_thread(self.tokenizer, text, add_special_tokens=add_special_tokens)
        return encoding["input_ids"]

    def truncated(self, prompt_ids: list[int], body: SamplingFields) -> list[int]:
        return prompt_ids[self.truncation(len(prompt_ids), body)]

    def truncation(self, prompt_len: int, body: SamplingFields) -> slice:
        """What of a prompt truncate_prompt_tokens keeps (-1: max_model_len): its last tokens, or
        its first with truncation_side right; a limit over max_model_len is a 400, as in vLLM."""
        keep, limit = body.truncate_prompt_tokens, self.engine.max_model_len
        if keep is None:
            return slice(None)
        if keep > limit:
            raise bad_request(
                f"truncate_prompt_tokens ({keep}) exceeds this model's maximum context length of {limit} "
                "tokens",
                "truncate_prompt_tokens",
            )
        keep = limit if keep == -1 else keep
        if prompt_len <= keep:
            return slice(None)
        return slice(prompt_len - keep, None) if body.truncation_side == "left" else slice(keep)

    def max_tokens_for(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """The request's generation budget; refuses one that cannot fit in max_model_len."""
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise bad_request("the prompt is empty", prompt_param)
        if prompt_len >= limit:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} "
                "tokens, which must also hold at least one generated token",
                prompt_param,
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but the prompt has {prompt_len} "
                f"tokens and max_tokens asks for {requested} more",
                "max_tokens",
            )
        return requested

    def submission(
        self,
        request_id: str,
        prompt_ids: list[int],
        body: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        choice_offset: int,
        structured: StructuredOutput | None,
        prompt_param: str,
        end_of_thinking: list[int] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        thinking_budget: int | None = None,
    ) -> Submission:
        """An engine request the engine is known to accept (anything else is a 400 naming the
        field to change: the engine's "prompt" is this route's `prompt_param`). end_of_thinking:
        a reasoning model's, after which `structured` holds, and which a spent thinking_budget
        forces."""
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(body.logit_bias or {}, "logit_bias")
        self.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
        self.check_token_ids(body.logprob_token_ids or [], "logprob_token_ids")
        if body.logprob_token_ids and logprobs is None:
            raise bad_request(
                "logprob_token_ids needs logprobs (the top logprobs it replaces)", "logprob_token_ids"
            )
        if body.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
            )
        top_k = min(body.top_k, self.engine.vocab_size) if body.top_k is not None and body.top_k > 0 else 0
        try:
            params = self._params(
                body, max_tokens, logprobs, top_k, structured, end_of_thinking, thinking_budget
            )
            self.engine.check_priority(body.priority)
            self.engine.validate(prompt_ids if prompt_embeds is None else prompt_embeds, params)
        except RequestRejected as error:
            param = prompt_param if error.param == "prompt" else api_param(error.param)
            raise bad_request(str(error), param) from error
        return Submission(
            request_id,
            prompt_ids,
            params,
            choice_offset,
            body.cache_salt,
            body.priority,
            prompt_embeds=prompt_embeds,
            stream_interval=max(self.stream_interval, body.stream_interval or 1) if body.stream else 1,
            lora_request=self.check_model(body.model),
        )

    def _params(
        self,
        body: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        top_k: int,
        structured: StructuredOutput | None,
        end_of_thinking: list[int] | None,
        thinking_budget: int | None,
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=top_k,
            n=body.n,
            stop=body.stop_strings,
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logprob_token_ids=body.logprob_token_ids,
            prompt_logprobs=prompt_logprobs_wanted(body, logprobs),
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            min_p=body.min_p,
            logit_bias=body.logit_bias,
            bad_words_token_ids=self.bad_words_token_ids(body.bad_words or []),
            allowed_token_ids=body.allowed_token_ids,
            structured=structured,
            use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty,
            end_of_thinking=end_of_thinking,
            thinking_budget=thinking_budget,
            repetition_detection=repetition_detection(body.repetition_detection),
            extra_args=body.vllm_xargs,
        )

    # ------------------------------------------------------------------------ running requests
    async def choice_deltas(
        self, submissions: list[Submission], choices: list[Choice], timer: RequestTimer
    ) -> AsyncGenerator[list[ChoiceDelta], None]:
        """Run the submissions; per engine step, the deltas applied to `choices`.

        Closing this generator before it ends aborts every engine request still running.
        """
        streams = [
            self.engine.generate(
                s.request_id,
                s.prompt_ids if s.prompt_embeds is None else s.prompt_embeds,
                s.params,
                s.cache_salt,
                s.priority,
                s.stream_interval,
                s.lora_request,
            )
            for s in submissions
        ]
        async with aclosing(merge(streams)) as steps:
            async for i, deltas in steps:
                step = []
                for delta in deltas:
                    choice = choices[submissions[i].choice_offset + delta.index]
                    step.append(ChoiceDelta(choice, delta, len(choice.text)))
                    choice.add(delta)
                if any(delta.token_ids for delta in deltas):
                    timer.on_tokens()
                yield step
        timer.on_finish(
            prompt_tokens=sum(len(s.prompt_ids) for s in submissions),
            generated_tokens=sum(choice.num_tokens for choice in choices),
            longest_output=max(choice.num_tokens for choice in choices),
            finish_reasons=[choice.finish_reason for choice in choices if choice.finish_reason],
        )

    async def collect(self, submissions: list[Submission], timer: RequestTimer) -> list[Choice]:
        choices = new_choices(submissions)
        async with aclosing(self.choice_deltas(submissions, choices, timer)) as steps:
            async for _ in steps:
                pass
        return choices

    async def collect_or_answer_disconnect(
        self, request: Request, submissions: list[Submission], timer: RequestTimer
    ) -> list[Choice] | Response:
        """Collect a whole answer, giving up (and aborting) if the client leaves first."""
        return await self.answer_or_disconnect(request, self.collect(submissions, timer))

    async def answer_or_disconnect(self, request: Request, work: Awaitable[T]) -> T | Response:
        """The result of a whole answer's engine work, or the 4xx/5xx its failure means; the
        work is cancelled (its engine requests aborted) if the client leaves first."""
        try:
            return await until_disconnected(request, work)
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except RequestFailed as error:
            raise APIError(500, str(error)) from error
        except RequestRejected as error:  # at admission, in the engine
            raise bad_request(str(error), api_param(error.param)) from error
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)


def repetition_detection(params: RepetitionDetectionParams | None) -> RepetitionDetection | None:
    """The engine's detection, or None where the request turns it off (max_pattern_size 0)."""
    if params is None or params.max_pattern_size == 0:
        return None
    return RepetitionDetection(params.max_pattern_size, params.min_count, max(1, params.min_pattern_size))


def prompt_logprobs_wanted(
    body: CompletionRequest | ChatCompletionRequest, logprobs: int | None
) -> int | None:
    """How many top tokens the engine reports per prompt token: prompt_logprobs's, and as many
    as logprobs asks for when a completion echoes its prompt with logprobs."""
    if not body.echo or logprobs is None:
        return body.prompt_logprobs
    return max(body.prompt_logprobs or 0, logprobs)


def new_choices(submissions: list[Submission]) -> list[Choice]:
    return [
        Choice(
            index=s.choice_offset + i,
            prompt_ids=s.prompt_ids if s.prompt_embeds is None else None,
            echo=s.echo,
        )
        for s in submissions
        for i in range(s.params.n)
    ]


def usage(submissions: list[Submission], choices: list[Choice]) -> Usage:
    prompt_tokens = sum(len(s.prompt_ids) for s in submissions)
    completion_tokens = sum(choice.num_tokens for choice in choices)
    cached = sum(choices[s.choice_offset].num_cached_tokens for s in submissions)  # one per request
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def failure_status(error: Exception) -> int:
    """The status a failure after a stream began would have had: sent inside its error event."""
    return 503 if isinstance(error, EngineDeadError) else 400 if isinstance(error, RequestRejected) else 500


def error_event(error: Exception) -> str:
    """A failure after the stream began: the status is already sent, so the error travels as an event."""
    param = api_param(error.param) if isinstance(error, RequestRejected) else None
    return sse_event(error_body(failure_status(error), str(error), param))
