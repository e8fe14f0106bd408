"""The model side of LoRA: every linear layer of the decoder adds the low-rank terms of the
step's adapters to the rows of the requests that use them, the model's code unmodified.

Each such Linear gets a forward hook (its forward, packed or not, stays as cpu_linear.py made
it); the hook reads the running step's plan, set around the forward like the attention
context: which adapter each group of packed rows uses. Rows of base-model requests are left
alone, so requests with different adapters, and none, share one step and one base GEMM, as
in vLLM's multi-LoRA batching. Per adapter and layer the term costs two thin GEMMs over its
rows, x A^T and then (x A^T) B^T, through the GEMM the model's own linears run (A and B packed
as cpu_linear.py packs their weights: lora.LoRAPair), added to the output. On a 2-core Zen 4
EPYC that ran a rank-16 term 2.5-3x faster than float32 matmuls at 1, 32 and 2,048 rows. The
scheduler orders a step's sequences by adapter, so an adapter's rows are one slice.

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

# one adapter's rows of a step: a slice where they are contiguous (the scheduler orders a step's
# sequences by adapter), else their indices
StepPlan = list[tuple[LoRAAdapter, slice | torch.Tensor]]


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
    spans: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is None:
            continue
        start, end = query_start[i], query_start[i + 1]
        runs = spans.setdefault(id(adapter), (adapter, []))[1]
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return [(adapter, _rows(runs, device)) for adapter, runs in spans.values()]


def _rows(runs: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(start, end) for start, end in runs]).to(device)


def _add_lora(x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
    """y (a linear layer's output for input x) with the step's adapters' terms for `slot` added:
    the op's kernel, which may not change y (an op's output may not alias its input)."""
    return _add_terms(x, y.clone(memory_format=torch.contiguous_format), slot)


def _add_terms(x: torch.Tensor, out: torch.Tensor, slot: int) -> torch.Tensor:
    """Add the step's adapters' terms for `slot` to `out` in place; returns it."""
    rows_in, rows_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    for adapter, rows in _step.plan:
        pair = adapter.weights[slot]
        if pair is None:
            continue
        if isinstance(rows, slice):
            rows_out[rows].add_(pair.term(rows_in[rows]))
        else:
            rows_out.index_add_(0, rows, pair.term(rows_in.index_select(0, rows)))
    return out


def _add_lora_fake(x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


# `vmkv::lora`, defined as `vmkv::attention` is (attention_hook.py): with a plain Library, whose
# call costs ~10 µs less than torch.library.custom_op's wrapper, 210 times a step of the default
# model. It reads the adapters' weights, never a graph tensor's storage, and returns a new tensor.
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
    # eager: the output is the layer's own new tensor (or a column slice of its group's, which
    # the other slices do not overlap), so the terms go into it in place
    return _add_terms(args[0], output, slot)


def hook_lora_slots(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Hook every Linear of the model but its vocabulary projection as a LoRA slot; returns
    each one's name and (in_features, out_features), in slot order: what an adapter is read
    against (lora.read_adapter)."""
    lm_head = model.get_output_embeddings()
    slots: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not lm_head:
            module.register_forward_hook(partial(_hook, len(slots)))
            slots[name] = (module.in_features, module.out_features)
    return slots
