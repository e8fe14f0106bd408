"""The batched sampler, its logits processors and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from vmkv.engine.sampler import NUCLEUS_TIERS, Sampler, SampleRow, inverse_cdf, top_k_top_p_windows
from vmkv.engine.sampling_params import SamplingParams, StructuredOutput
from vmkv.engine.structured_output import apply_token_bitmask, new_token_bitmask


def rows(params: SamplingParams, count: int, seed: int | None = None) -> list[SampleRow]:
    return [
        SampleRow(params, None if seed is None else torch.Generator().manual_seed(seed)) for _ in range(count)
    ]


def test_greedy_rows_take_the_argmax_next_to_random_rows() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = Sampler()(logits, [SampleRow(p, None) for p in params])
    assert out.token_ids[::2] == logits[::2].argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_ties_take_the_first_maximum_as_argmax_does() -> None:
    """bf16 logits tie often (one step is 0.125 at 25); a NaN row takes the NaN, as argmax."""
    logits = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(1)) * 4).bfloat16().float()
    logits[:, 40000] = logits[:, 7] = logits.max() + 1  # every row: a tie, the first at 7
    logits[3, 11] = float("nan")
    logits[5] = float("-inf")
    out = Sampler()(logits, rows(SamplingParams(temperature=0.0), 64))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[0] == 7 and out.token_ids[3] == 11 and out.token_ids[5] == 0


def test_a_logit_overflowed_to_infinity_takes_the_mass_rather_than_making_nans() -> None:
    """What a tiny temperature or repetition penalty does to a large logit: +inf, whose row
    softmaxes to NaN. Those tokens share the row; the other rows are drawn as ever."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = logits[2, 250] = logits[2, 260] = float("inf")
    logits[0, 9] = float("-inf")
    out = Sampler(seed=0)(logits, rows(SamplingParams(temperature=1.0), 3, seed=1))
    assert out.token_ids[0] == 7 and out.token_ids[2] in (250, 260)
    assert 0 <= out.token_ids[1] < 300
    tiny = SamplingParams(temperature=2.0**-126, max_tokens=4)
    assert Sampler(seed=0)(torch.tensor([[1.0, 3.0, 2.0]]), [SampleRow(tiny, None)]).token_ids == [1]


def test_an_empty_step_samples_nothing_and_mismatched_rows_are_refused() -> None:
    assert Sampler()(torch.empty(0, 50), []).token_ids == []
    with pytest.raises(ValueError, match="one row each"):
        Sampler()(torch.zeros(3, 50), rows(SamplingParams(temperature=1.0), 2))


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    temperature = 0.7
    out = Sampler(seed=1)(logits, rows(SamplingParams(temperature=temperature), 20000))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 20000
    expected = (logits[0] / temperature).softmax(-1)
    assert torch.allclose(counts, expected, atol=0.015)


def test_two_levelinverse_cdf_draws_what_one_whole_vocabulary_cdf_draws() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(8, 1000, generator=gen) ** 4  # a vocabulary that is no multiple of a block
    probs[:, torch.rand(1000, generator=gen) < 0.5] = 0.0  # filtered tokens: never drawn
    probs[3, 600:] = 0.0  # a row whose last blocks hold nothing
    probs = probs / probs.sum(-1, keepdim=True)
    uniform = torch.rand(8, 500, generator=gen, dtype=torch.float64)
    uniform[:, 0], uniform[:, 1] = 0.0, 1.0 - 2**-53  # both ends
    cdf = probs.cumsum(-1, dtype=torch.float64)
    for j in range(uniform.shape[1]):
        u = uniform[:, j : j + 1]
        whole = torch.minimum(
            torch.searchsorted(cdf, u * cdf[:, -1:], right=True), torch.searchsorted(cdf, cdf[:, -1:])
        )
        drawn = inverse_cdf(probs, u)
        assert drawn.tolist() == whole.squeeze(1).tolist()
        assert bool((probs[torch.arange(8), drawn] > 0).all())


def sorted_top_k_top_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter by its definition: sort each row whole, keep its top-k, then the smallest
    prefix of those, renormalized, whose mass reaches top_p (the top token always). Returns the
    filtered logits and, per token, whether float32 rounding could move it across the top-p
    boundary (its preceding mass within 1e-6 of top_p)."""
    out = torch.full_like(logits, float("-inf"))
    close = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits):
        values, order = row.sort(descending=True)
        k = top_k[i] if 0 < top_k[i] < len(row) else len(row)
        probs = values[:k].double().softmax(-1)
        before = probs.cumsum(-1) - probs
        keep = before < top_p[i] if top_p[i] < 1.0 else torch.ones(k, dtype=torch.bool)
        keep[0] = True
        out[i, order[:k][keep]] = row[order[:k][keep]]
        close[i, order[:k]] = (before - top_p[i]).abs() < 1e-6
    return out, close


def test_top_k_top_p_keeps_exactly_what_sorting_whole_rows_keeps() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(10, 5000, generator=gen) * 4
    # a tail of tokens each under 1/NUCLEUS_TIERS[-1] of the mass, one token holding the rest:
    # no tier's candidates hold a nucleus of 0.999, so the row is sorted whole
    tail = 0.5 / NUCLEUS_TIERS[-1]
    logits[6] = torch.randn(5000, generator=gen) * 0.01 + math.log(tail)
    logits[6, 0] = math.log(1 - 4999 * tail)
    logits[8, 100:] = float("-inf")  # min-p or a grammar left 100 tokens
    # 2,500 tokens under the first tier's share and over the second's: held by the second tier
    logits[9] = float("-inf")
    logits[9, 1:2501] = torch.randn(2500, generator=gen) * 0.01 + math.log(1 / 50000)
    logits[9, 0] = math.log(0.95)
    top_k = [0, 5, 0, 40, 3000, 0, 0, 1, 0, 0]
    top_p = [0.9, 1.0, 1.0, 0.5, 0.95, 0.3, 0.999, 0.8, 0.999, 0.97]  # row 2 keeps everything
    cut = [i for i in range(10) if top_k[i] or top_p[i] < 1.0]  # the rows the sampler passes
    probs = logits[cut].softmax(-1)
    kept = torch.zeros_like(probs)
    width = {}  # row: how many of its tokens were sorted
    for rows, values, ids in top_k_top_p_windows(
        probs, [top_k[i] or 5000 for i in cut], [top_p[i] for i in cut]
    ):
        kept[rows.unsqueeze(1), ids] = values
        width.update(dict.fromkeys(rows.tolist(), values.shape[1]))
    reference, close = sorted_top_k_top_p(logits, top_k, top_p)
    reference, close = reference[cut], close[cut]
    assert sorted(width) == list(range(len(cut)))
    assert torch.equal((kept > 0) | close, reference.isfinite() | close)
    assert int(close.sum()) < 5  # only at the boundary of the long tail, if at all
    assert [i for i in cut if width[cut.index(i)] == 5000] == [6]
    assert width[cut.index(9)] == 2501
    assert int((kept[cut.index(6)] > 0).sum()) > 4000
    renormalized = kept / kept.sum(-1, keepdim=True)
    assert torch.allclose(renormalized, reference.softmax(-1), atol=1e-5)


def test_top_k_and_top_p_cut_the_tail() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    top_k = Sampler(seed=2)(logits, rows(SamplingParams(top_k=2), 4000)).token_ids
    assert set(top_k) == {0, 1}
    top_p = Sampler(seed=3)(logits, rows(SamplingParams(top_p=0.7), 4000)).token_ids
    assert set(top_p) == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there
    counts = torch.bincount(torch.tensor(top_p), minlength=4).float() / 4000
    assert counts[0] == pytest.approx(0.5 / 0.8, abs=0.03)  # the nucleus renormalised
    mixed = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.7),
        SamplingParams(),
        SamplingParams(temperature=0),
    ]
    drawn = Sampler(seed=6)(logits[:4000], [SampleRow(mixed[i % 4], None) for i in range(4000)]).token_ids
    assert [set(drawn[i::4]) for i in range(4)] == [{0}, {0, 1}, {0, 1, 2, 3}, {0}]
    top_p_small = Sampler(seed=4)(logits[:100], rows(SamplingParams(top_p=0.1), 100)).token_ids
    assert set(top_p_small) == {0}  # the most likely token always stays
    # even where top_p rounds to 0 in the logits' dtype (found by fuzzing the server: 5e-324)
    tiny = Sampler(seed=5)(logits[:10], rows(SamplingParams(top_p=5e-324), 10)).token_ids
    assert set(tiny) == {0}


def test_a_seeded_row_ignores_its_position_and_neighbours() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler(seed=0)(logits[2:3], rows(params, 1, seed=11)).token_ids[0]
    batch = rows(SamplingParams(temperature=1.0), 2) + rows(params, 1, seed=11) + rows(SamplingParams(), 2)
    together = Sampler(seed=9)(logits, batch).token_ids[2]
    assert alone == together


def test_logprobs_are_top_k_of_the_raw_distribution_plus_the_sampled_token() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(logprobs=0), SamplingParams()]
    out = Sampler()(logits, [SampleRow(p, None) for p in params])
    logprobs = logits.log_softmax(-1)
    top = logprobs[0].topk(2)
    assert out.logprobs[0] == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
    token = out.token_ids[1]
    assert out.logprobs[1] == pytest.approx({token: float(logprobs[1, token])})
    assert out.logprobs[2] is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("max_tokens", 0),
        ("seed", -1),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-3]),
        ("n", True),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 5e-324),  # > 0, but 0 as a float32: it made NaNs of the logits
        ("temperature", 1e-40),
        ("min_tokens", -1),
        ("min_tokens", 17),  # more than max_tokens
        ("min_p", 1.5),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: 101.0}),
        ("bad_words_token_ids", [[]]),
        ("bad_words_token_ids", [[1, -2]]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [2, -1]),
        ("logprob_token_ids", []),
        ("logprob_token_ids", [3]),  # without logprobs, whose top tokens it replaces
    ],
)
def test_invalid_sampling_params_raise_value_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_their_inputs() -> None:
    params = SamplingParams(stop="END", top_k=-1)
    assert params.stop == ["END"] and params.top_k == 0 and not params.greedy
    assert SamplingParams(temperature=0).greedy


# ------------------------------------------------------------------------------ logits processors
EOS = 3


def greedy(logits: list[float], prompt: list[int], output: list[int], **params: object) -> int:
    """The greedy token for one row of `logits` after `prompt` and `output`."""
    row = SampleRow(
        SamplingParams(temperature=0.0, max_tokens=32, **params), None, prompt + output, len(prompt)
    )
    return Sampler(eos_token_ids=[EOS])(torch.tensor([logits]), [row]).token_ids[0]


def test_repetition_penalty_divides_the_logits_of_prompt_and_output_tokens() -> None:
    logits = [2.0, 1.8, 0.0, -1.0]
    assert greedy(logits, [0], [], repetition_penalty=1.05) == 0  # 2.0 / 1.05 = 1.90 > 1.8
    assert greedy(logits, [0], [], repetition_penalty=1.2) == 1  # 2.0 / 1.2 = 1.67 < 1.8
    assert greedy(logits, [2], [0], repetition_penalty=1.2) == 1  # output tokens count too
    assert greedy(logits, [2], [], repetition_penalty=1.2) == 0  # unseen tokens keep their logits
    # a negative logit is multiplied, so it sinks further: [-1, -1.1] -> [-1.5 (seen), -1.1]
    assert greedy([-1.0, -1.1, -5.0], [0], [], repetition_penalty=1.5) == 1
    assert greedy([-1.0, -1.1, -5.0], [0], [], repetition_penalty=1.05) == 0


def test_frequency_penalty_counts_each_output_occurrence_and_presence_only_one() -> None:
    logits = [2.0, 1.5, 0.0, 0.0]
    assert greedy(logits, [1], [0, 0, 0], frequency_penalty=0.1) == 0  # 2.0 - 3 x 0.1 = 1.7
    assert greedy(logits, [1], [0, 0, 0], frequency_penalty=0.2) == 1  # 2.0 - 3 x 0.2 = 1.4
    assert greedy(logits, [1], [0, 0, 0], presence_penalty=0.4) == 0  # 2.0 - 0.4, however many
    assert greedy(logits, [1], [0], presence_penalty=0.6) == 1
    # the prompt does not count for either (OpenAI's definition)
    assert greedy(logits, [0, 0, 0, 0], [2], frequency_penalty=2.0, presence_penalty=2.0) == 0
    # a negative penalty encourages repetition
    assert greedy([1.0, 1.5, 0.0], [2], [0], presence_penalty=-1.0) == 0


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = [0.0, 1.0, 2.0, 5.0]  # EOS (3) is the most likely, then the stop token 2
    assert greedy(logits, [0], [1], min_tokens=2) == 2
    assert greedy(logits, [0], [1], min_tokens=2, stop_token_ids=[2]) == 1
    assert greedy(logits, [0], [1, 1], min_tokens=2) == EOS  # reached: nothing masked
    assert greedy(logits, [0], [1], min_tokens=2, ignore_eos=True) == EOS  # EOS does not stop it anyway


def test_logit_bias_is_added_to_the_listed_tokens() -> None:
    logits = [2.0, 1.0, 0.0, 0.0]
    assert greedy(logits, [0], [], logit_bias={1: 0.9}) == 0
    assert greedy(logits, [0], [], logit_bias={1: 1.1}) == 1
    assert greedy(logits, [0], [], logit_bias={0: -100.0, 2: 1.5}) == 2


def test_allowed_token_ids_mask_every_other_token_before_the_other_processors() -> None:
    logits = [0.0, 1.0, 2.0, 5.0]
    assert greedy(logits, [0], [], allowed_token_ids=[0, 1]) == 1
    assert greedy(logits, [0], [], allowed_token_ids=[0, 1], logit_bias={0: 1.5}) == 0
    # min_tokens masks EOS (3), the only allowed token: the row falls back to EOS, never past the vocab
    assert greedy(logits, [0], [], allowed_token_ids=[EOS], min_tokens=1) == EOS


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    logits = [0.0, 1.0, 2.0, 5.0, 0.0]  # 3 is the greedy choice
    words = [[3], [1, 2, 3]]
    assert greedy(logits, [0], [0], bad_words_token_ids=[[4, 3]]) == 3  # the output does not end in 4
    assert greedy(logits, [0], [4], bad_words_token_ids=[[4, 3]]) == 2
    assert greedy(logits, [0], [1, 2], bad_words_token_ids=[[1, 2, 2]]) == 3
    assert greedy(logits, [0], [], bad_words_token_ids=words) == 2  # a one-token word: always banned
    # only the output counts: a prompt ending in the word's prefix does not ban anything
    assert greedy(logits, [4], [], bad_words_token_ids=[[4, 3]]) == 3


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    drawn = Sampler(seed=7)(logits, rows(SamplingParams(min_p=0.35), 4000)).token_ids
    assert set(drawn) == {0, 1}  # 0.15 < 0.35 x 0.5
    counts = torch.bincount(torch.tensor(drawn), minlength=4).float() / 4000
    assert counts[0] == pytest.approx(0.5 / 0.8, abs=0.03)  # the rest renormalised
    # after temperature: at 0.5, probs ~ p^2, so 0.3 falls under 0.4 x the top one (0.36 < 0.4)
    cold = Sampler(seed=8)(logits[:500], rows(SamplingParams(min_p=0.4, temperature=0.5), 500)).token_ids
    assert set(cold) == {0}


def test_processed_rows_leave_their_neighbours_and_the_logprobs_alone() -> None:
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(9))
    plain = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=3)] * 3
    alone = Sampler(seed=1)(logits, [SampleRow(p, torch.Generator().manual_seed(3)) for p in plain])
    biased = list(plain)
    biased[2] = SamplingParams(temperature=0.0, logprobs=1, logit_bias={5: 100.0}, repetition_penalty=2.0)
    mixed = Sampler(seed=1)(
        logits, [SampleRow(p, torch.Generator().manual_seed(3), [1, 2], 1) for p in biased]
    )
    assert mixed.token_ids[2] == 5
    assert [t for i, t in enumerate(mixed.token_ids) if i != 2] == [
        t for i, t in enumerate(alone.token_ids) if i != 2
    ]
    # logprobs describe the model's distribution, not the processed one
    assert mixed.logprobs[2][5] == pytest.approx(float(logits[2].log_softmax(-1)[5]))


def test_a_token_bitmask_allows_exactly_its_set_bits() -> None:
    vocab = 70  # not a multiple of 32: the last word is partial
    allowed = {0, 5, 31, 32, 63, 64, 69}
    bitmask = new_token_bitmask(2, vocab)
    bitmask[0] = 0
    for token in allowed:
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(12))
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, torch.tensor([2, 0]))  # bitmask row j masks logits row rows[j]
    assert set(masked[2].isfinite().nonzero().flatten().tolist()) == allowed
    assert torch.equal(masked[2, sorted(allowed)], logits[2, sorted(allowed)])  # the rest unchanged
    assert torch.equal(masked[:2], logits[:2])  # new_token_bitmask allows everything; row 1 is not listed


def test_structured_outputs_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput("choice")
    with pytest.raises(ValueError, match="spec"):
        StructuredOutput("regex", "")
