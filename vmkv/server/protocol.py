"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field constraints live here so that FastAPI rejects a bad request before it reaches the
engine, and so that the OpenAPI schema (which fuzzers and SDK generators read) states
them. Checks that need the tokenizer or the model's length limit live in the handlers.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    model_serializer,
    model_validator,
)

from vmkv.engine.sampling_params import SMALLEST_LOGIT_SCALE

# The OpenAI API caps both; they also bound the work one request can ask for.
MAX_N = 128
MAX_TOP_LOGPROBS = 20
# logprob_token_ids are looked up and sent per generated token: a label set, not a vocabulary
MAX_LOGPROB_TOKEN_IDS = 256
# Each bad word is tokenized per request and compared with every sample's output at each step.
MAX_BAD_WORDS = 128
# The OpenAI API's seed is a signed 64-bit integer; only its non-negative half makes sense here.
MAX_SEED = 2**63 - 1

TokenId = Annotated[StrictInt, Field(ge=0)]
Penalty = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)]
# OpenAI's logit_bias maps token ids (JSON object keys, so strings) to a bias in [-100, 100]
LogitBias = dict[
    Annotated[int, Field(ge=0)], Annotated[float, Field(allow_inf_nan=False, ge=-100.0, le=100.0)]
]
JsonSchema = dict[str, Any]


def _utf8_encodable(text: str) -> str:
    """JSON may carry lone surrogates (a "\\ud800" escape); no tokenizer or response can hold them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"text is not valid Unicode: {error.reason} at index {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8_encodable)]


def _zero_or_normal(value: float) -> float:
    if 0.0 < value < SMALLEST_LOGIT_SCALE:
        raise ValueError(f"must be 0 or at least {SMALLEST_LOGIT_SCALE:.3g}: the logits are float32")
    return value


# 0 (greedy) or a scale of the float32 logits that does not round to 0 (SamplingParams)
Temperature = Annotated[
    float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=100.0), AfterValidator(_zero_or_normal)
]
NonEmptyText = Annotated[Text, Field(min_length=1)]


MAX_REQUEST_ID_CHARS = 256


def engine_request_id(request_id: str) -> str:
    """The engine's id for a request answered as `request_id`: unique even when clients reuse
    their ids (vLLM's rule: the client's id and a random suffix)."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    """Unknown fields (for example `user`, `frequency_penalty` left at its default) are ignored."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(
        default=False, description="vLLM's: with include_usage, every chunk carries the usage so far."
    )


class JsonSchemaFormat(OpenAIModel):
    name: Text = "response"
    description: Text | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsParams(OpenAIModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: JsonSchema | Text | None = Field(default=None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    json_object: StrictBool | None = None


class RepetitionDetectionParams(OpenAIModel):
    """vLLM's: end a choice whose output ends with a pattern of min_pattern_size (0: 1) to
    max_pattern_size tokens repeated min_count times; max_pattern_size 0 turns it off."""

    max_pattern_size: Annotated[StrictInt, Field(ge=0)] = 0
    min_pattern_size: Annotated[StrictInt, Field(ge=0)] = 0
    min_count: Annotated[StrictInt, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _consistent(self) -> RepetitionDetectionParams:
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError("min_pattern_size must not exceed max_pattern_size")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("min_count must be at least 2 (a pattern seen once is no repetition)")
        return self


class SamplingExtensions(OpenAIModel):
    """vLLM's sampling fields beyond OpenAI's, which every generation endpoint takes (its
    Responses endpoint too, where OpenAI's API has none of them)."""

    top_k: Annotated[StrictInt, Field(ge=-1, description="-1, 0 or null: no top-k cut.")] | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    ignore_eos: StrictBool = False
    cache_salt: NonEmptyText | None = Field(
        default=None, description="Requests share cached prefixes only when their salts are equal."
    )
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[
        float, Field(strict=True, allow_inf_nan=False, ge=SMALLEST_LOGIT_SCALE, le=100.0)
    ] = 1.0
    min_p: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=1.0)] = 0.0
    logit_bias: LogitBias | None = None
    skip_special_tokens: StrictBool = True
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: StrictBool = Field(
        default=False, description="Keep the stop string that ended a choice in its text."
    )
    priority: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] = Field(
        default=0, description="Lower runs first; needs the server's --scheduling-policy priority."
    )
    repetition_detection: RepetitionDetectionParams | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = Field(
        default=None, description="vLLM's: arguments for the server's --logits-processors (extra_args)."
    )

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class SamplingFields(SamplingExtensions):
    """Parameters both generation endpoints share, with the OpenAI defaults. The vLLM extensions
    the engine implements are here too; fields the server knows but does not implement are
    declared as well, so that a request setting one is refused (400) instead of ignored."""

    model: Text | None = None
    temperature: Temperature = 1.0
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] = 1.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    user: Text | None = Field(default=None, description="Accepted for OpenAI clients; changes nothing.")
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | Text | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    bad_words: Annotated[list[NonEmptyText], Field(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        default=None, description="Only these token ids may be sampled."
    )
    logprob_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)] | None
    ) = Field(default=None, description="With logprobs: these tokens' logprobs instead of the top ones.")
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = Field(
        default=None, description="Keep this many prompt tokens (-1: max_model_len), cut at truncation_side."
    )
    truncation_side: Literal["left", "right"] = Field(
        default="left", description="left keeps the prompt's last tokens, right its first."
    )
    return_tokens_as_token_ids: StrictBool | None = Field(
        default=None, description='Logprobs name each token "token_id:<id>" instead of its text.'
    )
    return_token_ids: StrictBool | None = Field(
        default=None, description="Each choice carries its token ids, and the response the prompt's."
    )
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None,
        description="vLLM's: the id the response carries (after its prefix); the X-Request-Id header wins.",
    )
    stream_interval: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None,
        description="vLLM's: a stream's tokens go out in chunks of at least this many (its first and last "
        "at once); raises the server's --stream-interval, never lowers it.",
    )
    session_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = Field(
        default=None, description="vLLM's: a conversation's stable id, written in the request log line."
    )
    # known and refused with a 400 when set (see docs/server.md)
    logits_processors: list[Any] | None = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    watermarking: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    use_beam_search: StrictBool = False
    length_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False)] = 1.0
    spaces_between_special_tokens: StrictBool = True
    prompt_embeds: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: usage in every chunk needs both stream options."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]] | None = Field(
        default=None,
        description="A text, a list of texts, a list of token ids, or a list of token-id lists.",
    )
    prompt_embeds: Text | list[Text] | None = Field(  # type: ignore[assignment]
        default=None,
        description="In place of prompt: base64 of a torch.save'd [tokens, hidden] tensor, or a list of "
        "them (vLLM's format; needs the server's --enable-prompt-embeds).",
    )
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = Field(default=False, description="Return the prompt text before each choice's text.")
    add_special_tokens: StrictBool = Field(
        default=True, description="Whether text prompts get the tokenizer's special tokens (BOS)."
    )
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = Field(
        default=None,
        description="Sample this many per prompt and return the n of the highest log-probability per "
        "token (at least n; not with stream).",
    )
    suffix: Text | None = None  # refused when set
    thinking_token_budget: Any = None  # refused when set: a chat's, where --reasoning-parser knows the end


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # the call a tool message answers
    function_call: FunctionCall | None = None  # an assistant's earlier call (deprecated functions)
    name: Text | None = None  # the function a "function" message answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: StrictBool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: NonEmptyText


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="Newer name of max_tokens; wins when both are given."
    )
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = Field(
        default=False,
        description="Render the last message open, so the answer continues it (add_generation_prompt false).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra variables for the model's chat template."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="For templates with a reasoning switch: their reasoning_effort variable, and "
        'enable_thinking false for "none" (true otherwise) unless chat_template_kwargs sets it.',
    )
    echo: StrictBool = Field(
        default=False,
        description="Start each choice with the last message's content if it is the assistant's.",
    )
    include_reasoning: StrictBool = Field(
        default=True, description="false: the reasoning a reasoning parser splits off is left out."
    )
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None,
        description="With the server's --reasoning-parser: after this many tokens of thinking, its end "
        "is forced and the answer follows.",
    )
    add_special_tokens: StrictBool = Field(
        default=False,
        description="Tokenize the rendered chat with the tokenizer's special tokens (BOS) on top of the "
        "template's.",
    )
    documents: list[dict[str, Text]] | None = Field(
        default=None, description="For templates that read them (retrieval templates): the documents."
    )
    return_prompt_text: StrictBool = Field(
        default=False, description="vLLM's: the answer (a stream's first chunk) carries the rendered prompt."
    )
    # known and refused with a 400 when set: multimodal inputs (this server serves text models)
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description='"required" or a named function constrain the answer to tool calls; "auto" needs '
        "the server's --tool-call-parser.",
    )
    parallel_tool_calls: StrictBool | None = Field(
        default=None, description='false: "required" makes exactly one call.'
    )
    functions: list[FunctionDefinition] | None = Field(
        default=None, description="OpenAI's deprecated spelling of tools: served as tools, one call at most."
    )
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        default=None, description="OpenAI's deprecated spelling of tool_choice, with functions."
    )
    # known and refused with a 400 when set (see docs/server.md)
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium", the default, is accepted
    audio: Any = None
    prediction: Any = None
    modalities: list[Text] | None = None
    web_search_options: Any = None
    chat_template: Text | None = Field(
        default=None,
        description="Renders the messages in place of the model's template (needs the server's "
        "--trust-request-chat-template).",
    )

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


# --------------------------------------------------------------------------- responses


def sent_if_asked() -> Any:
    """A field only some answers carry (token ids when asked for, tool calls when made): left
    out, not sent as null, when unset; a serializer hook would cost every streamed chunk
    microseconds."""
    return Field(default=None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache held, not computed again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """vLLM's shape: a prompt position's entry for one token id (the JSON key)."""

    logprob: float
    rank: int
    decoded_token: str


# per prompt token (None for the first): token id -> entry, the top-k and the prompt's own token
PromptLogprobs = list[dict[str, PromptLogprobEntry] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        default=None, description="The stop string or stop token id that ended the choice, if one did."
    )
    prompt_token_ids: list[int] | None = sent_if_asked()
    token_ids: list[int] | None = sent_if_asked()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls, as OpenAI sends it
    tool_calls: list[ToolCall] | None = sent_if_asked()
    function_call: FunctionCall | None = sent_if_asked()  # with the deprecated functions
    reasoning: str | None = sent_if_asked()  # vLLM's, with a reasoning parser


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        default=None, description="The stop string or stop token id that ended the choice, if one did."
    )
    token_ids: list[int] | None = sent_if_asked()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = sent_if_asked()
    prompt_text: str | None = sent_if_asked()


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # on the call's first delta
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # on the call's first delta, with type and name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """Only the fields that changed are sent, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None  # with the deprecated functions
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unchanged(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(
        default=None, description="The stop string or stop token id that ended the choice, if one did."
    )
    token_ids: list[int] | None = sent_if_asked()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = sent_if_asked()  # a stream's first chunk
    prompt_text: str | None = sent_if_asked()  # a stream's first chunk


# ------------------------------------------------------------------- other endpoints


class ModelCard(BaseModel):
    """OpenAI's model object, with the fields Anthropic's clients read beside it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vmkv"
    root: str
    max_model_len: int
    type: Literal["model"] = "model"  # Anthropic's
    display_name: str = ""  # Anthropic's: the id
    created_at: str = ""  # Anthropic's: `created` in RFC 3339
    max_input_tokens: int = 0  # Anthropic's: max_model_len
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)

    @model_validator(mode="after")
    def _anthropic_fields(self) -> ModelCard:
        self.display_name = self.display_name or self.id
        self.created_at = self.created_at or datetime.fromtimestamp(self.created, UTC).isoformat()
        self.max_input_tokens = self.max_input_tokens or self.max_model_len
        return self


class ModelList(BaseModel):
    """OpenAI's list, with Anthropic's page fields (one page: the server serves one model)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @model_validator(mode="after")
    def _page_ends(self) -> ModelList:
        if self.data:
            self.first_id, self.last_id = self.data[0].id, self.data[-1].id
        return self


class ResetPrefixCacheResponse(BaseModel):
    forgotten: int  # cache entries (paged blocks, vattention chunks) the reset dropped


class TokenizeRequest(OpenAIModel):
    """Either a prompt or chat messages (rendered with the chat template first)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Text | None = None  # as chat's
    tools: list[ToolDefinition] | None = None
    return_token_strs: StrictBool = Field(default=False, description="vLLM's: each token's string too.")

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's own strings (byte-level ones as such)


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
