"""The Triton paged kernel against the reference, through the paged cache's own contract.

On a GPU the kernel is compiled and run there. On a CPU it runs under Triton's interpreter,
which must be chosen before Triton is first imported; so without a GPU and without
TRITON_INTERPRET=1 the one test that runs re-runs this file in a child pytest with it set.
Shapes are few and small: the interpreter executes the kernel in numpy, one program at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_paged_attention import TOLERANCE, Runner, make_cache, run_random_batch
from vmkv.paging.triton_attention import interpreting, triton, triton_unusable_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_HERE = triton is not None and (DEVICE == "cuda" or interpreting())
here = pytest.mark.skipif(not RUNS_HERE, reason="runs compiled on a GPU or under TRITON_INTERPRET=1")


@pytest.mark.skipif(RUNS_HERE or triton is None, reason="the kernel tests run in this process")
def test_kernel_under_the_interpreter_in_a_child_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


# The interpreter runs tl.dot in numpy, which has no bfloat16 (it multiplies the raw bits):
# bf16 is checked compiled, on a GPU.
TOLERANCES = {**TOLERANCE, torch.float16: 5e-3}  # fp16 keeps 11 bits: 8x finer than bf16
CASES = [("decode", torch.float32), ("mixed", torch.float32), ("mixed", torch.float16)]
if DEVICE == "cuda":
    CASES += [("decode", torch.bfloat16), ("mixed", torch.bfloat16)]


@here
@pytest.mark.parametrize(("mode", "dtype"), CASES)
def test_random_batches_match_reference(mode: str, dtype: torch.dtype) -> None:
    """Decodes, prefills, chunks after cached tokens; GQA with 3 query heads per KV head."""
    cache = make_cache(dtype, "triton", num_layers=1, device=DEVICE)
    assert cache.attention.name == "triton"
    runner = Runner(cache, num_q_heads=6)
    assert run_random_batch(runner, mode, seed=7, num_seqs=4, max_len=50) < TOLERANCES[dtype]


@here
def test_head_dim_and_group_that_are_not_powers_of_two() -> None:
    cache = make_cache(
        torch.float32, "triton", block_size=32, num_kv_heads=3, head_dim=24, num_layers=1, device=DEVICE
    )
    runner = Runner(cache, num_q_heads=9, seed=3)
    assert run_random_batch(runner, "mixed", seed=3, num_seqs=3, max_len=70) < 5e-5


def test_refuses_what_it_cannot_run() -> None:
    if triton is None:
        assert triton_unusable_reason(torch.device("cuda"), torch.float16, 16) == "triton is not installed"
        return
    assert "power-of-two" in triton_unusable_reason(torch.device("cuda"), torch.float16, 5)
    assert "fp16, bf16 or fp32" in triton_unusable_reason(torch.device("cuda"), torch.int8, 16)
    if not interpreting():
        assert "CUDA" in triton_unusable_reason(torch.device("cpu"), torch.float16, 16)
        with pytest.raises(ValueError, match="CUDA"):
            make_cache(torch.float32, "triton", device="cpu")
