"""OpenAI's deprecated `functions` and `function_call`, served as tools with one call at most:
each function a tool, `function_call` ("none", "auto" or a function's name) the tool_choice,
parallel calls off; an earlier assistant `function_call` becomes its tool call and a
`function` message the tool's answer to it. The answer's call comes back where those clients
read it: `message.function_call` (`delta.function_call` in a stream), finish_reason
"function_call" for a call the model chose to make."""

from __future__ import annotations

from vmkv.server.errors import bad_request
from vmkv.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatMessage,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)

# the tools request's fields an error may name -> the field of this request they come from
TOOL_FIELDS = {"tools": "functions", "tool_choice": "function_call", "parallel_tool_calls": "function_call"}


def uses_functions(body: ChatCompletionRequest) -> bool:
    return body.functions is not None or body.function_call is not None


def as_tools_request(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """The same request in tools: a 400 naming `functions` when it sends both spellings."""
    if body.tools is not None or body.tool_choice is not None:
        raise bad_request(
            "functions and function_call are the deprecated spelling of tools; send one", "functions"
        )
    choice = body.function_call
    if isinstance(choice, NamedFunction):
        choice = NamedToolChoice(type="function", function=choice)
    return body.model_copy(
        update={
            "functions": None,
            "function_call": None,
            "messages": tool_messages(body.messages),
            "tools": [ToolDefinition(type="function", function=f) for f in body.functions or []] or None,
            "tool_choice": choice,
            "parallel_tool_calls": False,
        }
    )


def tool_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Earlier calls as tool calls with made-up ids, each `function` message answering the call
    before it."""
    converted, last_call = [], None
    for i, message in enumerate(messages):
        if message.role == "assistant" and message.function_call is not None:
            last_call = f"call_{i}"
            call = ToolCall(id=last_call, function=message.function_call)
            message = message.model_copy(update={"function_call": None, "tool_calls": [call]})
        elif message.role == "function":
            message = ChatMessage(
                role="tool", content=message.content, tool_call_id=last_call or message.name
            )
        converted.append(message)
    return converted


def function_choice(choice: ChatChoice) -> ChatChoice:
    """A tools answer as the functions API answers: its first call as `function_call`."""
    message = choice.message
    if message.tool_calls:
        message.function_call, message.tool_calls = message.tool_calls[0].function, None
    if choice.finish_reason == "tool_calls":
        choice.finish_reason = "function_call"
    return choice


def function_chunk_choice(choice: ChatChunkChoice) -> ChatChunkChoice:
    """A streamed tools delta as the functions API streams it: the first call's name and
    arguments as `function_call` pieces."""
    delta = choice.delta
    if delta.tool_calls:
        first = [call.function for call in delta.tool_calls if call.index == 0]
        delta.function_call, delta.tool_calls = (first[0] if first else None), None
    if choice.finish_reason == "tool_calls":
        choice.finish_reason = "function_call"
    return choice
