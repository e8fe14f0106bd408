"""Tool calls that the request forces: tool_choice "required" or a named function.

Neither needs a parser for the model's own tool-call format: the answer is constrained (a
structured output) to exactly the JSON of the call, so it always parses. A named function's
answer is its arguments object; "required" answers an array of `{"name", "parameters"}`, one
item per call (vLLM's schema, so both servers constrain alike). tool_choice "auto" would need a
parser per model family and is refused.
"""

from __future__ import annotations

import json
import uuid
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

EMPTY_OBJECT = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forces_calls(body: ChatCompletionRequest) -> bool:
    return body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)


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


def tool_calls(body: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The calls a forced answer makes; None if it forces none or the answer was cut short
    (by max_tokens) before its JSON closed, when the text goes back as content instead."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=choice.function.name, arguments=text))]
    if choice != "required":
        return None
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [
        ToolCall(
            id=new_call_id(),
            function=FunctionCall(
                name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False)
            ),
        )
        for item in items
    ]


def finish_reason(body: ChatCompletionRequest, reason: str | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when "required" made its calls; a named call finishes "stop"."""
    return "tool_calls" if body.tool_choice == "required" and called and reason == "stop" else reason


@dataclass
class ToolCallStream:
    """Turns one choice's streamed text into tool-call deltas. A named call streams its
    arguments as they come; "required" calls go out whole when the answer is complete (their
    names are only known once each item has been read)."""

    body: ChatCompletionRequest
    call_id: str = field(default_factory=new_call_id)
    text: str = ""

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta for `text`, the choice's new text this step; None when nothing is due yet."""
        first = not self.text
        self.text += text
        choice = self.body.tool_choice
        if isinstance(choice, NamedToolChoice):
            if not text:
                return None
            head = {"id": self.call_id, "type": "function"} if first else {}
            name = choice.function.name if first else None
            return DeltaMessage(
                tool_calls=[
                    DeltaToolCall(index=0, **head, function=DeltaFunctionCall(name=name, arguments=text))
                ]
            )
        if not finished:
            return None
        calls = tool_calls(self.body, self.text)
        if calls is None:  # cut short: what there is goes out as content
            return DeltaMessage(content=self.text) if self.text else None
        return DeltaMessage(
            tool_calls=[
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
                )
                for i, call in enumerate(calls)
            ]
        )


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates read them (OpenAI's shape), whatever tool_choice says."""
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


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
