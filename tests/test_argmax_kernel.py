"""The greedy argmax kernel gives what torch's max(dim=-1) gives: each row's first maximum,
a NaN counting as the maximum."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine.argmax_kernel import first_max_indices


@pytest.mark.parametrize("seed", range(20))
def test_first_max_indices_match_torch_on_ties_infinities_and_nans(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 9, (1,), generator=gen))
    width = int(torch.randint(1, 200, (1,), generator=gen))
    logits = torch.randint(-3, 4, (rows, width), generator=gen).float()  # many ties
    if seed % 2:
        logits[torch.rand(rows, width, generator=gen) < 0.3] = float("-inf")
    if seed % 3 == 0:
        logits[torch.rand(rows, width, generator=gen) < 0.05] = float("nan")
    if seed % 5 == 0:
        logits[0] = float("-inf")  # a row where every token is masked
    assert torch.equal(first_max_indices(logits), logits.max(dim=-1).indices)


def test_first_max_indices_read_strided_rows_and_large_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(64, 49160, generator=gen)
    logits = wide[:, 3:49155]  # rows 49,160 apart, not contiguous as a whole
    assert torch.equal(first_max_indices(logits), logits.max(dim=-1).indices)
    logits[5, 7] = float("nan")
    logits[9, 49000] = 1e30
    got = first_max_indices(logits)
    assert got[5] == 7 and got[9] == 49000
    assert torch.equal(got, logits.max(dim=-1).indices)


def test_other_dtypes_take_torch() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=torch.bfloat16)
    assert first_max_indices(logits).tolist() == [1]
    assert first_max_indices(torch.zeros(0, 5)).shape == (0,)
