"""Tool calls: what tool_choice asks of an answer, and the calls read out of it.

"required" and a named function force calls, and need no parser of the model's own format:
the answer is constrained (a structured output) to exactly the JSON of the calls, so it always
parses. A named function's answer is its arguments object; "required" answers an array of
`{"name", "parameters"}`, one item per call (vLLM's schema, so both servers constrain alike).
"auto" (the default with tools) lets the model choose, and needs the server's tool-call parser
for the model family's format (tool_parser.py); without one it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vmkv.engine.sampling_params import StructuredOutput
from vmkv.server.errors import bad_request
from vmkv.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from vmkv.server.tool_parser import HermesStream, new_call_id, parse_calls, whole_call_delta

EMPTY_OBJECT = {"type": "object", "properties": {}}


def forces_calls(body: ChatCompletionRequest) -> bool:
    return body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)


def lets_model_call(body: ChatCompletionRequest) -> bool:
    """Whether the model chooses for itself whether to call (tool_choice "auto", or none given)."""
    return bool(body.tools) and body.tool_choice in (None, "auto")


def forced_tool(body: ChatCompletionRequest) -> StructuredOutput | None:
    """The constraint a forcing tool_choice puts on the answer; None when it forces nothing.
    A choice that names no given tool, or one with no tools, is a 400 naming tool_choice."""
    choice = body.tool_choice
    if not forces_calls(body):
        return None
    tools = body.tools or []
    if not tools:
        raise bad_request(f"tool_choice {_spelled(choice)} needs tools", "tool_choice")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice"
            )
        schema = _parameters(tools[names.index(choice.function.name)])
    else:
        schema = _calls_schema(tools, body.parallel_tool_calls)
    return StructuredOutput("json", json.dumps(schema))


def answer_calls(
    body: ChatCompletionRequest, text: str, parse: bool
) -> tuple[str | None, list[ToolCall] | None]:
    """(content, calls) of a whole answer. A forced answer cut short (by max_tokens) before its
    JSON closed is content, but for a named call, which keeps the arguments it has; `parse`:
    the model chose for itself, and the server's parser reads its calls out of the text."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return None, [
            ToolCall(id=new_call_id(), function=FunctionCall(name=choice.function.name, arguments=text))
        ]
    if choice == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, None
        return None, [
            ToolCall(
                id=new_call_id(),
                function=FunctionCall(
                    name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False)
                ),
            )
            for item in items
        ]
    return parse_calls(text) if parse else (text, None)


def finish_reason(body: ChatCompletionRequest, reason: str | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when the answer made calls and ended on its own; "stop" for a named call."""
    named = isinstance(body.tool_choice, NamedToolChoice)
    return "tool_calls" if called and reason == "stop" and not named else reason


@dataclass
class ForcedCallStream:
    """One choice's streamed text as the deltas of its forced calls. A named call streams its
    arguments as they come; "required" calls go out whole when the answer is complete (their
    names are only known once each item has been read)."""

    body: ChatCompletionRequest
    call_id: str = field(default_factory=new_call_id)
    text: str = ""
    called: bool = False

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta for `text`, the choice's new text this step; None when nothing is due yet."""
        first = not self.text
        self.text += text
        choice = self.body.tool_choice
        if isinstance(choice, NamedToolChoice):
            if not text:
                return None
            self.called = True
            head = {"id": self.call_id, "type": "function"} if first else {}
            name = choice.function.name if first else None
            function = DeltaFunctionCall(name=name, arguments=text)
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, **head, function=function)])
        if not finished:
            return None
        content, calls = answer_calls(self.body, self.text, parse=False)
        if calls is None:
            return DeltaMessage(content=content) if content else None
        self.called = True
        return DeltaMessage(tool_calls=[whole_call_delta(call, i) for i, call in enumerate(calls)])


def call_stream(body: ChatCompletionRequest, parse: bool) -> ForcedCallStream | HermesStream | None:
    """What turns a streamed choice's text into deltas when it may hold calls; None when it cannot."""
    if forces_calls(body):
        return ForcedCallStream(body)
    return HermesStream() if parse else None


def template_tools(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The tools as chat templates read them (OpenAI's shape), whatever tool_choice says."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _parameters(tool: ToolDefinition) -> dict:
    return tool.function.parameters or EMPTY_OBJECT


def _calls_schema(tools: list[ToolDefinition], parallel: bool | None) -> dict:
    """A non-empty array of calls, each the name of one tool and its parameters (vLLM's
    schema); each tool's `$defs` move to the root, where its `#/$defs/...` refs point."""
    defs: dict = {}
    items = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"tools define $defs {name!r} differently", "tools")
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _spelled(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
