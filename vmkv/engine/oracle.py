"""The correctness oracle: the engine's greedy tokens against the definition of greedy decoding.

The reference (`reference_greedy`) is a plain loop with no KV cache: at each step the whole
model runs on every id so far and the argmax of the last position's logits is the next token.
transformers' `generate()` (`generate_greedy`) is only a secondary cross-check: it runs its own
cached path, and on some CPUs its first-step logits differ from a plain forward of the same ids
(by ~0.2 at a logit of ~30 in fp32 on an AVX512-BF16 EPYC), so it is not a fixed reference.

Batched and single-sequence float arithmetic round differently, so a greedy choice can
flip where the model's top two logits are (almost) tied. A divergence counts as a
near-tie only if the reference's top-two margin at that step is below `tie_margin`;
any other divergence is a bug. Comparison of a prompt stops at its first divergence,
since the two continuations then condition on different tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from vmkv.engine.cpu_linear import has_native_half_gemm, pack_linears
from vmkv.model.store import load_model

# Varied chat prompts, short to long, for the oracle and the fast tests.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a short recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between Python lists and tuples? Answer with a short bulleted list.",
    "Write a limerick about a cat who learned to program computers and then refused to chase mice "
    "ever again.",
    "You are a helpful travel agent. A customer wants a three-day itinerary for Rome with museums, food and "
    "a day trip outside the city. Suggest a plan with morning, afternoon and evening activities.",
    "Describe how a hash map works, including hashing, buckets, collisions and resizing, for a beginner.",
    "Tell me a joke about computers.",
    "Here is a list of numbers: 4, 8, 15, 16, 23, 42. What is their sum, and which of them are even? Explain "
    "briefly how you found each answer, then say which number is the largest and which is the smallest.",
    "Why do we have seasons on Earth? Mention the tilt of the axis, the orbit, and a common misconception.",
]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a one-turn chat with the generation prompt appended, as token ids."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]


@dataclass
class ReferenceRun:
    token_ids: list[int]
    margins: list[float]  # the top-two logit gap at each generated position
    tops: list[float]  # the top logit at each generated position


@dataclass
class Divergence:
    prompt: int
    step: int
    expected: int
    got: int
    margin: float
    top: float  # the reference's top logit there, for judging the margin against its precision


@dataclass
class OracleReport:
    num_prompts: int
    tokens_compared: int = 0
    identical: int = 0  # prompts whose whole output matched
    near_ties: list[Divergence] = field(default_factory=list)
    mismatches: list[Divergence] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches


@torch.inference_mode()
def reference_greedy(
    model_path: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype,
    fp32_gemm: bool | None = None,
) -> list[ReferenceRun]:
    """Greedy decoding by definition: each step a full no-cache forward of all ids, then argmax.

    Half-precision Linears take the GEMM path the engine would (`fp32_gemm`: None picks it from
    the CPU's flags, as the engine does), so a bf16 comparison differs only in attention and
    batching, not in which GEMM rounds the products. Stops at the model's end-of-sequence ids.
    """
    model = load_model(model_path, dtype=dtype, attn_implementation="sdpa")
    if fp32_gemm is None:
        fp32_gemm = dtype != torch.float32 and not has_native_half_gemm(dtype)
    if fp32_gemm and dtype != torch.float32:
        pack_linears(model, "fp32")
    eos = model.generation_config.eos_token_id
    stop = {eos} if isinstance(eos, int) else set(eos or ())
    runs = []
    for prompt in prompts:
        ids = list(prompt)
        run = ReferenceRun([], [], [])
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
            top2 = logits.float().topk(2)
            token = int(top2.indices[0])
            run.token_ids.append(token)
            run.margins.append(float(top2.values[0] - top2.values[1]))
            run.tops.append(float(top2.values[0]))
            ids.append(token)
            if token in stop:
                break
        runs.append(run)
    return runs


@torch.inference_mode()
def generate_greedy(
    model_path: str | Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype
) -> list[ReferenceRun]:
    """transformers' generate(), one prompt at a time (no padding), greedy, with its logits: the
    secondary cross-check of `reference_greedy`, agreeing with it up to near-ties."""
    model = load_model(model_path, dtype=dtype, attn_implementation="sdpa")
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=model.generation_config.pad_token_id or (eos if isinstance(eos, int) else eos[0]),
        output_logits=True,
        return_dict_in_generate=True,
    )
    runs = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), generation_config=config)
        top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        runs.append(ReferenceRun(out.sequences[0, len(ids) :].tolist(), margins, top2[:, 0].tolist()))
    return runs


def bf16_ulp(x: float) -> float:
    """The gap between adjacent bfloat16 values at x's magnitude (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def compare(
    reference: list[ReferenceRun],
    outputs: list[list[int]],
    tie_margin: float = 1e-4,
    first: int | None = None,
    tie_bf16_ulps: int = 0,
) -> OracleReport:
    """Compare each prompt's tokens (optionally only the first `first`) up to its first divergence.

    A divergence is a near-tie when the reference's top-two margin there is below tie_margin,
    or at most tie_bf16_ulps bfloat16 rounding steps of its top logit (the bf16 policy: two
    logits that adjacent bf16 values separate are a tie that any rounding difference can flip).
    """
    report = OracleReport(num_prompts=len(reference))
    for p, (ref, got) in enumerate(zip(reference, outputs, strict=True)):
        expected = ref.token_ids[:first]
        got = got[:first]
        step = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
        if step is None and len(expected) != len(got):
            step = min(len(expected), len(got))  # one stopped early without a differing token
        if step is None:
            report.identical += 1
            report.tokens_compared += len(expected)
            continue
        report.tokens_compared += step + 1
        divergence = Divergence(
            prompt=p,
            step=step,
            expected=expected[step] if step < len(expected) else -1,
            got=got[step] if step < len(got) else -1,
            margin=ref.margins[step] if step < len(ref.margins) else float("inf"),
            top=ref.tops[step] if step < len(ref.tops) else 0.0,
        )
        tie = divergence.margin < tie_margin or divergence.margin <= tie_bf16_ulps * bf16_ulp(divergence.top)
        (report.near_ties if tie else report.mismatches).append(divergence)
    return report
