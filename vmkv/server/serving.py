"""The generation endpoints: turn an OpenAI request into engine requests and their outputs back.

Every check (model name, lengths, token ids, what the engine would refuse) happens before
anything reaches the engine, so a refused request leaves no trace. Each prompt becomes
one engine request whose n samples share the prompt's KV; its outputs arrive as per-step
deltas, which a stream forwards and a plain response accumulates.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from vmkv.engine import RequestRejected, SamplingParams
from vmkv.engine.outputs import PromptLogprob
from vmkv.engine.sampling_params import StructuredOutput
from vmkv.engine.structured_output import check_structured
from vmkv.server.engine_client import EngineClient, EngineDeadError, RequestFailed, SampleDelta, TokenLogprob
from vmkv.server.errors import APIError, bad_request, error_body
from vmkv.server.limits import RequestLimits
from vmkv.server.logprobs import LogprobFormatter
from vmkv.server.metrics import RequestTimer, ServingMetrics
from vmkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    Usage,
    now,
    random_id,
)
from vmkv.server.refusals import chat_refusals, check_supported, completion_refusals, sampling_refusals
from vmkv.server.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    merge,
    sse_event,
    until_disconnected,
)
from vmkv.server.structured_request import structured_specs
from vmkv.server.tool_calls import (
    answer_calls,
    call_stream,
    finish_reason,
    forced_tool,
    lets_model_call,
    template_tools,
)

# The status nginx made the convention for "client closed the request"; nobody is left to read it.
CLIENT_CLOSED_REQUEST = 499


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


@dataclass
class Choice:
    """A sample's output so far."""

    index: int
    prompt_ids: list[int]  # for echo with logprobs and return_token_ids
    echo: str = ""  # sent before the first generated text
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
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


# apply_chat_template's own parameters, and `messages`, the variable it renders the conversation
# as: chat_template_kwargs reach the template's other variables, never these.
CHAT_TEMPLATE_PARAMETERS = (
    frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
) | {"messages"}
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
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        self.tool_call_parser = tool_call_parser  # reads the calls of tool_choice "auto" (tool_parser.py)
        # No text longer than this fits max_model_len, whatever it says: refused untokenized.
        longest_token = max(len(token) for token in engine.tokenizer.get_vocab())
        self.max_prompt_chars = PROMPT_CHARS_SLACK * engine.max_model_len * longest_token

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    # ---------------------------------------------------------------- checks shared by endpoints
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model"
            )

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

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, object] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as the model's chat template writes it. continue_final_message leaves
        the last message open, so the answer continues it; template_kwargs are the template's
        own variables (for example a switch some templates read); tools go to templates that
        describe them to the model."""
        if not self.tokenizer.chat_template:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message continues the last message instead of opening a new one; "
                "set add_generation_prompt to false with it",
                "continue_final_message",
            )
        template_kwargs = template_kwargs or {}
        if taken := sorted(CHAT_TEMPLATE_PARAMETERS.intersection(template_kwargs)):
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(taken)}: those are the renderer's own "
                "parameters, not template variables",
                "chat_template_kwargs",
            )
        conversation = [template_message(message) for message in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except Exception as error:  # a template may refuse a conversation (e.g. its role order)
            raise bad_request(f"the chat template refused these messages: {error}", "messages") from error

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
        """The prompt cut to truncate_prompt_tokens (-1: max_model_len): its last tokens, or its
        first with truncation_side right; a limit over max_model_len is a 400, as in vLLM."""
        keep, limit = body.truncate_prompt_tokens, self.engine.max_model_len
        if keep is None:
            return prompt_ids
        if keep > limit:
            raise bad_request(
                f"truncate_prompt_tokens ({keep}) exceeds this model's maximum context length of {limit} "
                "tokens",
                "truncate_prompt_tokens",
            )
        keep = limit if keep == -1 else keep
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[len(prompt_ids) - keep :] if body.truncation_side == "left" else prompt_ids[:keep]

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
    ) -> Submission:
        """An engine request the engine is known to accept (anything else is a 400 naming the
        field to change: the engine's "prompt" is this route's `prompt_param`)."""
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        self.check_token_ids(body.logit_bias or {}, "logit_bias")
        self.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
        if body.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
            )
        top_k = min(body.top_k, self.engine.vocab_size) if body.top_k is not None and body.top_k > 0 else 0
        params = SamplingParams(
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
        )
        try:
            self.engine.check_priority(body.priority)
            self.engine.validate(prompt_ids, params)
        except RequestRejected as error:
            raise bad_request(str(error), prompt_param if error.param == "prompt" else error.param) from error
        return Submission(request_id, prompt_ids, params, choice_offset, body.cache_salt, body.priority)

    # ---------------------------------------------------------------------------- completions
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        check_supported(completion_refusals(body) + sampling_refusals(body))
        self.check_alive()
        request_id = random_id("cmpl")
        submissions = []
        prompts = completion_prompts(body)
        self.check_limits(len(prompts), body)
        structured = await self.structured_output(body)
        encoded = await self.prompt_token_ids(prompts, body.add_special_tokens)
        for i, (prompt, whole) in enumerate(zip(prompts, encoded, strict=True)):
            prompt_ids = self.truncated(whole, body)
            max_tokens = self.max_tokens_for(len(prompt_ids), body.max_tokens, "prompt")
            submission = self.submission(
                f"{request_id}-{i}",
                prompt_ids,
                body,
                max_tokens,
                body.logprobs,
                i * body.n,
                structured,
                "prompt",
            )
            if body.echo:  # the prompt as the model saw it: its text unless cut or given as ids
                uncut = isinstance(prompt, str) and len(prompt_ids) == len(whole)
                submission.echo = prompt if uncut else self.tokenizer.decode(prompt_ids)
            submissions.append(submission)
        logprob_format = LogprobFormatter(self.tokenizer, bool(body.return_tokens_as_token_ids))
        timer = self.metrics.timer()
        if body.stream:
            return EventStreamResponse(
                self.completion_events(body, request_id, submissions, timer, logprob_format)
            )
        choices = await self.collect_or_answer_disconnect(request, submissions, timer)
        if isinstance(choices, Response):
            return choices
        response = CompletionResponse(
            id=request_id,
            model=self.model_name,
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
            usage=usage(submissions, choices),
        )
        return JSONResponse(response.model_dump())

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
                    id=request_id, created=created, model=self.model_name, choices=chunk_choices, usage=usage_
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

    # ----------------------------------------------------------------------------------- chat
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        check_supported(chat_refusals(body, self.tool_call_parser is not None) + sampling_refusals(body))
        self.check_alive()
        self.check_limits(1, body)
        structured = await self.structured_output(body, [("tool_choice", forced_tool(body))])
        text = self.render_chat(
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
            template_tools(body),
        )
        prompt_ids = self.truncated(await self.encode(text, add_special_tokens=False, param="messages"), body)
        max_tokens = self.max_tokens_for(len(prompt_ids), body.max_new_tokens, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request_id = random_id("chatcmpl")
        submission = self.submission(
            request_id, prompt_ids, body, max_tokens, logprobs, 0, structured, "messages"
        )
        last = body.messages[-1]
        if body.echo and last.role == "assistant":  # vLLM's chat echo: the message being continued
            submission.echo = last.text
        submissions = [submission]
        logprob_format = LogprobFormatter(self.tokenizer, bool(body.return_tokens_as_token_ids))
        timer = self.metrics.timer()
        if body.stream:
            return EventStreamResponse(self.chat_events(body, request_id, submissions, timer, logprob_format))
        choices = await self.collect_or_answer_disconnect(request, submissions, timer)
        if isinstance(choices, Response):
            return choices
        response = ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[self.chat_choice(body, choice, logprob_format) for choice in choices],
            usage=usage(submissions, choices),
            prompt_logprobs=logprob_format.prompt(choices[0].prompt_logprobs, body.prompt_logprobs),
            prompt_token_ids=prompt_ids if body.return_token_ids else None,
        )
        return JSONResponse(response.model_dump())

    def parses_calls(self, body: ChatCompletionRequest) -> bool:
        """Whether the answer is read for calls the model chose to make (tool_choice "auto")."""
        return self.tool_call_parser is not None and lets_model_call(body)

    def chat_choice(
        self, body: ChatCompletionRequest, choice: Choice, logprob_format: LogprobFormatter
    ) -> ChatChoice:
        content, calls = answer_calls(body, choice.text, self.parses_calls(body))
        return ChatChoice(
            index=choice.index,
            message=AssistantMessage(
                content=None if content is None else choice.echo + content, tool_calls=calls
            ),
            logprobs=logprob_format.chat(choice.logprobs, body.top_logprobs) if body.logprobs else None,
            finish_reason=finish_reason(body, choice.finish_reason, bool(calls)),
            stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if body.return_token_ids else None,
        )

    async def chat_events(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        submissions: list[Submission],
        timer: RequestTimer,
        logprob_format: LogprobFormatter,
    ) -> AsyncGenerator[str, None]:
        created = now()
        choices = new_choices(submissions)
        # where the answer may hold tool calls, each choice's text turns into tool-call deltas
        calls = {choice.index: call_stream(body, self.parses_calls(body)) for choice in choices}

        with_tokens = body.logprobs or bool(body.return_token_ids)

        def delta_message(item: ChoiceDelta) -> DeltaMessage | None:
            """What the choice says this step: its new text, or the tool calls it makes."""
            stream = calls[item.choice.index]
            if stream is None:
                return DeltaMessage(content=item.delta.text) if item.delta.text else None
            return stream.delta(item.delta.text, item.delta.finish_reason is not None)

        def called(item: ChoiceDelta) -> bool:
            stream = calls[item.choice.index]
            return stream is not None and stream.called

        def chunk(
            chunk_choices: list[ChatChunkChoice],
            final_usage: bool = False,
            prompt_ids: list[int] | None = None,
        ) -> str:
            usage_ = usage(submissions, choices) if final_usage or body.continuous_usage else None
            return sse_event(
                ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=chunk_choices,
                    usage=usage_,
                    prompt_token_ids=prompt_ids,
                )
            )

        try:
            yield chunk(
                [
                    ChatChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content=""))
                    for choice in choices
                ],
                prompt_ids=submissions[0].prompt_ids if body.return_token_ids else None,
            )
            if submissions[0].echo:
                yield chunk(
                    [
                        ChatChunkChoice(index=choice.index, delta=DeltaMessage(content=choice.echo))
                        for choice in choices
                    ]
                )
            async with aclosing(self.choice_deltas(submissions, choices, timer)) as steps:
                async for step in steps:
                    chunk_choices = []
                    for item in step:
                        delta = delta_message(item)
                        if delta is None and not item.worth_sending(with_tokens, with_text=False):
                            continue
                        delta = delta or DeltaMessage()
                        chunk_choices.append(
                            ChatChunkChoice(
                                index=item.choice.index,
                                delta=delta,
                                logprobs=(
                                    logprob_format.chat(item.delta.logprobs or [], body.top_logprobs)
                                    if body.logprobs
                                    else None
                                ),
                                finish_reason=finish_reason(body, item.delta.finish_reason, called(item)),
                                stop_reason=item.delta.stop_reason,
                                token_ids=item.delta.token_ids if body.return_token_ids else None,
                            )
                        )
                    if chunk_choices:
                        yield chunk(chunk_choices)
            if body.include_usage:
                yield chunk([], final_usage=True)
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            yield error_event(error)
        yield DONE_EVENT

    # ------------------------------------------------------------------------ running requests
    async def choice_deltas(
        self, submissions: list[Submission], choices: list[Choice], timer: RequestTimer
    ) -> AsyncGenerator[list[ChoiceDelta], None]:
        """Run the submissions; per engine step, the deltas applied to `choices`.

        Closing this generator before it ends aborts every engine request still running.
        """
        streams = [
            self.engine.generate(s.request_id, s.prompt_ids, s.params, s.cache_salt, s.priority)
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
        try:
            return await until_disconnected(request, self.collect(submissions, timer))
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except RequestFailed as error:
            raise APIError(500, str(error)) from error
        except RequestRejected as error:
            raise bad_request(str(error)) from error
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates read it: earlier tool calls with their arguments as objects
    (templates write them with `tojson`, as vLLM passes them), a tool's answer with its call id."""
    rendered: dict = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": arguments},
            }
            for call in message.tool_calls
            for arguments in [json_or_text(call.function.arguments)]
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def completion_prompts(body: CompletionRequest) -> list[str] | list[list[int]]:
    """The request's prompts: one text, several texts, one token-id list or several."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(item) == 0 for item in prompt):
        raise bad_request("the prompt is empty", "prompt")
    return prompt


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
        Choice(index=s.choice_offset + i, prompt_ids=s.prompt_ids, echo=s.echo)
        for s in submissions
        for i in range(s.params.n)
    ]


def usage(submissions: list[Submission], choices: list[Choice]) -> Usage:
    prompt_tokens = sum(len(s.prompt_ids) for s in submissions)
    completion_tokens = sum(choice.num_tokens for choice in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def error_event(error: Exception) -> str:
    """A failure after the stream began: the status is already sent, so the error travels as an event."""
    status = 503 if isinstance(error, EngineDeadError) else 400 if isinstance(error, RequestRejected) else 500
    return sse_event(error_body(status, str(error)))
