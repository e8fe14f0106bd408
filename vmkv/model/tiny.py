"""Tiny random-weight decoder checkpoints, built locally in about a second, as fast stand-in models.

They have the default model's shape of problem (grouped-query attention, tied embeddings,
byte-level BPE tokenizer, ChatML template) at a size where tests run in milliseconds. Llama is
the default; Qwen2 (biased q/k/v projections) and Mistral show that the engine drives other
architectures through transformers' attention interface without touching their code.
Random LoRA adapters for any checkpoint (build_random_lora) serve the tests and benchmarks of
adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    # tools named to the model, as templates that support tools describe them (in short: the
    # byte-level tokenizer spends a token per character)
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}"
    "{% for tool in tools %}{{ ' ' + tool['function']['name'] }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    # a template variable as real templates read them (Qwen3's), for chat_template_kwargs
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
_TRAINING_TEXT = [
    "The capital of France is Paris.",
    "What is the capital of France?",
    "A key-value cache stores the keys and values of every token a model has seen.",
    "Virtual memory maps pages of physical memory into one contiguous range of addresses.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
]


def build_tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences: encodes any text, decodes it back exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    path: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a random-weight checkpoint (bf16 safetensors, config, tokenizer) to `path`.

    The same seed always gives the same weights. Weights are drawn wider than Llama's usual
    0.02 so greedy decoding has clear winners rather than near-ties that rounding could flip.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {tuple(ARCHITECTURES)}, got {architecture!r}")
    config_class, model_class = ARCHITECTURES[architecture]
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_random_lora(
    model_dir: str | Path,
    path: str | Path,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    seed: int = 1,
) -> Path:
    """Write a random LoRA adapter for the checkpoint in `model_dir` as PEFT saves one
    (adapter_config.json, adapter_model.safetensors), for the modules whose names end with
    `targets`. B is drawn random too (PEFT starts it at zero), so the adapter changes outputs."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets:
            prefix = f"base_model.model.{name}"
            a = torch.randn(rank, module.in_features, generator=generator) * 0.2
            b = torch.randn(module.out_features, rank, generator=generator) * 0.2
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
