"""Turn a GGUF file into a plain bf16 Hugging Face checkpoint directory.

transformers can read GGUF but refuses to `save_pretrained` a GGUF-loaded model, and
de-quantising on every load costs ~30 s. So we de-quantise once and write the dense
weights, config and tokenizer ourselves; later loads are an ordinary safetensors read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

CHECKPOINT_WEIGHTS = "model.safetensors"


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write `gguf_path` as config.json + model.safetensors (bf16) + tokenizer files into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    state = dense_state_dict(model)
    save_file(state, str(out_dir / CHECKPOINT_WEIGHTS), metadata={"format": "pt"})

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def dense_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as dense bf16 tensors, ready for safetensors.

    Tied embeddings share storage with `lm_head.weight`, which safetensors rejects; the
    config's `tie_word_embeddings` restores the tie on load. We check every tensor against
    a freshly built model so packed GGUF blocks can never be written as if they were weights.
    """
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
    }
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(model.config)
    expected = {name: tuple(tensor.shape) for name, tensor in reference.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    got = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if got != expected:
        mismatched = sorted(set(got.items()) ^ set(expected.items()))[:5]
        raise RuntimeError(f"GGUF model did not load as dense weights; first mismatches: {mismatched}")
    return state
