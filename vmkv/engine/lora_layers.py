"""The model side of LoRA: every linear layer of the decoder adds the low-rank terms of the
step's adapters to the rows of the requests that use them, the model's code unmodified.

Each such Linear gets a forward hook (its forward, packed or not, stays as cpu_linear.py made
it); the hook reads the running step's plan, set around the forward like the attention
context: which adapter each group of packed rows uses. Rows of base-model requests are left
alone, so requests with different adapters, and none, share one step and one base GEMM, as
in vLLM's multi-LoRA batching. Per adapter and layer the term costs two thin GEMMs over its
rows, x A^T and then (x A^T) B^T, added in place; on the CPU they run in float32 (torch's bf16
GEMM without native instructions is several times slower, and these are small).

Under torch.compile the hook's work is one opaque custom op, `vmkv::lora`, whose output is the
layer's output with the terms added: the graph does not depend on which adapters a step uses,
so the compiled graphs serve every mix. Without adapters in the step the op still copies the
layer's output (an op's output may not alias its input): the price of enabling LoRA on a
compiled model, paid by every step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from vmkv.engine.lora import LoRAAdapter

# one adapter's rows of a step: None when they are all the step's rows
StepPlan = list[tuple[LoRAAdapter, torch.Tensor | None]]


@dataclass
class _StepLoRA:
    plan: StepPlan = field(default_factory=list)


_step = _StepLoRA()


@contextmanager
def lora_step(plan: StepPlan) -> Iterator[None]:
    """Make `plan` the adapters every LoRA layer applies inside the block."""
    _step.plan = plan
    try:
        yield
    finally:
        _step.plan = []


def step_plan(
    adapters: Sequence[LoRAAdapter | None], query_start: Sequence[int], device: torch.device
) -> StepPlan:
    """The plan of a packed step whose i-th item (rows query_start[i]:query_start[i+1]) runs
    with adapters[i] (None: the base model)."""
    ranges: dict[int, tuple[LoRAAdapter, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            ranges.setdefault(id(adapter), (adapter, []))[1].extend(range(query_start[i], query_start[i + 1]))
    if len(ranges) == 1 and all(adapter is not None for adapter in adapters):
        return [(next(iter(ranges.values()))[0], None)]
    return [(adapter, torch.tensor(rows, device=device)) for adapter, rows in ranges.values()]


def _add_lora(x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
    """y (a linear layer's output for input x) with the step's adapters' terms for `slot` added."""
    out = y.clone(memory_format=torch.contiguous_format)
    rows_in, rows_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    for adapter, rows in _step.plan:
        pair = adapter.weights[slot]
        if pair is None:
            continue
        a, b = pair
        part = rows_in if rows is None else rows_in.index_select(0, rows)
        term = (part.to(a.dtype) @ a.t()) @ b.t()
        if rows is None:
            rows_out.add_(term)
        else:
            rows_out.index_add_(0, rows, term.to(rows_out.dtype))
    return out


def _add_lora_fake(x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


_LIBRARY = torch.library.Library("vmkv", "FRAGMENT")
_LIBRARY.define("lora(Tensor x, Tensor y, int slot) -> Tensor")
_LIBRARY.impl("lora", _add_lora, "CompositeExplicitAutograd")
torch.library.register_fake("vmkv::lora", _add_lora_fake, lib=_LIBRARY)
lora_op = torch.ops.vmkv.lora.default


def _hook(
    slot: int, module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
) -> torch.Tensor | None:
    if torch.compiler.is_compiling():
        return lora_op(args[0], output, slot)
    if not _step.plan:  # eager, no adapter in this step: the base output as it is
        return None
    return _add_lora(args[0], output, slot)


class LoRALayers:
    """The model's LoRA slots, one per Linear of its decoder (not the vocabulary projection),
    hooked at construction. `slots` maps each module's name to (in_features, out_features),
    in slot order: what an adapter is read against (lora.read_adapter)."""

    def __init__(self, model: torch.nn.Module) -> None:
        lm_head = model.get_output_embeddings()
        self.slots: dict[str, tuple[int, int]] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not lm_head:
                module.register_forward_hook(partial(_hook, len(self.slots)))
                self.slots[name] = (module.in_features, module.out_features)
