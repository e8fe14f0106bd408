"""Tool calls a model makes of its own accord (tool_choice "auto"), in the Hermes format:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5, Qwen3 and the Hermes
models write them and their chat templates ask. Text before the first call is the content
(as vLLM's parser of the same name: text between or after calls is dropped).

A model family with another format needs its own parser; `--tool-call-parser` names the one
the server uses (vLLM's flag and parser name).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from vmkv.engine.stop_strings import partial_tag_len
from vmkv.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall

TOOL_CALL_PARSERS = ("hermes",)
START = "<tool_call>"
CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# closed calls, or one a finished answer left open at its end
CLOSED_OR_LAST = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, calls) of a whole answer; an answer whose calls do not all parse is content."""
    if START not in text:
        return text, None
    try:
        calls = [_call(m) for m in CLOSED_OR_LAST.finditer(text)]
    except ValueError:
        return text, None
    return text[: text.find(START)] or None, calls


@dataclass
class HermesStream:
    """One choice's streamed text as content and whole tool calls: content goes out as it comes
    (but for a tail that could begin a tag), each call once its closing tag is read; a call that
    does not parse goes out as the content it is."""

    text: str = ""
    content_sent: int = 0  # characters before the first call already sent
    calls_read: int = 0  # calls (parsed or not) already dealt with
    calls_sent: int = 0
    called: bool = False

    def delta(self, new: str, finished: bool) -> DeltaMessage | None:
        self.text += new
        start = self.text.find(START)
        if start != -1:
            end = start
        else:
            end = len(self.text) if finished else len(self.text) - partial_tag_len(self.text, (START,))
        content = self.text[self.content_sent : end]
        self.content_sent = max(self.content_sent, end)
        calls: list[DeltaToolCall] = []
        if start != -1:
            matches = list((CLOSED_OR_LAST if finished else CLOSED).finditer(self.text, start))
            for match in matches[self.calls_read :]:
                try:
                    call = _call(match)
                except ValueError:
                    content += match.group(0)
                    continue
                calls.append(whole_call_delta(call, self.calls_sent))
                self.calls_sent += 1
            self.calls_read = len(matches)
        self.called = self.called or bool(calls)
        if not (content or calls):
            return None
        return DeltaMessage(content=content or None, tool_calls=calls or None)


def whole_call_delta(call: ToolCall, index: int) -> DeltaToolCall:
    """A call sent in one stream delta: its id, type, name and all its arguments."""
    function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
    return DeltaToolCall(index=index, id=call.id, type="function", function=function)


def _call(match: re.Match[str]) -> ToolCall:
    """The call a match holds; ValueError unless its JSON is `{"name": str, "arguments": ...}`."""
    body = match.group(1) if match.group(1) is not None else match.group(2)
    item = json.loads(body)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "arguments" not in item:
        raise ValueError(f"not a tool call: {body!r}")
    arguments = json.dumps(item["arguments"], ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=item["name"], arguments=arguments))
