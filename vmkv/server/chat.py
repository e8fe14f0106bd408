"""/v1/chat/completions: the conversation rendered with the model's chat template, one engine
request whose n samples are the choices; echo of an assistant message, tool calls, and the stream."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from vmkv.engine import RequestRejected
from vmkv.server.chat_template import template_variables
from vmkv.server.engine_client import EngineClient, EngineDeadError, RequestFailed
from vmkv.server.errors import bad_request, params_renamed
from vmkv.server.functions import (
    TOOL_FIELDS,
    as_tools_request,
    function_choice,
    function_chunk_choice,
    uses_functions,
)
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
    DeltaMessage,
    engine_request_id,
    now,
)
from vmkv.server.reasoning import END, ReasoningStream, split_reasoning, thinks_first
from vmkv.server.refusals import chat_refusals, check_supported, sampling_refusals
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
from vmkv.server.tool_calls import (
    answer_calls,
    call_stream,
    finish_reason,
    forced_tool,
    lets_model_call,
    template_tools,
)

# apply_chat_template's own parameters, and `messages`, the variable it renders the conversation
# as: chat_template_kwargs reach the template's other variables, never these.
CHAT_TEMPLATE_PARAMETERS = (
    frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
) | {"messages"}


@dataclass
class ChatRun:
    """A chat request made ready for the engine, and how its answer is read."""

    request_id: str
    submissions: list[Submission]
    reasoning: str | None  # the reasoning parser, when the model thinks first
    prompt_text: str  # the conversation as the template wrote it


class ChatServing(OpenAIServing):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: ServingMetrics,
        limits: RequestLimits,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        stream_interval: int = 1,
    ) -> None:
        super().__init__(engine, model_name, metrics, limits, stream_interval)
        self.tool_call_parser = tool_call_parser  # reads the calls of tool_choice "auto" (tool_parser.py)
        self.reasoning_parser = reasoning_parser  # splits the reasoning from the answer (reasoning.py)
        # where an output constraint starts when the model thinks first
        self.end_of_thinking = (
            self.tokenizer(END, add_special_tokens=False)["input_ids"] if reasoning_parser else None
        )
        self.chat_template = chat_template  # the server's, in place of the model's (None: the model's)
        self.trust_request_chat_template = trust_request_chat_template
        self.template_variables = template_variables(chat_template or self.tokenizer.chat_template)
        if chat_template is not None:  # a broken one fails the start, not every request
            try:
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}], tokenize=False, chat_template=chat_template
                )
            except Exception as error:
                raise ValueError(
                    f"the chat template does not render a one-message conversation: {error}"
                ) from error

    def request_template(self, template: str | None) -> str | None:
        """A request's own chat template, where the server trusts requests with one."""
        if template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "a template in a request is code the server would run; this server renders with its own "
                "(start it with --trust-request-chat-template to take one)",
                "chat_template",
            )
        return template

    def effort_kwargs(self, body: ChatCompletionRequest) -> dict[str, object]:
        """reasoning_effort as vLLM passes it: the template's own variable, and enable_thinking
        off for "none" (on otherwise) unless chat_template_kwargs sets it. A 400 where the
        template reads neither: the effort would change nothing."""
        effort = body.reasoning_effort
        if effort is None:
            return {}
        variables = template_variables(body.chat_template) if body.chat_template else self.template_variables
        if not variables & {"reasoning_effort", "enable_thinking"}:
            raise bad_request(
                "the chat template has no reasoning switch (it reads neither reasoning_effort nor "
                "enable_thinking)",
                "reasoning_effort",
            )
        kwargs: dict[str, object] = {"reasoning_effort": effort}
        if "enable_thinking" not in (body.chat_template_kwargs or {}):
            kwargs["enable_thinking"] = effort != "none"
        return kwargs

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, object] | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The conversation as the chat template writes it: a request's `chat_template`, else the
        server's, else the model's. continue_final_message leaves the last message open, so the
        answer continues it; template_kwargs are the template's own variables (for example a
        switch some templates read); tools go to templates that describe them to the model, and
        documents to those that read them (a 400 for one that does not: they would change nothing)."""
        template = chat_template or self.chat_template
        if not (template or self.tokenizer.chat_template):
            raise bad_request(
                "this model has no chat template; start the server with --chat-template, or use "
                "/v1/completions",
                "messages",
            )
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
        if documents is not None and "documents" not in template_variables(
            template or self.tokenizer.chat_template
        ):
            raise bad_request("the chat template does not read documents", "documents")
        conversation = [template_message(message) for message in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=template,
                documents=documents,
                **template_kwargs,
            )
        except Exception as error:  # a template may refuse a conversation (e.g. its role order)
            if chat_template is not None and isinstance(error, jinja2.TemplateSyntaxError):
                raise bad_request(
                    f"chat_template is not a valid template: {error}", "chat_template"
                ) from error
            raise bad_request(f"the chat template refused these messages: {error}", "messages") from error

    def render_request(self, body: ChatCompletionRequest) -> str:
        """The request's prompt text: its conversation as its template writes it."""
        return self.render_chat(
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            (body.chat_template_kwargs or {}) | self.effort_kwargs(body),
            template_tools(body.tools),
            self.request_template(body.chat_template),
            body.documents,
        )

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        functions = uses_functions(body)  # the deprecated spelling of tools, answered in it
        with params_renamed(TOOL_FIELDS if functions else {}):
            if functions:
                body = as_tools_request(body)
            run = await self.prepare(body, request=request)
        request_id, submissions, reasoning = run.request_id, run.submissions, run.reasoning
        prompt_ids = submissions[0].prompt_ids
        logprob_format = LogprobFormatter(self.tokenizer, bool(body.return_tokens_as_token_ids))
        timer = self.metrics.timer(request_id, body.session_id)
        if body.stream:
            return EventStreamResponse(self.chat_events(body, run, timer, logprob_format, functions))
        choices = await self.collect_or_answer_disconnect(request, submissions, timer)
        if isinstance(choices, Response):
            return choices
        response = ChatCompletionResponse(
            id=request_id,
            model=self.answer_model(submissions[0].lora_request),
            choices=[
                function_choice(answer) if functions else answer
                for choice in choices
                for answer in [self.chat_choice(body, choice, logprob_format, reasoning)]
            ],
            usage=usage(submissions, choices),
            prompt_logprobs=logprob_format.prompt(choices[0].prompt_logprobs, body.prompt_logprobs),
            prompt_token_ids=prompt_ids if body.return_token_ids else None,
            prompt_text=run.prompt_text if body.return_prompt_text else None,
        )
        return JSONResponse(response.model_dump())

    async def prepare(
        self, body: ChatCompletionRequest, id_prefix: str = "chatcmpl", request: Request | None = None
    ) -> ChatRun:
        """Check, render and tokenize a chat request into its engine request, or raise the 4xx.
        With `request`, the response id follows its X-Request-Id or the body's request_id."""
        self.check_model(body.model)
        check_supported(
            chat_refusals(body, self.tool_call_parser is not None)
            + sampling_refusals(body, self.tokenizer.is_fast)
        )
        if body.thinking_token_budget is not None and self.reasoning_parser is None:
            raise bad_request(
                "a thinking budget needs the server's --reasoning-parser, which knows where thinking ends",
                "thinking_token_budget",
            )
        self.check_alive()
        self.check_limits(1, body)
        structured = await self.structured_output(body, [("tool_choice", forced_tool(body))])
        # a request's template is code of unknown cost: rendered off the event loop's thread
        text = (
            await asyncio.to_thread(self.render_request, body)
            if body.chat_template
            else self.render_request(body)
        )
        prompt_ids = self.truncated(
            await self.encode(text, add_special_tokens=body.add_special_tokens, param="messages"), body
        )
        max_tokens = self.max_tokens_for(len(prompt_ids), body.max_new_tokens, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request_id = self.response_id(request, body.request_id, id_prefix)
        # A reasoning model thinks first (unless the prompt closed its thinking block): the answer
        # is split, and an output constraint holds from the end of the thinking.
        reasoning = self.reasoning_parser if thinks_first(text) else None
        budget = body.thinking_token_budget if reasoning is not None else None
        ends_thinking = reasoning is not None and (structured is not None or budget is not None)
        submission = self.submission(
            engine_request_id(request_id),
            prompt_ids,
            body,
            max_tokens,
            logprobs,
            0,
            structured,
            "messages",
            self.end_of_thinking if ends_thinking else None,
            thinking_budget=budget,
        )
        last = body.messages[-1]
        if body.echo and last.role == "assistant":  # vLLM's chat echo: the message being continued
            submission.echo = last.text
        return ChatRun(request_id, [submission], reasoning, text)

    def parses_calls(self, body: ChatCompletionRequest) -> bool:
        """Whether the answer is read for calls the model chose to make (tool_choice "auto")."""
        return self.tool_call_parser is not None and lets_model_call(body)

    def chat_choice(
        self,
        body: ChatCompletionRequest,
        choice: Choice,
        logprob_format: LogprobFormatter,
        reasoning_parser: str | None,
    ) -> ChatChoice:
        reasoning, text = (
            split_reasoning(choice.text, reasoning_parser) if reasoning_parser else (None, choice.text)
        )
        content, calls = answer_calls(body, text or "", self.parses_calls(body))
        if reasoning is not None and not content:
            content = None  # it all went to reasoning, as vLLM answers then
        return ChatChoice(
            index=choice.index,
            message=AssistantMessage(
                content=None if content is None else choice.echo + content,
                tool_calls=calls,
                reasoning=reasoning if body.include_reasoning else None,
            ),
            logprobs=logprob_format.chat(choice.logprobs) if body.logprobs else None,
            finish_reason=finish_reason(body, choice.finish_reason, bool(calls)),
            stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if body.return_token_ids else None,
        )

    async def chat_events(
        self,
        body: ChatCompletionRequest,
        run: ChatRun,
        timer: RequestTimer,
        logprob_format: LogprobFormatter,
        functions: bool = False,
    ) -> AsyncGenerator[str, None]:
        request_id, submissions, reasoning_parser = run.request_id, run.submissions, run.reasoning
        created = now()
        choices = new_choices(submissions)
        # where the answer may hold tool calls, each choice's text turns into tool-call deltas;
        # with a reasoning parser, only the text after its reasoning does
        calls = {choice.index: call_stream(body, self.parses_calls(body)) for choice in choices}
        thoughts = (
            {choice.index: ReasoningStream(reasoning_parser) for choice in choices}
            if reasoning_parser
            else {}
        )

        with_tokens = body.logprobs or bool(body.return_token_ids)

        def delta_message(item: ChoiceDelta) -> DeltaMessage | None:
            """What the choice says this step: its reasoning, new text, or the tool calls it makes."""
            text, finished, reasoning = item.delta.text, item.delta.finish_reason is not None, ""
            if thoughts:
                reasoning, text = thoughts[item.choice.index].delta(text, finished)
            stream = calls[item.choice.index]
            if stream is None:
                message = DeltaMessage(content=text) if text else None
            else:
                message = stream.delta(text, finished)
            if reasoning and body.include_reasoning:
                message = message or DeltaMessage()
                message.reasoning = reasoning
            return message

        def called(item: ChoiceDelta) -> bool:
            stream = calls[item.choice.index]
            return stream is not None and stream.called

        def chunk(
            chunk_choices: list[ChatChunkChoice],
            final_usage: bool = False,
            prompt_ids: list[int] | None = None,
            prompt_text: str | None = None,
        ) -> str:
            usage_ = usage(submissions, choices) if final_usage or body.continuous_usage else None
            return sse_event(
                ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=self.answer_model(submissions[0].lora_request),
                    choices=chunk_choices,
                    usage=usage_,
                    prompt_token_ids=prompt_ids,
                    prompt_text=prompt_text,
                )
            )

        try:
            yield chunk(
                [
                    ChatChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content=""))
                    for choice in choices
                ],
                prompt_ids=submissions[0].prompt_ids if body.return_token_ids else None,
                prompt_text=run.prompt_text if body.return_prompt_text else None,
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
                        chunk_choice = ChatChunkChoice(
                            index=item.choice.index,
                            delta=delta,
                            logprobs=(
                                logprob_format.chat(item.delta.logprobs or []) if body.logprobs else None
                            ),
                            finish_reason=finish_reason(body, item.delta.finish_reason, called(item)),
                            stop_reason=item.delta.stop_reason,
                            token_ids=item.delta.token_ids if body.return_token_ids else None,
                        )
                        chunk_choices.append(
                            function_chunk_choice(chunk_choice) if functions else chunk_choice
                        )
                    if chunk_choices:
                        yield chunk(chunk_choices)
            if body.include_usage:
                yield chunk([], final_usage=True)
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            yield error_event(error)
        yield DONE_EVENT


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
