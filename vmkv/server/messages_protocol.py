"""Bodies of Anthropic's Messages API (/v1/messages), the part a text model serves: a system
prompt and a conversation of text, tool uses and tool results in; text, thinking and tool_use
blocks out, whole or as the API's typed stream events. The request is served as the chat
completion `as_chat` makes of it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, StrictBool, StrictInt, Tag, model_validator

from vmkv.server.errors import APIError, bad_request
from vmkv.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchema,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    NonEmptyText,
    OpenAIModel,
    ReasoningEffort,
    ResponseFormat,
    Temperature,
    Text,
    TextContentPart,
    ToolCall,
    ToolDefinition,
)

# ------------------------------------------------------------------------------ request


class TextBlock(OpenAIModel):
    """Text; its `cache_control` is read and left alone: the prefix cache needs no hints."""

    type: Literal["text"]
    text: Text


class OtherBlock(OpenAIModel):
    """Any other block: what a text model cannot read (images, documents) and the results of
    Anthropic's own server tools. Refused by its type, whatever new types the API grows."""

    type: NonEmptyText

    def refuse(self, where: str) -> APIError:
        return bad_request(
            f"{where}: {self.type} blocks are not served: this server generates text from text and runs "
            "no tools of its own",
            "messages",
        )


def tagged(*known: str) -> Discriminator:
    """Picks a block's model by its type, any type but `known` being an OtherBlock."""

    def kind(block: object) -> str:
        name = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
        return name if name in known else "other"

    return Discriminator(kind)


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")], tagged("text")
]


class ToolUseBlock(OpenAIModel):
    """An earlier call of the model's, sent back with the conversation."""

    type: Literal["tool_use"]
    id: NonEmptyText
    name: NonEmptyText
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    """A tool's answer to an earlier call, in a user message (a failed call's with is_error:
    its text then starts "Error: ", as nothing else tells the model)."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyText
    content: Text | list[ResultBlock] = ""
    is_error: StrictBool = False

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            text = self.content
        else:
            for k, block in enumerate(self.content):
                if isinstance(block, OtherBlock):
                    raise block.refuse(f"{where}.content[{k}]")
            text = "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(OpenAIModel):
    """An earlier answer's thinking, sent back: chat templates do not render past reasoning, so
    it is read and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    tagged("text", "tool_use", "tool_result", "thinking", "redacted_thinking"),
]


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Tool(OpenAIModel):
    """A client tool (Anthropic's server tools, which it runs itself, are not served)."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: JsonSchema


class ToolChoice(OpenAIModel):
    """auto: the model chooses; any: it calls some tool; tool: it calls `name`; none: no call."""

    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyText | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _enabled_has_a_budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('thinking of type "enabled" needs budget_tokens')
        return self


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(OpenAIModel):
    effort: ReasoningEffort | None = None  # as chat's reasoning_effort
    format: OutputFormat | None = None


class Metadata(OpenAIModel):
    user_id: Text | None = None


class MessagesInput(OpenAIModel):
    """What makes the prompt: the fields /v1/messages/count_tokens reads too."""

    model: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = Field(
        default=None,
        description='"disabled" turns a reasoning template\'s thinking off, "adaptive" leaves it to the '
        'model, "enabled" caps it at budget_tokens (needs the server\'s --reasoning-parser).',
    )
    output_config: OutputConfig | None = Field(
        default=None,
        description="format: JSON valid against a schema (a structured output); effort: as chat's "
        "reasoning_effort.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's: extra variables for the model's chat template."
    )

    def prompt_fields(self, reasoning_effort: str | None) -> dict[str, Any]:
        """The chat completion fields that make the same prompt. A conversation ending on the
        assistant's turn is continued, as Anthropic continues a prefilled answer."""
        messages = self.chat_messages()
        prefilled = messages[-1].role == "assistant"
        disable_parallel = self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use
        return {
            "model": self.model,
            "messages": messages,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": False if disable_parallel else None,
            "reasoning_effort": reasoning_effort,
            "chat_template_kwargs": self.chat_template_kwargs,
            "response_format": self.response_format(),
            "add_generation_prompt": not prefilled,
            "continue_final_message": prefilled,
        }

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the system prompt first; a user message's tool
        results as tool messages, in their order among its text; an assistant's tool uses as
        its tool calls."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = [ChatMessage(role="system", content=system)] if self.system is not None else []
        for i, message in enumerate(self.messages):
            blocks = (
                [TextBlock(type="text", text=message.content)]
                if isinstance(message.content, str)
                else message.content
            )
            for j, block in enumerate(blocks):
                if isinstance(block, OtherBlock):
                    raise block.refuse(f"messages[{i}].content[{j}]")
            if message.role == "assistant":
                messages.append(assistant_message(blocks))
                continue
            parts: list[TextContentPart] = []
            for j, block in enumerate(blocks):
                if isinstance(block, TextBlock):
                    parts.append(TextContentPart(type="text", text=block.text))
                elif isinstance(block, ToolResultBlock):
                    if parts:
                        messages.append(ChatMessage(role="user", content=parts))
                        parts = []
                    text = block.text(f"messages[{i}].content[{j}]")
                    messages.append(ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id))
            if parts or not messages or messages[-1].role != "tool":
                messages.append(ChatMessage(role="user", content=parts))
        return messages

    def response_format(self) -> ResponseFormat | None:
        output_format = self.output_config and self.output_config.format
        if output_format is None:
            return None
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=output_format.schema_))

    def chat_tools(self) -> list[ToolDefinition] | None:
        if not self.tools:
            return None
        return [
            ToolDefinition(
                type="function",
                function=FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.input_schema
                ),
            )
            for tool in self.tools
        ]

    def chat_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if choice.name is None:
                raise bad_request('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
            return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def assistant_message(blocks: list[Block]) -> ChatMessage:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    calls = [
        ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)


class MessagesRequest(MessagesInput):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[NonEmptyText] | None = None
    stream: StrictBool = False
    temperature: Annotated[Temperature, Field(le=1.0)] = 1.0
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, description="0 or null: no top-k cut.")] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_salt: NonEmptyText | None = Field(
        default=None, description="vLLM's: requests share cached prefixes only when their salts are equal."
    )
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = Field(
        default=None, description="vLLM's: arguments for the server's --logits-processors."
    )
    cache_control: Any = Field(
        default=None, description="Anthropic's prompt-cache marker: this server caches prefixes by itself."
    )
    # known and refused with a 400 when set (see docs/server.md)
    mcp_servers: list[Any] | None = None
    container: Any = None
    speed: Literal["standard", "fast"] | None = None  # only standard
    inference_geo: Any = None
    diagnostics: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    watermarking: Any = None

    def as_chat(self, reasoning_effort: str | None, thinking_budget: int | None) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        return ChatCompletionRequest(
            thinking_token_budget=thinking_budget,
            **self.prompt_fields(reasoning_effort),
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            stream=self.stream,
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            user=None if self.metadata is None else self.metadata.user_id,
            cache_salt=self.cache_salt,
            vllm_xargs=self.vllm_xargs,
        )


# ------------------------------------------------------------------------------ response


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs it: a client sending it back gets it left out, as any


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    """Anthropic counts a prompt as input_tokens + cache_read_input_tokens (+ creation, which
    the prefix cache does without: it keeps what it computes at no extra cost)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
