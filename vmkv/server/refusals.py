"""Request fields this server knows but does not implement: a 400 naming the field, never a
silent ignore, so a client learns at once that its request would not mean what it says."""

from __future__ import annotations

from vmkv.server.errors import bad_request
from vmkv.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# (param, whether the request sets it, why it is refused): known fields not implemented here
Refusal = tuple[str, bool, str]


def check_supported(refusals: list[Refusal]) -> None:
    """A 400 naming the first field set that this server does not implement, instead of ignoring it."""
    for param, is_set, reason in refusals:
        if is_set:
            raise bad_request(f"{param} is not supported: {reason}", param)


def sampling_refusals(body: SamplingFields) -> list[Refusal]:
    return [
        ("allowed_token_ids", body.allowed_token_ids is not None, "use logit_bias or a structured output"),
        ("logits_processors", bool(body.logits_processors), "custom logits processors cannot be loaded"),
        ("truncate_prompt_tokens", body.truncate_prompt_tokens is not None, "prompts are never truncated"),
        ("truncation_side", body.truncation_side is not None, "prompts are never truncated"),
        ("use_beam_search", body.use_beam_search, "beam search is not implemented"),
        ("length_penalty", body.length_penalty != 1.0, "it applies to beam search, which is not implemented"),
        ("spaces_between_special_tokens", not body.spaces_between_special_tokens, "not implemented"),
        ("logprob_token_ids", body.logprob_token_ids is not None, "logprobs are of the top tokens only"),
        ("prompt_embeds", body.prompt_embeds is not None, "prompts are text or token ids"),
        ("priority", body.priority != 0, "the scheduler serves requests in arrival order"),
        ("return_tokens_as_token_ids", bool(body.return_tokens_as_token_ids), "not implemented"),
        ("return_token_ids", bool(body.return_token_ids), "not implemented"),
        ("include_stop_str_in_output", body.include_stop_str_in_output, "stop strings are always cut"),
        (
            "stream_options.continuous_usage_stats",
            body.stream_options is not None and body.stream_options.continuous_usage_stats,
            "usage comes in the final chunk (include_usage)",
        ),
    ]


def completion_refusals(body: CompletionRequest) -> list[Refusal]:
    return [
        ("suffix", bool(body.suffix), "this server does not insert text"),
        (
            "best_of",
            body.best_of is not None and body.best_of != body.n,
            "sampling more choices than n and returning the best is not implemented; ask for n",
        ),
    ]


def chat_refusals(body: ChatCompletionRequest) -> list[Refusal]:
    no_tool = (None, "none")
    return [
        ("tools", bool(body.tools) and body.tool_choice != "none", "this server has no tool-call parser"),
        ("tool_choice", body.tool_choice not in no_tool, "this server has no tool-call parser"),
        ("functions", bool(body.functions), "this server has no tool-call parser"),
        ("function_call", body.function_call not in no_tool, "this server has no tool-call parser"),
        ("echo", body.echo, "chat echo is not implemented"),
        (
            "prompt_logprobs",
            body.stream and body.prompt_logprobs is not None,
            "a chat stream has no place for them; ask without stream",
        ),
        ("continue_final_message", body.continue_final_message, "not implemented"),
        ("audio", body.audio is not None, "this server generates text only"),
        ("modalities", body.modalities not in (None, ["text"]), "this server generates text only"),
        ("prediction", body.prediction is not None, "predicted outputs are not implemented"),
        ("web_search_options", body.web_search_options is not None, "this server has no web search"),
        ("reasoning_effort", body.reasoning_effort is not None, "the model has no reasoning mode here"),
        ("chat_template", body.chat_template is not None, "the model's own chat template is used"),
        ("chat_template_kwargs", bool(body.chat_template_kwargs), "the model's own chat template is used"),
    ]
