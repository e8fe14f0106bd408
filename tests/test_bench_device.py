"""`vmkv bench --device`: the engine, the kernel matrix and the auto dtype all follow the device."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from vmkv.bench import cli
from vmkv.bench.kernels import LAYOUTS, UNMODIFIED, KernelMatrix, MatrixCell, cell_key


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_bench_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_refused_before_anything_is_built():
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        cli.device_overrides(parse("--device", "cuda"))
    with pytest.raises(SystemExit, match="cpu or cuda"):
        cli.device_overrides(parse("--device", "meta"))


def test_auto_dtype_on_a_gpu_is_bfloat16_not_a_cpu_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.device_overrides(parse("--device", "cuda")) == {"dtype": "bfloat16"}
    assert cli.device_overrides(parse("--device", "cuda:0", "--dtype", "float32")) == {}
    assert cli.device_overrides(parse("--device", "cpu")) == {}


def test_the_kernel_matrix_runs_on_the_bench_device(monkeypatch, tiny_model_dir: Path, tmp_path: Path):
    seen: list[object] = []

    def kernel_matrix(shape, contexts, batches, device=None, **kwargs):
        seen.append(device)
        times = {cell_key(b, c): 1.0 for b in batches for c in contexts}
        cells = [
            MatrixCell("sdpa math", layout, UNMODIFIED, max_error=0.0, times_ms=times) for layout in LAYOUTS
        ]
        return KernelMatrix(shape, str(device), list(contexts), list(batches), cells)

    monkeypatch.setattr(cli, "kernel_matrix", kernel_matrix)
    args = parse(
        "--model", str(tiny_model_dir), "--out", str(tmp_path), "--sections", "kernels", "--device", "cpu"
    )
    cli.bench_main(args)
    assert seen == ["cpu"]
