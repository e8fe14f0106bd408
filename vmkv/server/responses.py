"""/v1/responses: OpenAI's Responses API over the chat path. The request becomes a chat
completion (instructions as a system message, `text.format` as response_format), and its one
answer comes back as output items: a reasoning item when a reasoning parser splits one off,
then the assistant message; streamed as the API's typed events, each with its sequence number.
Unless `store` is false, the response is kept (response_store.py): fetched again, continued by
`previous_response_id`, and with `background` run after the request returns, to be polled,
followed as a stream or cancelled."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vmkv.engine import RequestRejected
from vmkv.server.chat import ChatRun, ChatServing
from vmkv.server.engine_client import EngineDeadError, RequestFailed, SampleDelta
from vmkv.server.errors import bad_request, params_renamed
from vmkv.server.logprobs import LogprobFormatter
from vmkv.server.metrics import RequestTimer
from vmkv.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    now,
)
from vmkv.server.reasoning import ReasoningStream, split_reasoning
from vmkv.server.refusals import VERBOSITY, Refusal, check_supported, missing_feature_refusals
from vmkv.server.response_store import ResponseStore, StoredResponse
from vmkv.server.responses_protocol import (
    INCLUDE_LOGPROBS,
    FunctionCallItem,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vmkv.server.serving import Choice, new_choices, usage
from vmkv.server.streaming import EventStreamResponse, typed_event
from vmkv.server.tool_calls import ForcedCallStream, answer_calls, call_stream, forces_calls
from vmkv.server.tool_parser import HermesStream

logger = logging.getLogger(__name__)

# the chat request's fields an error may name -> this request's field they come from
CHAT_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}


def response_refusals(body: ResponsesRequest, keeps: bool) -> list[Refusal]:
    return [
        (
            "previous_response_id",
            body.previous_response_id is not None and not keeps,
            "this server keeps no responses (--responses-store-mib 0)",
        ),
        (
            "background",
            bool(body.background) and not keeps,
            "this server keeps no responses (--responses-store-mib 0), and a background one is fetched later",
        ),
        (
            "reasoning",
            body.reasoning is not None and body.reasoning.summary is not None,
            "reasoning summaries are not written; the reasoning comes whole, in a reasoning item",
        ),
        ("truncation", body.truncation == "auto", "a prompt too long is refused, not cut"),
        ("text", body.text.verbosity not in (None, "medium"), VERBOSITY),
        (
            "conversation",
            body.conversation is not None,
            "this server keeps no conversations; continue a kept response with previous_response_id",
        ),
        ("prompt", body.prompt is not None, "this server keeps no prompt templates; send the input"),
        ("context_management", body.context_management is not None, "a conversation is never compacted here"),
        (
            "include",
            any(item != INCLUDE_LOGPROBS for item in body.include or []),
            f"only {INCLUDE_LOGPROBS} can be included",
        ),
        ("service_tier", body.service_tier not in ("auto", "default"), "this server has one tier"),
        ("max_tool_calls", body.max_tool_calls is not None, "this server runs no built-in tools"),
        ("enable_response_messages", bool(body.enable_response_messages), "the output items are the answer"),
        (
            "previous_input_messages",
            body.previous_input_messages is not None,
            "continue a kept response with previous_response_id",
        ),
        *missing_feature_refusals(body),
    ]


@dataclass
class ResponseRun:
    """A response request made ready: its chat form, its engine request, and whether it is kept."""

    body: ResponsesRequest
    chat_body: ChatCompletionRequest
    chat_run: ChatRun
    conversation: list[ChatMessage]  # without the instructions: where a continuation starts
    keep: bool
    created: int = field(default_factory=now)

    @property
    def id(self) -> str:
        return self.chat_run.request_id


class ResponsesServing:
    """Over the chat endpoint's serving (its checks, rendering, engine requests and metrics),
    with the store that keeps responses to fetch, continue and run in the background."""

    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self.logprob_format = LogprobFormatter(chat.tokenizer, False)

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        check_supported(response_refusals(body, self.store.enabled))
        if body.background and body.store is False:
            raise bad_request("a background response is kept to be fetched: store cannot be false", "store")
        previous = self.previous(body)
        conversation = body.chat_conversation(previous.conversation if previous else [])
        chat_body = body.as_chat(conversation)
        with params_renamed(CHAT_FIELDS):
            chat_run = await self.chat.prepare(chat_body, id_prefix="resp", request=request)
        keep = self.store.enabled and body.store is not False
        if (
            keep and chat_run.request_id in self.store.entries
        ):  # ids a caller chose (request_id, X-Request-Id)
            raise bad_request(
                f"a kept response already has the id {chat_run.request_id!r}; kept responses' ids are unique",
                "request_id",
            )
        run = ResponseRun(body, chat_body, chat_run, conversation, keep)
        timer = self.chat.metrics.timer(run.id, body.session_id)
        if body.background:
            return self.start_in_background(run, timer)
        if body.stream:
            return EventStreamResponse(self.kept_events(run, timer))
        choices = await self.chat.collect_or_answer_disconnect(request, chat_run.submissions, timer)
        if isinstance(choices, Response):
            return choices
        response = self.answer(run, choices[0])
        self.keep(run, response)
        return JSONResponse(response.model_dump(by_alias=True))

    def previous(self, body: ResponsesRequest) -> StoredResponse | None:
        """The stored response a request continues, once its run has ended."""
        if body.previous_response_id is None:
            return None
        entry = self.store.get(body.previous_response_id, param="previous_response_id")
        if entry.running:
            raise bad_request(
                f"response {body.previous_response_id!r} is still running; continue it once it has finished",
                "previous_response_id",
            )
        return entry

    def keep(self, run: ResponseRun, response: ResponseObject) -> None:
        if run.keep:
            conversation = run.conversation + [answer_message(response)]
            self.store.add(StoredResponse(response, conversation, run.body.input_items(run.id)))

    # ------------------------------------------------------------------------ answering
    def answer(self, run: ResponseRun, choice: Choice) -> ResponseObject:
        """The finished response of a whole answer."""
        chat_run, chat_body = run.chat_run, run.chat_body
        reasoning, text = (
            split_reasoning(choice.text, chat_run.reasoning) if chat_run.reasoning else (None, choice.text)
        )
        status = item_status(choice)
        output: list[OutputItem] = []
        if reasoning is not None and run.body.include_reasoning:
            thinking = [ReasoningText(text=reasoning)]
            output.append(ReasoningItem(id=item_id("rs", run.id), content=thinking, status=status))
        parses = self.chat.parses_calls(chat_body)
        content, calls = answer_calls(chat_body, text or "", parses)
        if content or not calls:
            # an answer that may call tools carries none, streamed or not (its tokens may be calls)
            may_call = parses or forces_calls(chat_body)
            wanted = run.body.logprobs and not may_call
            logprobs = self.logprob_format.chat(choice.logprobs).content if wanted else []
            parts = [OutputText(text=content or "", logprobs=logprobs)]
            output.append(OutputMessage(id=item_id("msg", run.id), status=status, content=parts))
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
        return self.envelope(run, output, choice)

    def envelope(
        self,
        run: ResponseRun,
        output: list[OutputItem],
        choice: Choice | None,
        status: str | None = None,
        error: str | None = None,
    ) -> ResponseObject:
        """The response object: in progress (or `status`) while `choice` is None, else finished
        with its usage."""
        body = run.body
        status = status or ("in_progress" if choice is None else item_status(choice))
        return ResponseObject(
            id=run.id,
            created_at=run.created,
            status=status,
            background=bool(body.background),
            error=None if error is None else {"code": "server_error", "message": error},
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.chat.answer_model(run.chat_run.submissions[0].lora_request),
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=run.keep,
            temperature=body.temperature,
            top_p=body.top_p,
            top_logprobs=body.top_logprobs,
            text=body.text.model_dump(by_alias=True, exclude_none=True),
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            reasoning=None if body.reasoning is None else body.reasoning.model_dump(),
            usage=None if choice is None else self.response_usage(run.chat_run, choice),
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

    # ------------------------------------------------------------------------ streaming
    async def response_events(
        self, run: ResponseRun, timer: RequestTimer, stream: ResponseStream
    ) -> AsyncGenerator[str, None]:
        """The stream's events; at the end `stream.final` is the finished (or failed) response."""
        chat_run, chat_body = run.chat_run, run.chat_body
        yield stream.event("response.created", response=self.envelope(run, [], None))
        yield stream.event("response.in_progress", response=self.envelope(run, [], None))
        thoughts = ReasoningStream(chat_run.reasoning) if chat_run.reasoning else None
        calls = call_stream(chat_body, self.chat.parses_calls(chat_body))  # None: the answer is text
        choices = new_choices(chat_run.submissions)
        wanted = run.body.logprobs and not calls  # logprobs, of an answer that is text
        try:
            async with aclosing(self.chat.choice_deltas(chat_run.submissions, choices, timer)) as steps:
                async for step in steps:
                    for item in step:
                        tokens = item.delta.logprobs or []
                        logprobs = self.logprob_format.chat(tokens).content if wanted else []
                        shown = run.body.include_reasoning
                        for event in step_events(stream, item.delta, logprobs, thoughts, calls, shown):
                            yield event
            (choice,) = choices
            for event in stream.close(item_status(choice)):
                yield event
            stream.final = self.envelope(run, stream.items, choice)
            yield stream.event(f"response.{stream.final.status}", response=stream.final)
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            stream.final = self.envelope(run, stream.items, None, status="failed", error=str(error))
            yield stream.event("error", code=type(error).__name__, message=str(error), param=None)

    async def kept_events(self, run: ResponseRun, timer: RequestTimer) -> AsyncGenerator[str, None]:
        """A stream answered in its request, its response kept once it has ended."""
        stream = ResponseStream(run.id)
        async with aclosing(self.response_events(run, timer, stream)) as events:
            async for event in events:
                yield event
        self.keep(run, stream.final)

    # ------------------------------------------------------------------------ background
    def start_in_background(self, run: ResponseRun, timer: RequestTimer) -> Response:
        """Queue the response's run and answer at once: with the queued response, or with a
        stream that follows the run (its client may leave; the run goes on)."""
        entry = StoredResponse(
            self.envelope(run, [], None, status="queued"),
            conversation=run.conversation,
            input_items=run.body.input_items(run.id),
            events=[] if run.body.stream else None,
            done=False,
        )
        self.store.add(entry)
        entry.run = asyncio.create_task(self.run_in_background(run, entry, timer))
        if run.body.stream:
            return EventStreamResponse(entry.follow(None))
        return JSONResponse(entry.response.model_dump(by_alias=True))

    async def run_in_background(self, run: ResponseRun, entry: StoredResponse, timer: RequestTimer) -> None:
        """Run a background response to its end, keeping its state (and events) as it goes."""
        entry.response.status = "in_progress"
        try:
            if entry.events is None:
                choices = await self.chat.collect(run.chat_run.submissions, timer)
                entry.response = self.answer(run, choices[0])
            else:
                stream = ResponseStream(run.id)
                async with aclosing(self.response_events(run, timer, stream)) as events:
                    async for event in events:
                        entry.append(event)
                entry.response = stream.final
            if entry.response.status != "failed":  # a failed stream said nothing to continue from
                entry.conversation = run.conversation + [answer_message(entry.response)]
        except (EngineDeadError, RequestFailed, RequestRejected) as error:
            entry.response = self.envelope(run, [], None, status="failed", error=str(error))
        except Exception:  # a fault here: logged, and the response fails rather than hangs
            logger.exception("background response %s failed", run.id)
            entry.response = self.envelope(run, [], None, status="failed", error="internal error")
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
            raise
        finally:
            entry.done = True
            entry.wake()
            self.store.finished(entry)

    # ------------------------------------------------------------------------ stored responses
    def retrieve(self, response_id: str, stream: bool, starting_after: int | None) -> Response:
        """A stored response, or with `stream` a background stream's events again (from after
        `starting_after`), following the run while it goes on."""
        entry = self.store.get(response_id)
        if not stream:
            return JSONResponse(entry.response.model_dump(by_alias=True))
        if entry.events is None:
            raise bad_request(
                f"response {response_id!r} was not streamed in the background, so it has no events to "
                "stream again; fetch it without stream",
                "stream",
            )
        return EventStreamResponse(entry.follow(starting_after))

    def input_items(
        self, response_id: str, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> InputItemList:
        """A page of a kept response's input items, newest first unless `order` is asc."""
        items = self.store.get(response_id).input_items
        items = items[::-1] if order == "desc" else items
        start = 0
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"response {response_id!r} has no input item {after!r}", "after")
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=start + limit < len(items),
        )

    async def cancel(self, response_id: str) -> ResponseObject:
        """Stop a background response's run (its engine request is aborted, its KV freed)."""
        entry = self.store.get(response_id)
        if entry.run is None:
            raise bad_request(
                f"response {response_id!r} was answered in its request: only a background one can be "
                "cancelled",
                "response_id",
            )
        if entry.running:
            entry.run.cancel()
            await asyncio.wait([entry.run])
        elif entry.response.status != "cancelled":
            raise bad_request(
                f"response {response_id!r} has already ended ({entry.response.status})", "response_id"
            )
        return entry.response

    async def delete(self, response_id: str) -> ResponseDeleted:
        """Forget a stored response, cancelling its run if it still goes on."""
        entry = self.store.get(response_id)
        if entry.running:
            entry.run.cancel()
            await asyncio.wait([entry.run])
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)


@dataclass
class ResponseStream:
    """The output items of a streamed response as they open, grow and close, as events."""

    response_id: str
    items: list[OutputItem] = field(default_factory=list)
    open: OutputItem | None = None
    final: ResponseObject | None = None  # the finished (or failed) response, once the stream ends
    sequence: itertools.count = field(default_factory=itertools.count)

    def event(self, kind: str, **fields: object) -> str:
        return typed_event(kind, {"sequence_number": next(self.sequence), **fields})

    def where(self) -> dict[str, object]:
        """Where the last item's content is: the open item, or the one finishing, is the last."""
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1, "content_index": 0}

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        if self.open is None:
            item = ReasoningItem(id=item_id("rs", self.response_id), status="in_progress")
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
                OutputMessage(id=item_id("msg", self.response_id), status="in_progress"), OutputText(text="")
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
                OutputMessage(id=item_id("msg", self.response_id), status="in_progress"), OutputText(text="")
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
    show_reasoning: bool = True,
) -> list[str]:
    """The events of one step's delta: its reasoning (unless hidden), then its text or the calls
    it makes."""
    text, finished = delta.text, delta.finish_reason is not None
    reasoning = ""
    if thoughts is not None:
        reasoning, text = thoughts.delta(text, finished)
    events = stream.reasoning(reasoning) if show_reasoning else []
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


def item_id(prefix: str, response_id: str) -> str:
    return f"{prefix}_{response_id.removeprefix('resp-')}"


def answer_message(response: ResponseObject) -> ChatMessage:
    """A response's answer as the assistant message a continuation's conversation holds: its
    text and its calls (chat templates do not render past reasoning, so that is left out)."""
    text = "".join(
        part.text for item in response.output if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)
