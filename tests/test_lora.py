"""LoRA adapters in the engine: an adapter's outputs are the merged model's, requests with
different adapters (and none) share steps without touching each other's rows or cached
prefixes, the scheduler bounds the adapters per step, and adapters that cannot be served are
refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import make_llm

import vmkv.engine.lora_layers as lora_layers
from vmkv.engine import LLM, LoRARequest, RequestRejected, SamplingParams
from vmkv.engine.config import KV_MODES, EngineConfig
from vmkv.engine.lora import LoRAAdapter, LoRAPair
from vmkv.engine.oracle import compare, reference_greedy
from vmkv.model.store import load_model
from vmkv.model.tiny import build_random_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(5, 30)), [40, 41, 42], list(range(100, 170))]


def tokens(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("loras")
    first = build_random_lora(tiny_model_dir, root / "first", seed=1)
    second = build_random_lora(
        tiny_model_dir, root / "second", rank=8, seed=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj")
    )
    return {"first": LoRARequest("first", 1, str(first)), "second": LoRARequest("second", 2, str(second))}


def merged_checkpoint(model_dir: Path, adapter: LoRARequest, out: Path) -> Path:
    """The base checkpoint with the adapter's scale x B @ A added to its weights, in float32."""
    model = load_model(model_dir, dtype=torch.float32)
    config = json.loads((Path(adapter.lora_path) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter.lora_path) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    for key, a in tensors.items():
        if ".lora_A." in key:
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            scale = config["lora_alpha"] / a.shape[0]
            modules[name].weight.data += scale * (b.float() @ a.float())
    model.save_pretrained(out)
    for file in model_dir.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            (out / file.name).write_bytes(file.read_bytes())
    return out


@pytest.mark.parametrize("kv_mode", KV_MODES)
def test_an_adapters_greedy_tokens_are_the_merged_models(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path, kv_mode: str
) -> None:
    adapter = adapters["first"]
    llm = make_llm(tiny_model_dir, kv_mode, enable_lora=True)
    got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=adapter))
    merged = merged_checkpoint(tiny_model_dir, adapter, tmp_path / "merged")
    report = compare(reference_greedy(merged, PROMPTS, GREEDY.max_tokens, torch.float32), got)
    assert report.passed, report.mismatches
    assert got != tokens(llm.generate(PROMPTS, GREEDY))  # the adapter changes what the model says
    llm.close()


@pytest.mark.parametrize("compile_model", [False, True])
def test_requests_with_different_adapters_share_a_step_and_keep_their_own_rows(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], compile_model: bool
) -> None:
    first, second = adapters["first"], adapters["second"]
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True, max_loras=2, compile_model=compile_model)
    alone = {
        name: tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora))
        for name, lora in (("base", None), ("first", first), ("second", second))
    }
    plans: list[int] = []
    original = lora_layers.step_plan

    def recording(*args: object) -> lora_layers.StepPlan:
        plan = original(*args)
        plans.append(len(plan))
        return plan

    lora_layers_step_plan = pytest.MonkeyPatch()
    lora_layers_step_plan.setattr("vmkv.engine.model_runner.step_plan", recording)
    try:
        loras = [None, first, second] * len(PROMPTS)
        mixed = tokens(llm.generate([p for p in PROMPTS for _ in range(3)], GREEDY, lora_request=loras))
    finally:
        lora_layers_step_plan.undo()
    assert 2 in plans  # both adapters ran in one step, beside base rows
    for i in range(len(PROMPTS)):
        assert mixed[3 * i : 3 * i + 3] == [alone["base"][i], alone["first"][i], alone["second"][i]]
    llm.close()


@pytest.mark.parametrize("kv_mode", ["paged", "vattention"])
def test_adapters_never_share_cached_prefixes_with_the_base_model_or_each_other(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], kv_mode: str
) -> None:
    llm = make_llm(tiny_model_dir, kv_mode, enable_lora=True)
    prompt = list(range(5, 70))
    base = llm.generate([prompt], GREEDY)[0]
    with_adapter = llm.generate([prompt], GREEDY, lora_request=adapters["first"])[0]
    again = llm.generate([prompt], GREEDY, lora_request=adapters["first"])[0]
    base_again = llm.generate([prompt], GREEDY)[0]
    assert with_adapter.num_cached_tokens == 0  # the base model's KV of the prompt is not the adapter's
    assert again.num_cached_tokens > 0 and tokens([again]) == tokens([with_adapter])
    assert base_again.num_cached_tokens > 0 and tokens([base_again]) == tokens([base])
    llm.close()


def test_max_loras_bounds_the_adapters_in_a_step_and_every_request_still_finishes(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = adapters["first"], adapters["second"]
    llm = make_llm(tiny_model_dir, "vattention", enable_lora=True, max_loras=1, max_cpu_loras=2)
    expected = [tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)) for lora in (first, second)]
    adapters_per_step: list[int] = []
    original = lora_layers.step_plan
    monkeypatch.setattr(
        "vmkv.engine.model_runner.step_plan",
        lambda *args: adapters_per_step.append(len(plan := original(*args))) or plan,
    )
    outputs = tokens(llm.generate(PROMPTS * 2, GREEDY, lora_request=[first] * 3 + [second] * 3))
    assert max(adapters_per_step) == 1
    assert outputs == expected[0] + expected[1]
    llm.close()


def test_a_preempted_adapter_request_recomputes_with_its_adapter(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny_model_dir, "paged", enable_lora=True)
    expected = tokens(roomy.generate(PROMPTS, params, lora_request=adapters["second"]))
    roomy.close()
    # room for about two of the three sequences at their longest: someone is preempted
    tight = make_llm(tiny_model_dir, "paged", enable_lora=True, kv_budget_bytes=80 * 2 * 2 * 2 * 16 * 4 * 2)
    got = tight.generate(PROMPTS, params, lora_request=adapters["second"])
    assert tight.engine.stats().num_preemptions > 0
    assert tokens(got) == expected
    tight.close()


def test_adapters_past_max_cpu_loras_are_let_go_of_and_read_again_when_named(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    first, second = adapters["first"], adapters["second"]
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True, max_cpu_loras=1)
    expected = tokens(llm.generate(PROMPTS, GREEDY, lora_request=first))
    llm.generate(PROMPTS, GREEDY, lora_request=second)
    assert llm.engine.list_loras() == ["second"]
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=first)) == expected
    assert llm.engine.list_loras() == ["first"]
    assert llm.engine.remove_lora("first") and not llm.engine.remove_lora("first")
    llm.close()


def write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> LoRARequest:
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return LoRARequest(directory.name, 9, str(directory))


LAYER = "base_model.model.model.layers.0.self_attn.q_proj"


def pair(a: tuple[int, int], b: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {f"{LAYER}.lora_A.weight": torch.zeros(a), f"{LAYER}.lora_B.weight": torch.zeros(b)}


GOOD = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        (GOOD | {"use_dora": True}, None, "DoRA"),
        (GOOD | {"bias": "all"}, None, "biases"),
        (GOOD | {"modules_to_save": ["lm_head"]}, None, "whole modules"),
        ({"peft_type": "IA3"}, None, "only LoRA"),
        (GOOD, {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}, "lm_head"),
        (GOOD, pair((2, 64), (32, 2)), "needs A"),
        (GOOD, pair((32, 64), (64, 32)), "max_lora_rank"),
        (GOOD, {f"{LAYER}.lora_A.weight": torch.zeros(2, 64)}, "not both"),
        (GOOD, {f"{LAYER}.weight": torch.zeros(2, 64)}, "not a LoRA A or B"),
        (GOOD, pair((), (64, 2)), "needs A"),  # a scalar A
        (GOOD | {"lora_alpha": "eight"}, None, "must be a number"),
        (GOOD | {"alpha_pattern": {"q_proj(": 2}}, None, "regular expression"),
    ],
)  # fmt: skip
def test_an_adapter_that_cannot_be_served_is_refused_and_nothing_runs(
    tiny_model_dir: Path, tmp_path: Path, config: dict, tensors: dict | None, message: str
) -> None:
    tensors = tensors or {
        f"{LAYER}.lora_A.weight": torch.zeros(2, 64),
        f"{LAYER}.lora_B.weight": torch.zeros(64, 2),
    }
    request = write_adapter(tmp_path / "bad", config, tensors)
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True)
    with pytest.raises(RequestRejected, match=message) as refused:
        llm.generate(PROMPTS, GREEDY, lora_request=request)
    assert refused.value.param == "model"
    assert llm.engine.list_loras() == [] and not llm.engine.has_unfinished_requests()
    llm.close()


def test_an_adapter_file_of_any_other_content_is_refused_and_the_engine_keeps_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(GOOD))
    torch.save([1, 2, 3], tmp_path / "adapter_model.bin")
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True)
    with pytest.raises(RequestRejected, match="cannot be read"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("odd", 5, str(tmp_path)))
    assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS)
    llm.close()


def test_wrong_adapter_requests_are_refused_with_the_reason(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], tmp_path: Path
) -> None:
    plain = make_llm(tiny_model_dir, "paged")
    with pytest.raises(RequestRejected, match="enable_lora"):
        plain.generate(PROMPTS, GREEDY, lora_request=adapters["first"])
    plain.close()
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True)
    with pytest.raises(RequestRejected, match="no adapter_config.json"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("missing", 3, str(tmp_path)))
    llm.generate(PROMPTS, GREEDY, lora_request=adapters["first"])
    elsewhere = LoRARequest("first", 1, adapters["second"].lora_path)
    with pytest.raises(RequestRejected, match="remove it first"):
        llm.generate(PROMPTS, GREEDY, lora_request=elsewhere)
    with pytest.raises(ValueError, match="LoRA requests for"):
        llm.generate(PROMPTS, GREEDY, lora_request=[adapters["first"]])
    llm.close()


def test_lora_settings_are_checked_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/nowhere")
    assert EngineConfig(max_loras=3).max_cpu_loras == 3


def prompt_logprobs(llm: LLM, lora: LoRARequest | None) -> torch.Tensor:
    """Each prompt token's log-probability after the tokens before it, all prompts end to end."""
    params = SamplingParams(prompt_logprobs=0, max_tokens=1)
    values = []
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, lora_request=lora), strict=True):
        values += [
            entry[token] for token, (entry, _) in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)
        ]
    return torch.tensor(values)


@pytest.mark.parametrize("fp32_gemm", [False, True])
def test_adapters_run_on_the_half_precision_linears_both_ways(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], fp32_gemm: bool
) -> None:
    """bf16 weights behind either GEMM form (cpu_linear.py): what the adapter changes in the
    prompt's log-probabilities is what it changes in float32, up to bf16 rounding."""
    exact = make_llm(tiny_model_dir, "paged", enable_lora=True)
    base, tuned = prompt_logprobs(exact, None), prompt_logprobs(exact, adapters["first"])
    exact.close()
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True, dtype="bfloat16", fp32_gemm=fp32_gemm)
    half = prompt_logprobs(llm, adapters["first"])
    llm.close()
    effect, error = (tuned - base).abs().mean(), (half - tuned).abs().mean()
    assert error < 0.1 * effect, (float(error), float(effect))


def test_an_embedding_runs_with_its_adapter(tiny_model_dir: Path, adapters: dict[str, LoRARequest]) -> None:
    llm = make_llm(tiny_model_dir, "paged", enable_lora=True)
    params = SamplingParams(pooling="last", max_tokens=1)
    base = llm.generate(PROMPTS, params)
    tuned = llm.generate(PROMPTS, params, lora_request=adapters["first"])
    assert all(b.embedding != t.embedding for b, t in zip(base, tuned, strict=True))
    llm.close()


def test_a_plan_takes_each_adapters_rows_as_one_slice_where_they_are_contiguous() -> None:
    first = LoRAAdapter("first", "/a", [LoRAPair(torch.randn(2, 8), torch.randn(4, 2))])
    second = LoRAAdapter("second", "/b", [LoRAPair(torch.randn(2, 8), torch.randn(4, 2))])
    query_start = [0, 2, 3, 5, 9]
    plan = lora_layers.step_plan([first, first, None, second], query_start, torch.device("cpu"))
    assert plan == [(first, slice(0, 3)), (second, slice(5, 9))]
    [(adapter, rows)] = lora_layers.step_plan([first, None, first, None], query_start, torch.device("cpu"))
    assert adapter is first and rows.tolist() == [0, 1, 3, 4]
    # either form adds the same terms to the same rows, and nothing to the others
    x, y = torch.randn(1, 9, 8), torch.randn(1, 9, 4)
    expected = y.clone()
    expected[0, [0, 1, 3, 4]] += first.weights[0].term(x[0, [0, 1, 3, 4]])
    with lora_layers.lora_step([(first, rows)]):
        assert torch.allclose(lora_layers.lora_op(x, y, 0), expected)
    with lora_layers.lora_step([(first, slice(0, 2)), (first, slice(3, 5))]):
        assert torch.allclose(lora_layers.lora_op(x, y, 0), expected)


def test_samples_beams_swaps_and_sleep_keep_their_adapter(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    lora = adapters["second"]
    llm = make_llm(tiny_model_dir, "vattention", enable_lora=True, preemption_mode="swap")
    expected = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora))
    two = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    assert all(
        [s.token_ids for s in out.outputs] == [want, want]
        for out, want in zip(llm.generate(PROMPTS, two, lora_request=lora), expected, strict=True)
    )
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=10, ignore_eos=True)
    with_adapter = tokens(llm.generate(PROMPTS, beams, lora_request=lora))
    assert with_adapter != tokens(llm.generate(PROMPTS, beams))
    assert tokens(llm.generate(PROMPTS, beams, lora_request=lora)) == with_adapter
    llm.sleep(2)
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)) == expected
    llm.close()
    # swapped out and back in under memory pressure, each sequence resumes with its adapter
    tight = make_llm(
        tiny_model_dir,
        "paged",
        enable_lora=True,
        preemption_mode="swap",
        kv_budget_bytes=80 * 2 * 2 * 2 * 16 * 4 * 2,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny_model_dir, "paged", enable_lora=True)
    want = tokens(roomy.generate(PROMPTS, params, lora_request=lora))
    roomy.close()
    assert tokens(tight.generate(PROMPTS, params, lora_request=lora)) == want
    assert tight.engine.stats().num_preemptions > 0
    tight.close()
