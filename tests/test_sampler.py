"""The batched sampler and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine.sampler import Sampler, SampleRow
from vmkv.engine.sampling_params import SamplingParams


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


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    temperature = 0.7
    out = Sampler(seed=1)(logits, rows(SamplingParams(temperature=temperature), 20000))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 20000
    expected = (logits[0] / temperature).softmax(-1)
    assert torch.allclose(counts, expected, atol=0.015)


def test_top_k_and_top_p_cut_the_tail() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    top_k = Sampler(seed=2)(logits, rows(SamplingParams(top_k=2), 4000)).token_ids
    assert set(top_k) == {0, 1}
    top_p = Sampler(seed=3)(logits, rows(SamplingParams(top_p=0.7), 4000)).token_ids
    assert set(top_p) == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there
    top_p_small = Sampler(seed=4)(logits, rows(SamplingParams(top_p=0.1), 100)).token_ids
    assert set(top_p_small) == {0}  # the most likely token always stays
    # even where top_p rounds to 0 in the logits' dtype (found by fuzzing the server: 5e-324)
    tiny = Sampler(seed=5)(logits, rows(SamplingParams(top_p=5e-324), 10)).token_ids
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
    ],
)
def test_invalid_sampling_params_raise_value_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_their_inputs() -> None:
    params = SamplingParams(stop="END", top_k=-1)
    assert params.stop == ["END"] and params.top_k == 0 and not params.greedy
    assert SamplingParams(temperature=0).greedy
