"""/v1/responses: OpenAI's Responses API over the chat path. The request becomes a chat
completion (instructions as a system message, `text.format` as response_format), and its one
answer comes back as output items: a reasoning item when a reasoning parser splits one off,
then the assistant message; streamed as the API's typed events, each with its sequence number.
Nothing is stored, so a response cannot be fetched again or continued by its id."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic_core import to_jsonable_python

from vmkv.engine import RequestRejected
from vmkv.server.chat import ChatRun, ChatServing
from vmkv.server.engine_client import EngineDeadError, RequestFailed, SampleDelta
from vmkv.server.errors import APIError
from vmkv.server.logprobs import LogprobFormatter
from vmkv.server.metrics import RequestTimer
from vmkv.server.protocol import ChatCompletionRequest, DeltaToolCall, TokenLogprob, now
from vmkv.server.reasoning import ReasoningStream, split_reasoning
from vmkv.server.refusals import Refusal, check_supported
from vmkv.server.responses_protocol import (
    INCLUDE_LOGPROBS,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vmkv.server.serving import Choice, new_choices, usage
from vmkv.server.streaming import EventStreamResponse
from vmkv.server.tool_calls import ForcedCallStream, answer_calls, call_stream, forces_calls
from vmkv.server.tool_parser import HermesStream

# the chat request's fields an error may name -> this request's field they come from
CHAT_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}


def response_refusals(body: ResponsesRequest) -> list[Refusal]:
    return [
        ("previous_response_id", body.previous_response_id is not None, "this server stores no responses"),
        (
            "reasoning",
            body.reasoning is not None and body.reasoning.summary is not None,
            "reasoning summaries are not written; the reasoning comes whole, in a reasoning item",
        ),
        ("background", bool(body.background), "responses are answered in the request"),
        ("truncation", body.truncation == "auto", "a prompt too long is refused, not cut"),
        (
            "include",
            any(item != INCLUDE_LOGPROBS for item in body.include or []),
            f"only {INCLUDE_LOGPROBS} can be included",
        ),
    ]


class ResponsesServing:
    """Over the chat endpoint's serving: its checks, rendering, engine requests and metrics."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        check_supported(response_refusals(body))
        chat, chat_body = self.chat, body.as_chat()
        try:
            run = await chat.prepare(chat_body, id_prefix="resp")
        except APIError as error:  # the chat request's field names, as this request spells them
            error.param = CHAT_FIELDS.get(error.param, error.param)
            raise
        logprob_format = LogprobFormatter(chat.tokenizer, False)
        timer = chat.metrics.timer()
        if body.stream:
            return EventStreamResponse(self.response_events(body, chat_body, run, timer, logprob_format))
        choices = await chat.collect_or_answer_disconnect(request, run.submissions, timer)
        if isinstance(choices, Response):
            return choices
        (choice,) = choices
        reasoning, text = (
            split_reasoning(choice.text, run.reasoning) if run.reasoning else (None, choice.text)
        )
        status = item_status(choice)
        output: list[OutputItem] = []
        if reasoning is not None:
            output.append(
                ReasoningItem(id=item_id("rs", run), content=[ReasoningText(text=reasoning)], status=status)
            )
        parses = chat.parses_calls(chat_body)
        content, calls = answer_calls(chat_body, text or "", parses)
        if content or not calls:
            # an answer that may call tools carries none, streamed or not (its tokens may be calls)
            may_call = parses or forces_calls(chat_body)
            logprobs = logprob_format.chat(choice.logprobs).content if body.logprobs and not may_call else []
            parts = [OutputText(text=content or "", logprobs=logprobs)]
            output.append(OutputMessage(id=item_id("msg", run), status=status, content=parts))
        output += [
            FunctionCallItem(
                id=f"fc_{call.id}",
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status=status,
            )
            for call in calls or []
        ]
        return JSONResponse(self.envelope(body, run, now(), output, choice).model_dump(by_alias=True))

    def envelope(
        self,
        body: ResponsesRequest,
        run: ChatRun,
        created: int,
        output: list[OutputItem],
        choice: Choice | None,
    ) -> ResponseObject:
        """The response object: in progress while `choice` is None, else finished with its usage."""
        status = "in_progress" if choice is None else item_status(choice)
        return ResponseObject(
            id=run.request_id,
            created_at=created,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.chat.model_name,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=body.temperature,
            top_p=body.top_p,
            top_logprobs=body.top_logprobs,
            text=body.text.model_dump(by_alias=True, exclude_none=True),
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            reasoning=None if body.reasoning is None else body.reasoning.model_dump(),
            usage=None if choice is None else self.response_usage(run, choice),
            user=body.user,
            metadata=body.metadata or {},
        )

    def response_usage(self, run: ChatRun, choice: Choice) -> ResponseUsage:
        """The chat answer's usage, under the Responses API's names, with its reasoning tokens."""
        counted = usage(run.submissions, [choice])
        return ResponseUsage(
            input_tokens=counted.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=counted.prompt_tokens_details.cached_tokens
            ),
            output_tokens=counted.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens(run, choice)),
            total_tokens=counted.total_tokens,
        )

    def reasoning_tokens(self, run: ChatRun, choice: Choice) -> int:
        """The output tokens up to the end of the thinking (all of them if it never ended)."""
        if run.reasoning is None:
            return 0
        end, tokens = self.chat.end_of_thinking, choice.token_ids
        for i in range(len(tokens) - len(end) + 1):
            if tokens[i : i + len(end)] == end:
                return i + len(end)
        return len(tokens)

    async def response_events(
        self,
        body: ResponsesRequest,
        chat_body: ChatCompletionRequest,
        run: ChatRun,
        timer: RequestTimer,
        logprob_format: LogprobFormatter,
    ) -> AsyncGenerator[str, None]:
        created = now()
        stream = ResponseStream(run)
        yield stream.event("response.created", response=self.envelope(body, run, created, [], None))
        yield stream.event("response.in_progress", response=self.envelope(body, run, created, [], None))
        thoughts = ReasoningStream(run.reasoning) if run.reasoning else None
        calls = call_stream(chat_body, self.chat.parses_calls(chat_body))  # None: the answer is text
        choices = new_choices(run.submissions)
        try:
            async with aclosing(self.chat.choice_deltas(run.submissions, choices, timer)) as steps:
                async for step in steps:
                    for item in step:
                        tokens = item.delta.logprobs or []
                        logprobs = logprob_format.chat(tokens).content if body.logprobs and not calls else []
                        for event in step_events(stream, item.delta, logprobs, thoughts, calls):
                            yield event
            (choice,) = choices
            for event in stream.close(item_status(choice)):
                yield event
            final = self.envelope(body, run, created, stream.items, choice)
            yield stream.event(f"response.{final.status}", response=final)
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            yield stream.event("error", code=type(error).__name__, message=str(error), param=None)


@dataclass
class ResponseStream:
    """The output items of a streamed response as they open, grow and close, as events."""

    run: ChatRun
    items: list[OutputItem] = field(default_factory=list)
    open: OutputItem | None = None
    sequence: itertools.count = field(default_factory=itertools.count)

    def event(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(to_jsonable_python(data, by_alias=True))}\n\n"

    def where(self) -> dict[str, object]:
        """Where the last item's content is: the open item, or the one finishing, is the last."""
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1, "content_index": 0}

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        if self.open is None:
            item = ReasoningItem(id=item_id("rs", self.run), status="in_progress")
            events += self.start(item, ReasoningText(text=""))
        self.open.content[0].text += delta
        return [*events, self.event("response.reasoning_text.delta", **self.where(), delta=delta)]

    def text(self, delta: str, logprobs: list[TokenLogprob]) -> list[str]:
        if not delta and not logprobs:
            return []
        events = []
        if not isinstance(self.open, OutputMessage):
            events += self.finish("completed") if self.open is not None else []
            events += self.start(
                OutputMessage(id=item_id("msg", self.run), status="in_progress"), OutputText(text="")
            )
        part = self.open.content[0]
        part.text += delta
        part.logprobs += logprobs
        delta_event = self.event("response.output_text.delta", **self.where(), delta=delta, logprobs=logprobs)
        return [*events, delta_event]

    def call(self, delta: DeltaToolCall) -> list[str]:
        """A tool call's delta: its first (with the id and name) opens a function_call item."""
        events = []
        if delta.id is not None:
            events += self.finish("completed") if self.open is not None else []
            name = delta.function.name or ""
            events += self.start(
                FunctionCallItem(id=f"fc_{delta.id}", call_id=delta.id, name=name, status="in_progress")
            )
        if delta.function.arguments:
            self.open.arguments += delta.function.arguments
            index = len(self.items) - 1
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open.id,
                    output_index=index,
                    delta=delta.function.arguments,
                )
            )
        return events

    def close(self, status: str) -> list[str]:
        """The end: the open item finishes, and an answer that said nothing and called nothing
        still gets its message."""
        events = self.finish(status) if self.open is not None else []
        if not any(isinstance(item, OutputMessage | FunctionCallItem) for item in self.items):
            events += self.start(
                OutputMessage(id=item_id("msg", self.run), status="in_progress"), OutputText(text="")
            )
            events += self.finish(status)
        return events

    def start(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[str]:
        self.items.append(item)
        self.open = item
        added = self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if part is None:  # a function call has arguments, not content parts
            return [added]
        item.content.append(part)
        return [added, self.event("response.content_part.added", **self.where(), part=part)]

    def finish(self, status: str) -> list[str]:
        item, index = self.open, len(self.items) - 1
        self.open = None
        item.status = status
        if isinstance(item, FunctionCallItem):
            done = self.event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
            return [done, self.event("response.output_item.done", output_index=index, item=item)]
        part = item.content[0]
        kind = "reasoning_text" if isinstance(item, ReasoningItem) else "output_text"
        extra = {} if kind == "reasoning_text" else {"logprobs": part.logprobs}
        events = [
            self.event(f"response.{kind}.done", **self.where(), text=part.text, **extra),
            self.event("response.content_part.done", **self.where(), part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        return events


def step_events(
    stream: ResponseStream,
    delta: SampleDelta,
    logprobs: list[TokenLogprob],
    thoughts: ReasoningStream | None,
    calls: ForcedCallStream | HermesStream | None,
) -> list[str]:
    """The events of one step's delta: its reasoning, then its text or the calls it makes."""
    text, finished = delta.text, delta.finish_reason is not None
    reasoning = ""
    if thoughts is not None:
        reasoning, text = thoughts.delta(text, finished)
    events = stream.reasoning(reasoning)
    if calls is None:
        return events + stream.text(text, logprobs)
    message = calls.delta(text, finished)
    if message is None:
        return events
    events += stream.text(message.content or "", [])
    for call in message.tool_calls or []:
        events += stream.call(call)
    return events


def item_status(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def item_id(prefix: str, run: ChatRun) -> str:
    return f"{prefix}_{run.request_id.removeprefix('resp-')}"
