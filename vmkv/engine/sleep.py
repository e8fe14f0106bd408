"""Pausing and sleeping: an engine that hands its memory back while it is not needed.

An engine sharing its machine with a trainer (reinforcement learning colocates the two) or
with other models holds memory it does not use between bursts of work. Pausing stops
scheduling; sleeping also gives memory back, as vLLM's sleep mode does:

- level 0: paused only, nothing released;
- level 1: the KV cache's memory goes back (the layout's close(): vattention's pages unmapped
  and their memory returned, the paged pool freed) and, on an accelerator, the weights move to
  host memory;
- level 2: the weights go too, reloaded from the checkpoint at wake-up, so weights a trainer
  saved there meanwhile are the ones served.

In-flight requests are aborted, run to their end ("wait"), or kept ("keep": frozen, and
recomputed after wake-up if their KV went). Requests that arrive while paused are held and
start when the engine runs again. Waking up restores what its tags name ("weights",
"kv_cache"; all by default); once everything is back, scheduling resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from vmkv.engine.cpu_linear import packed_slots
from vmkv.engine.errors import ControlRefused

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def check_pause_mode(mode: object) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_sleep_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
    return int(level)  # type: ignore[arg-type]


def check_wake_tags(tags: object) -> tuple[str, ...]:
    """The tags to wake, all of them for None; "scheduling" (vLLM's tag for a level-0 wake-up)
    names nothing to restore."""
    if tags is None:
        return WAKE_TAGS
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings, got {tags!r}")
    unknown = sorted(set(tags) - {*WAKE_TAGS, "scheduling"})
    if unknown:
        raise ValueError(f"unknown tags {unknown}: expected {', '.join(WAKE_TAGS)} or scheduling")
    return tuple(t for t in WAKE_TAGS if t in tags)


Slot = tuple[object, str]  # where a tensor the forward reads is held: (holder, attribute)


def weight_slots(model: torch.nn.Module) -> list[Slot]:
    """Every tensor the model's forward reads, in module order: each parameter's data (the
    Parameter objects stay, so a compiled graph reading them reads the new values), each
    buffer, and the packed weights cpu_linear.py keeps beside the linears."""
    slots: list[Slot] = []
    seen: set[int] = set()
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:  # a tied weight once
                seen.add(id(param))
                slots.append((param, "data"))
        slots += [(module, name) for name, buffer in module._buffers.items() if buffer is not None]
    return slots + packed_slots(model)


@dataclass
class ReleasedWeights:
    """A model's weight tensors let go of (release_weights), and what brings them back."""

    slots: list[Slot]  # listed before they were emptied
    layouts: list[tuple[torch.Size, torch.dtype] | None]  # each one's shape and dtype
    host_copies: list[torch.Tensor | None] | None  # offloaded: their values in host memory


def release_weights(model: torch.nn.Module, offload: bool) -> ReleasedWeights:
    """Let go of every weight tensor (their memory goes back once nothing else holds it); with
    offload, copy them to host memory first, for restore_weights."""
    slots = weight_slots(model)
    values = [getattr(holder, name) for holder, name in slots]
    copies = [None if v is None else v.to("cpu", copy=True) for v in values] if offload else None
    released = ReleasedWeights(slots, [None if v is None else (v.shape, v.dtype) for v in values], copies)
    for holder, name in slots:
        if isinstance(holder, torch.nn.Parameter):
            holder.data = torch.empty(0, dtype=holder.dtype, device=holder.device)
        else:
            setattr(holder, name, None)
    return released


def restore_weights(released: ReleasedWeights, device: torch.device) -> None:
    """Bring offloaded weights back to `device`."""
    if released.host_copies is None:
        raise RuntimeError("these weights were not offloaded: reload them from the checkpoint")
    _fill(released, [None if c is None else c.to(device) for c in released.host_copies])


def refill_weights(released: ReleasedWeights, source: torch.nn.Module) -> None:
    """Give the released tensors the values of `source`, the checkpoint loaded and prepared as
    the served model was; ControlRefused, changing nothing, if its tensors differ in number,
    shape or dtype (the checkpoint now holds another model)."""
    slots = weight_slots(source)
    values = [getattr(holder, name) for holder, name in slots]
    if len(values) != len(released.slots):
        raise ControlRefused(
            f"the checkpoint has {len(values)} weight tensors, the served model {len(released.slots)}"
        )
    for i, value in enumerate(values):
        got, expected = None if value is None else (value.shape, value.dtype), released.layouts[i]
        if got != expected:
            raise ControlRefused(f"the checkpoint's weight tensor {i} is {got}, the model's {expected}")
    _fill(released, values)


def _fill(released: ReleasedWeights, values: list[torch.Tensor | None]) -> None:
    for (holder, name), value in zip(released.slots, values, strict=True):
        setattr(holder, name, value)
