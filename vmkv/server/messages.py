"""/v1/messages: Anthropic's Messages API over the chat path, for the clients written against it
(its SDKs, coding agents). The request becomes a chat completion (the system prompt first, tool
results as tool messages, a final assistant message continued); its one answer comes back as
content blocks: thinking when a reasoning parser splits one off, text, then the tool uses;
streamed as the API's typed events. /v1/messages/count_tokens counts the prompt it would make."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vmkv.engine import RequestRejected
from vmkv.server.chat import ChatRun, ChatServing
from vmkv.server.engine_client import EngineDeadError, RequestFailed
from vmkv.server.errors import ANTHROPIC_PATH, bad_request, error_body, params_renamed
from vmkv.server.messages_protocol import (
    ContentOut,
    MessageObject,
    MessagesInput,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextOut,
    ThinkingOut,
    TokenCount,
    ToolUseOut,
)
from vmkv.server.metrics import RequestTimer
from vmkv.server.protocol import ChatCompletionRequest, DeltaToolCall, TokenLogprob, ToolCall
from vmkv.server.reasoning import ReasoningStream, split_reasoning
from vmkv.server.refusals import Refusal, check_supported, missing_feature_refusals
from vmkv.server.responses import step_events
from vmkv.server.serving import Choice, failure_status, new_choices, usage
from vmkv.server.streaming import EventStreamResponse, typed_event
from vmkv.server.tool_calls import answer_calls, call_stream

# the chat request's fields an error may name -> this request's field they come from
CHAT_FIELDS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config",
    "thinking_token_budget": "thinking",
    "parallel_tool_calls": "tool_choice",
    "continue_final_message": "messages",
}
THINKING_SWITCHES = {"reasoning_effort", "enable_thinking"}  # template variables that turn it off


def messages_refusals(body: MessagesRequest) -> list[Refusal]:
    return [
        ("mcp_servers", body.mcp_servers is not None, "this server connects to no MCP servers"),
        ("container", body.container is not None, "this server runs no code containers"),
        ("speed", body.speed == "fast", "this server has one speed, standard"),
        ("inference_geo", body.inference_geo is not None, "this server runs where it is started"),
        ("diagnostics", body.diagnostics is not None, "this server reports no request diagnostics"),
        *missing_feature_refusals(body),
    ]


class MessagesServing:
    """Over the chat endpoint's serving: its checks, rendering, engine requests and metrics."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        check_supported(messages_refusals(body))
        with params_renamed(CHAT_FIELDS):
            budget = (
                body.thinking.budget_tokens if body.thinking and body.thinking.type == "enabled" else None
            )
            chat_body = body.as_chat(self.reasoning_effort(body), budget)
            run = await self.chat.prepare(chat_body, id_prefix="msg")
        timer = self.chat.metrics.timer(run.request_id)
        if body.stream:
            return EventStreamResponse(self.events(chat_body, run, timer))
        choices = await self.chat.collect_or_answer_disconnect(request, run.submissions, timer)
        if isinstance(choices, Response):
            return choices
        return JSONResponse(self.answer(chat_body, run, choices[0]).model_dump())

    async def count_tokens(self, body: MessagesInput) -> TokenCount:
        """The prompt's tokens, as /v1/messages would make it (a final assistant message continued)."""
        self.chat.check_model(body.model)
        with params_renamed(CHAT_FIELDS):
            chat_body = ChatCompletionRequest(**body.prompt_fields(self.reasoning_effort(body)))
            text = self.chat.render_request(chat_body)
            tokens = await self.chat.encode(text, add_special_tokens=False, param="messages")
        return TokenCount(input_tokens=len(tokens))

    def reasoning_effort(self, body: MessagesInput) -> str | None:
        """`thinking` and `output_config.effort` as the chat request's reasoning_effort: both
        work through the template's reasoning switch. "disabled" turns thinking off where the
        template has one, and changes nothing for a model that does not think (no reasoning
        parser); "adaptive" leaves it to the model, as does "enabled", whose budget the chat
        request's thinking_token_budget enforces."""
        thinking, effort = body.thinking, body.output_config and body.output_config.effort
        switch = bool(self.chat.template_variables & THINKING_SWITCHES)
        if effort is not None and not switch:
            raise bad_request(
                "the chat template has no reasoning switch (it reads neither reasoning_effort nor "
                "enable_thinking), so an effort would change nothing",
                "output_config",
            )
        if thinking is None or thinking.type != "disabled":
            return effort
        if effort is not None:
            raise bad_request("an effort sets the thinking that thinking disabled turns off", "output_config")
        if switch:
            return "none"
        if self.chat.reasoning_parser is not None:
            raise bad_request("the chat template has no switch to turn thinking off", "thinking")
        return None

    # ------------------------------------------------------------------------ answering
    def answer(self, chat_body: ChatCompletionRequest, run: ChatRun, choice: Choice) -> MessageObject:
        reasoning, text = (
            split_reasoning(choice.text, run.reasoning) if run.reasoning else (None, choice.text)
        )
        content: list[ContentOut] = [ThinkingOut(thinking=reasoning)] if reasoning else []
        said, calls = answer_calls(chat_body, text or "", self.chat.parses_calls(chat_body))
        uses = tool_uses(calls or [])
        if uses is None:  # calls whose arguments never closed (cut by max_tokens): their text
            said, uses = text, []
        content += ([TextOut(text=said)] if said else []) + uses
        return self.envelope(run, content, choice, bool(uses))

    def envelope(
        self, run: ChatRun, content: list[ContentOut], choice: Choice | None, called: bool = False
    ) -> MessageObject:
        """The message: as it starts while `choice` is None, else finished with its usage."""
        if choice is None:
            stop_reason, stop_sequence = None, None
            counted = MessagesUsage(input_tokens=len(run.submissions[0].prompt_ids), output_tokens=0)
        else:
            stop_reason, stop_sequence = stop(choice, called)
            counted = self.usage(run, choice)
        return MessageObject(
            id=run.request_id,
            model=self.chat.answer_model(run.submissions[0].lora_request),
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=counted,
        )

    def usage(self, run: ChatRun, choice: Choice) -> MessagesUsage:
        counted = usage(run.submissions, [choice])
        cached = counted.prompt_tokens_details.cached_tokens
        return MessagesUsage(
            input_tokens=counted.prompt_tokens - cached,
            output_tokens=counted.completion_tokens,
            cache_read_input_tokens=cached,
        )

    # ------------------------------------------------------------------------ streaming
    async def events(
        self, chat_body: ChatCompletionRequest, run: ChatRun, timer: RequestTimer
    ) -> AsyncGenerator[str, None]:
        stream = MessageStream()
        thoughts = ReasoningStream(run.reasoning) if run.reasoning else None
        calls = call_stream(chat_body, self.chat.parses_calls(chat_body))  # None: the answer is text
        choices = new_choices(run.submissions)
        yield stream.event("message_start", message=self.envelope(run, [], None))
        try:
            async with aclosing(self.chat.choice_deltas(run.submissions, choices, timer)) as steps:
                async for step in steps:
                    for item in step:
                        for event in step_events(stream, item.delta, [], thoughts, calls):
                            yield event
            for event in stream.close():
                yield event
            (choice,) = choices
            stop_reason, stop_sequence = stop(choice, stream.called)
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            yield stream.event("message_delta", delta=delta, usage=self.usage(run, choice))
            yield stream.event("message_stop")
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            body = error_body(failure_status(error), str(error), path=ANTHROPIC_PATH)
            yield stream.event("error", error=body["error"])


@dataclass
class MessageStream:
    """The content blocks of a streamed message as they open, grow and stop, as events (the
    methods step_events calls, as the Responses stream has them)."""

    blocks: int = 0  # opened so far; the open one, if any, is the last
    open: str | None = None  # the open block's type
    called: bool = False

    def event(self, kind: str, **fields: object) -> str:
        return typed_event(kind, fields)

    def delta(self, **delta: object) -> str:
        return self.event("content_block_delta", index=self.blocks - 1, delta=delta)

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        opened = self.start(ThinkingOut(thinking="")) if self.open != "thinking" else []
        return [*opened, self.delta(type="thinking_delta", thinking=delta)]

    def text(self, delta: str, logprobs: list[TokenLogprob]) -> list[str]:
        if not delta:
            return []
        opened = self.start(TextOut(text="")) if self.open != "text" else []
        return [*opened, self.delta(type="text_delta", text=delta)]

    def call(self, delta: DeltaToolCall) -> list[str]:
        """A tool call's delta: its first (with the id and name) opens a tool_use block."""
        events = []
        if delta.id is not None:
            self.called = True
            events += self.start(ToolUseOut(id=delta.id, name=delta.function.name or "", input={}))
        if delta.function.arguments:
            events.append(self.delta(type="input_json_delta", partial_json=delta.function.arguments))
        return events

    def start(self, block: ContentOut) -> list[str]:
        events = self.close()
        self.blocks += 1
        self.open = block.type
        return [*events, self.event("content_block_start", index=self.blocks - 1, content_block=block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.blocks - 1)]


def stop(choice: Choice, called: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished answer, in Anthropic's terms."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def tool_uses(calls: list[ToolCall]) -> list[ToolUseOut] | None:
    """The calls as tool_use blocks; None when an argument text is not a JSON object."""
    uses = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict):
            return None
        uses.append(ToolUseOut(id=call.id, name=call.function.name, input=arguments))
    return uses
