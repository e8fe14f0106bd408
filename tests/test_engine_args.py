"""The engine flags: every EngineConfig field has one, and a config survives the round trip
through the flags the bench gives its servers."""

from __future__ import annotations

import argparse

import pytest
import torch

from vmkv.bench.online import serve_arguments
from vmkv.engine import config
from vmkv.engine.args import add_engine_arguments, engine_config, engine_flags, ignored_flags
from vmkv.engine.config import EngineConfig
from vmkv.server.launcher import add_serve_arguments


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config(parser.parse_args(argv))


def test_defaults_are_the_config_defaults() -> None:
    assert parse([]) == EngineConfig()


def test_engines_compile_by_default_where_compiling_is_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "COMPILE_BY_DEFAULT", True)  # the suite's engines run eagerly (conftest)
    assert EngineConfig().compile_model is True
    assert parse([]).compile_model is True
    assert EngineConfig(tensor_parallel_size=2).compile_model is False  # not compiled yet
    assert parse(["--tensor-parallel-size", "2"]).compile_model is False
    assert parse(["--no-compile"]).compile_model is False
    assert EngineConfig(compile_model=False).compile_model is False


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(
            model="/models/x",
            kv_mode="paged",
            dtype="float32",
            kv_budget_bytes=64 << 20,
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            preemption_mode="swap",
            block_size=32,
            page_size=4096,
            kv_order="head",
            kv_preallocate=True,
            enable_prefix_caching=False,
            seed=7,
            num_threads=2,
            fp32_gemm=False,
            compile_model=True,
            logits_processors=("my.module:Processor", "other.Processor"),
        ),
    ],
)
def test_every_field_round_trips_through_the_flags(config: EngineConfig) -> None:
    assert parse(engine_flags(config)) == config


def test_serve_parses_the_same_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = EngineConfig(kv_mode="contiguous", page_size=8192, fp32_gemm=True)
    assert engine_config(parser.parse_args(engine_flags(config))) == config


def test_skipped_fields_come_from_overrides_and_auto_dtype_resolves() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, skip=("model", "seed"), default_dtype="auto")
    args = parser.parse_args([])
    assert not hasattr(args, "model") and not hasattr(args, "seed")
    config = engine_config(args, model="m", seed=3)
    assert (config.model, config.seed) == ("m", 3) and config.dtype in ("bfloat16", "float32")


def test_a_budget_that_is_not_whole_mib_has_no_flag() -> None:
    with pytest.raises(ValueError, match="MiB"):
        engine_flags(EngineConfig(kv_budget_bytes=(1 << 20) + 1))


def test_the_bench_starts_its_servers_with_the_same_settings_on_every_replica() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = EngineConfig(kv_mode="paged", block_size=8, seed=5)
    args = parser.parse_args(serve_arguments(config, 8123, data_parallel_size=2))
    assert engine_config(args) == config and args.data_parallel_size == 2 and args.port == 8123
    assert parser.parse_args(serve_arguments(config, 8123)).data_parallel_size == 1


def test_an_unknown_kv_order_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="kv_order must be one of .*packed"):
        EngineConfig(kv_order="layer")


def test_flags_wrong_together_end_the_command_with_one_line_not_a_traceback() -> None:
    with pytest.raises(
        SystemExit, match=r"^vmkv: error: max_num_batched_tokens \(4\) must be >= max_num_seqs"
    ):
        parse(["--max-num-batched-tokens", "4", "--max-num-seqs", "64"])


@pytest.mark.parametrize("kv_mode", ["paged", "contiguous"])
def test_vattention_only_flags_given_for_another_mode_are_named(kv_mode: str) -> None:
    flags = ["--page-size", "8192", "--kv-order", "head", "--kv-preallocate"]
    named = ["--page-size", "--kv-order", "--kv-preallocate"]
    assert ignored_flags(parse(["--kv-mode", kv_mode, *flags])) == named
    assert ignored_flags(parse(["--kv-mode", kv_mode, "--kv-preallocate"])) == ["--kv-preallocate"]
    assert ignored_flags(parse(["--kv-mode", kv_mode])) == []
    assert ignored_flags(parse(["--kv-mode", "vattention", *flags])) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_device_torch_cannot_use_is_refused_before_the_engine_starts() -> None:
    with pytest.raises(SystemExit, match="--device cuda: this torch sees no CUDA GPU"):
        parse(["--device", "cuda"])
    with pytest.raises(SystemExit, match="--device must be cpu or cuda"):
        parse(["--device", "tpu"])


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [("--port", "99999", "must be 0..65535"), ("--shutdown-grace-seconds", "-1", "must be a number >= 0")],
)
def test_serve_refuses_an_impossible_port_or_grace_period_before_starting(flag, value, why, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, value])
    assert why in capsys.readouterr().err
