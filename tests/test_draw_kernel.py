"""The draw kernel: each row's token is where the softmax CDF crosses u x total, for every
temperature, never a token without mass, and rows it cannot draw go back to torch."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine.draw_kernel import _kernel, draw_tokens
from vmkv.engine.sampler import inverse_cdf

pytestmark = pytest.mark.skipif(_kernel() is None, reason="the draw kernel does not build here")


def crossing_bounds(logits: torch.Tensor, temperature: float, token: int) -> tuple[float, float]:
    """The float64 CDF of softmax(logits / T) just before and at `token`."""
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(-1)
    return (float(cdf[token - 1]) if token > 0 else 0.0), float(cdf[token])


@pytest.mark.parametrize("width", [49_152, 1_000, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 3.0])
def test_each_token_is_where_the_softmax_cdf_crosses_u(width: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(16, width, generator=gen) * 4
    uniform = torch.rand(16, 1, generator=gen, dtype=torch.float64)
    tokens = draw_tokens(logits, [temperature] * 16, uniform)
    assert tokens is not None and tokens.dtype == torch.long
    for row, token in enumerate(tokens.tolist()):
        before, at = crossing_bounds(logits[row], temperature, token)
        u = float(uniform[row])
        assert before - 1e-5 <= u <= at + 1e-5


def test_draws_agree_with_the_torch_path_away_from_token_boundaries() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49_152, generator=gen) * 3
    uniform = torch.rand(64, 1, generator=gen, dtype=torch.float64)
    tokens = draw_tokens(logits, [1.0] * 64, uniform)
    expected = inverse_cdf(logits.softmax(-1), uniform)
    assert (tokens != expected).sum() <= 1  # at most a rounding-width miss, none expected


@pytest.mark.parametrize("allowed", [[5, 300, 301], [300, 301, 590]])
def test_masked_tokens_are_never_drawn_even_at_the_ends_of_the_cdf(allowed: list[int]) -> None:
    """The second case has whole blocks of -inf before its first allowed token."""
    logits = torch.full((3, 600), float("-inf"))
    logits[:, allowed] = torch.tensor([1.0, 2.0, 0.5])
    ends = torch.tensor([[0.0], [0.5], [1.0 - 2**-53]], dtype=torch.float64)
    tokens = draw_tokens(logits, [1.0] * 3, ends).tolist()
    assert tokens[0] == allowed[0] and tokens[2] == allowed[2] and tokens[1] in allowed
    many = torch.rand(64, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert set(draw_tokens(logits[:1].expand(64, -1), [1.0] * 64, many).tolist()) <= set(allowed)


def test_a_vanishing_temperature_shares_the_mass_among_the_maxima_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.999]] * 2)
    tokens = draw_tokens(logits, [5e-324, 1e-30], torch.tensor([[0.25], [0.75]], dtype=torch.float64))
    assert tokens.tolist() == [1, 3]


def test_strided_rows_draw_as_their_contiguous_copy() -> None:
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(8, 2_000, generator=gen)
    rows = wide[:, :1_500]
    uniform = torch.rand(8, 1, generator=gen, dtype=torch.float64)
    expected = draw_tokens(rows.contiguous(), [0.9] * 8, uniform)
    assert torch.equal(draw_tokens(rows, [0.9] * 8, uniform), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_with_a_nan_or_infinite_maximum_goes_back_to_torch(bad: float) -> None:
    logits = torch.zeros(4, 300)
    logits[2, 17] = bad
    assert draw_tokens(logits, [1.0] * 4, torch.full((4, 1), 0.5, dtype=torch.float64)) is None


def test_rows_the_kernel_cannot_read_go_back_to_torch() -> None:
    uniform = torch.full((2, 1), 0.5, dtype=torch.float64)
    assert draw_tokens(torch.zeros(2, 300, dtype=torch.float64), [1.0] * 2, uniform) is None
    assert draw_tokens(torch.zeros(300, 2).t(), [1.0] * 2, uniform) is None
