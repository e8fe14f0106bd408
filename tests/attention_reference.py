"""Layout-independent helpers for attention-correctness tests: a naive fp32 reference
and random step batches. Every KV layout's tests compare against reference_attention."""

from __future__ import annotations

import math
import random

import torch

from vmkv.kv_cache import SeqStep


def reference_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], steps: list[SeqStep], scale: float
) -> torch.Tensor:
    """Naive fp32 causal GQA attention, one sequence at a time.

    q: packed [T, Hq, D]; keys[i]/values[i]: sequence i's whole context [context_len, Hkv, D].
    The query at position p (num_cached + j) sees keys 0..p.
    """
    out = []
    row = 0
    for s, k, v in zip(steps, keys, values, strict=True):
        qi = q[row : row + s.num_new].double()  # [n, Hq, D]
        row += s.num_new
        group = qi.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qi, kk) * scale
        pos = torch.arange(s.num_cached, s.context_len).unsqueeze(1)
        mask = torch.arange(s.context_len).unsqueeze(0) > pos  # [n, L]
        scores = scores.masked_fill(mask.unsqueeze(0), -math.inf)
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv))
    return torch.cat(out).float()


def random_steps(rng: random.Random, num_seqs: int, max_len: int, mode: str) -> list[SeqStep]:
    """Random step shapes: mode is 'prefill' (nothing cached), 'decode' (one new token) or 'mixed'."""
    steps = []
    for i in range(num_seqs):
        kind = mode if mode != "mixed" else rng.choice(["prefill", "decode", "chunk"])
        if kind == "prefill":
            steps.append(SeqStep(i, 0, rng.randint(1, max_len)))
        elif kind == "decode":
            steps.append(SeqStep(i, rng.randint(0, max_len - 1), 1))
        else:  # a later chunk of a chunked prefill
            cached = rng.randint(1, max_len - 1)
            steps.append(SeqStep(i, cached, rng.randint(1, max_len - cached)))
    return steps
