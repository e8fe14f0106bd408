"""Bodies of OpenAI's Responses API (/v1/responses), the part a text model serves: text or a
conversation in (or a stored response's conversation continued), one assistant message out
(after a reasoning item, with a reasoning parser), whole, as the API's typed stream events, or
in the background."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt

from vmkv.server.protocol import (
    MAX_REQUEST_ID_CHARS,
    MAX_TOP_LOGPROBS,
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
    SamplingExtensions,
    Temperature,
    Text,
    TokenLogprob,
    ToolCall,
    ToolDefinition,
    now,
)

# the one `include` value that changes a text answer: its tokens' logprobs
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back
    text: Text


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallInput(OpenAIModel):
    """An earlier call of the model's, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputInput(OpenAIModel):
    """A tool's answer to an earlier call."""

    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningInput(OpenAIModel):
    """An earlier answer's reasoning item, sent back: chat templates do not render past
    reasoning, so it is read and left out of the prompt."""

    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput
# the prefix of the id an input item listed back gets when it came without one
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class FunctionTool(OpenAIModel):
    """The Responses API's function tool: chat's function definition, flattened."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: NonEmptyText


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text = "response"
    description: Text | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ReasoningOptions(OpenAIModel):
    effort: ReasoningEffort | None = None  # as chat's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # refused: nothing summarizes


class TextOptions(OpenAIModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium", the default, is accepted


class ResponsesRequest(SamplingExtensions):
    """OpenAI's fields, and vLLM's sampling extensions (SamplingExtensions) as chat has them."""

    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = Field(default=None, description="A system message before the input.")
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Temperature = 1.0
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] = 1.0
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[Text] | None = None
    stream: StrictBool = False
    text: TextOptions = Field(default_factory=TextOptions)
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    store: StrictBool | None = Field(
        default=None, description="Unless false, the response is kept (see --responses-store-mib)."
    )
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: ReasoningOptions | None = None
    previous_response_id: Text | None = None
    background: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's: extra variables for the model's chat template."
    )
    include_reasoning: StrictBool = Field(
        default=True, description="vLLM's: false leaves the reasoning item out."
    )
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None, description="vLLM's: the response's id (after resp-); the X-Request-Id header wins."
    )
    session_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None, description="vLLM's: a conversation's stable id, written in the request log line."
    )
    prompt_cache_key: Text | None = Field(
        default=None, description="OpenAI's hint for its prompt cache; this server's finds prefixes itself."
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"  # one tier: others refused
    # known and refused with a 400 when set (see docs/server.md)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    enable_response_messages: Any = None
    previous_input_messages: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    watermarking: Any = None

    @property
    def logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or [])

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """The input as OpenAI lists a response's input items: each with an id (its own, or one
        made from the response's), a message's text as content parts."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        listed = []
        for i, item in enumerate(items):
            fields = item.model_dump(exclude_none=True)
            if isinstance(item, InputMessage) and isinstance(item.content, str):
                part = "output_text" if item.role == "assistant" else "input_text"
                fields["content"] = [{"type": part, "text": item.content}]
            made_id = f"{ITEM_PREFIXES[item.type]}_{response_id.removeprefix('resp-')}_{i}"
            listed.append({"id": made_id, "status": "completed"} | fields)
        return listed

    def chat_conversation(self, previous: list[ChatMessage]) -> list[ChatMessage]:
        """The messages after the instructions: a stored response's conversation (`previous`),
        then this input. Instructions are not part of it: as OpenAI's, a continuation does not
        inherit them."""
        messages = [message.model_copy(deep=True) for message in previous]
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text))
            elif isinstance(item, FunctionCallInput):
                call = ToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":  # calls after its text, or more calls
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputInput):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
        return messages

    def as_chat(self, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        """The same request as a chat completion: instructions first, as a system message, then
        the conversation."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        messages = system + conversation
        text_format = self.text.format
        response_format = None
        if text_format.type != "text":
            schema = None
            if text_format.type == "json_schema":
                schema = JsonSchemaFormat(
                    name=text_format.name,
                    description=text_format.description,
                    schema=text_format.schema_ or {},
                    strict=text_format.strict,
                )
            response_format = ResponseFormat(type=text_format.type, json_schema=schema)
        return ChatCompletionRequest(
            model=self.model,
            request_id=self.request_id,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else None,
            stream=self.stream,
            user=self.user,
            response_format=response_format,
            reasoning_effort=None if self.reasoning is None else self.reasoning.effort,
            tools=[
                ToolDefinition(
                    type="function",
                    function=FunctionDefinition(
                        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                    ),
                )
                for t in self.tools
            ]
            if self.tools
            else None,
            tool_choice=NamedToolChoice(type="function", function=NamedFunction(name=self.tool_choice.name))
            if isinstance(self.tool_choice, NamedFunctionChoice)
            else self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=self.chat_template_kwargs,
            include_reasoning=self.include_reasoning,
            **{name: getattr(self, name) for name in SamplingExtensions.model_fields},
        )


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # whether it is kept, to fetch or continue by its id
    temperature: float
    top_p: float
    top_logprobs: int | None = None
    text: dict[str, Any]
    tool_choice: str | NamedFunctionChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
