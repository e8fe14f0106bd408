"""Request fields this server knows but does not implement: a 400 naming the field, never a
silent ignore, so a client learns at once that its request would not mean what it says."""

from __future__ import annotations

from vmkv.server.errors import bad_request
from vmkv.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# (param, whether the request sets it, why it is refused): known fields not implemented here
Refusal = tuple[str, bool, str]
MULTIMODAL = "this server serves text models"
MISSING_FEATURE_FIELDS = (
    "kv_transfer_params",
    "ec_transfer_params",
    "mm_payload",
    "return_mm_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "watermarking",
)
VERBOSITY = "the model's answers are as long as it makes them; only the default, medium, is accepted"


def check_supported(refusals: list[Refusal]) -> None:
    """A 400 naming the first field set that this server does not implement, instead of ignoring it."""
    for param, is_set, reason in refusals:
        if is_set:
            raise bad_request(f"{param} is not supported: {reason}", param)


def missing_feature_refusals(body: object) -> list[Refusal]:
    """vLLM's fields for what this server does not have (KV or encoder-cache transfer between
    servers, multimodal inputs, output watermarks), in whichever of them the request has."""
    given = {name: getattr(body, name, None) for name in MISSING_FEATURE_FIELDS}
    return [
        ("kv_transfer_params", given["kv_transfer_params"] is not None, "this server sends no KV to others"),
        ("ec_transfer_params", given["ec_transfer_params"] is not None, "this server has no encoder cache"),
        ("mm_payload", given["mm_payload"] not in (None, "tensors"), MULTIMODAL),
        ("return_mm_kwargs", bool(given["return_mm_kwargs"]), MULTIMODAL),
        ("mm_processor_kwargs", bool(given["mm_processor_kwargs"]), MULTIMODAL),
        ("media_io_kwargs", bool(given["media_io_kwargs"]), MULTIMODAL),
        ("watermarking", bool(given["watermarking"]), "this server marks no output"),
    ]


def sampling_refusals(body: SamplingFields, fast_tokenizer: bool) -> list[Refusal]:
    """`fast_tokenizer`: the model's tokenizer is a fast (Rust) one, whose decoding never puts
    spaces between special tokens, so spaces_between_special_tokens changes nothing (as in vLLM)."""
    return [
        (
            "logits_processors",
            bool(body.logits_processors),
            "a request cannot load code: start the server with --logits-processors and pass their "
            "arguments in vllm_xargs",
        ),
        (
            "length_penalty",
            body.length_penalty != 1.0 and not body.use_beam_search,
            "it applies to beam search (use_beam_search)",
        ),
        (
            "spaces_between_special_tokens",
            not body.spaces_between_special_tokens and not fast_tokenizer,
            "this model's tokenizer is a slow one, whose spacing of special tokens is not implemented",
        ),
        *missing_feature_refusals(body),
        ("routed_experts_prompt_start", bool(body.routed_experts_prompt_start), "no routing is returned"),
        ("return_token_offsets", bool(body.return_token_offsets), "vLLM returns them from its render routes"),
    ]


def completion_refusals(body: CompletionRequest) -> list[Refusal]:
    return [
        ("suffix", bool(body.suffix), "this server does not insert text"),
        (
            "thinking_token_budget",
            body.thinking_token_budget is not None,
            "it is a chat's: there the server's --reasoning-parser knows where thinking ends",
        ),
        ("best_of", body.best_of is not None and body.best_of < body.n, "it must be at least n"),
        (
            "best_of",
            bool(body.best_of and body.best_of > body.n and body.stream),
            "the best choices are known only when all have ended, so they cannot be streamed",
        ),
        (
            "best_of",
            bool(body.best_of and body.best_of > body.n and body.use_beam_search),
            "beam search keeps the n best hypotheses itself",
        ),
    ]


def chat_refusals(body: ChatCompletionRequest, parses_calls: bool) -> list[Refusal]:
    """`parses_calls`: the server reads calls the model chooses to make (--tool-call-parser)."""
    no_parser = "choosing whether to call a tool needs --tool-call-parser for the model's call format"
    return [
        (
            "tools",
            bool(body.tools) and body.tool_choice is None and not parses_calls,
            f'tool_choice defaults to "auto" with tools, and {no_parser}; set tool_choice to "required", '
            'a function, or "none"',
        ),
        (
            "tool_choice",
            body.tool_choice == "auto" and not parses_calls,
            f'{no_parser}; use "required" or name a function',
        ),
        (
            "prompt_logprobs",
            body.stream and body.prompt_logprobs is not None,
            "a chat stream has no place for them; ask without stream",
        ),
        ("audio", body.audio is not None, "this server generates text only"),
        ("verbosity", body.verbosity not in (None, "medium"), VERBOSITY),
        ("modalities", body.modalities not in (None, ["text"]), "this server generates text only"),
        ("prediction", body.prediction is not None, "predicted outputs are not implemented"),
        ("web_search_options", body.web_search_options is not None, "this server has no web search"),
        (
            "prompt_embeds",
            body.prompt_embeds is not None,
            "a chat's prompt is its messages; use /v1/completions",
        ),
    ]
