"""The plan of a step over dense slots: which sequences share one attention call, and how.

A dense-slot layout (vattention, contiguous) gives each sequence one slot: a contiguous run
of K/V per layer. Per step it hands over which slot each sequence has and how many of its
leading tokens are backed by memory ("readable"); plan_step groups the sequences once, and
every layer's attention (attention.py) reads the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv import flash_support
from vmkv.decode_kernel import SHORT_CHUNK, DecodeKernels, DecodePlan, dense_plan
from vmkv.host_metadata import host_query_starts
from vmkv.kv_cache import KVShape, SeqStep, StepBatch

# A decode group may compute at most this many times the useful attention work
# (padded tokens / real tokens) before it is split.
DEFAULT_MAX_PADDING = 1.5


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Can flash_attn_with_kvcache serve this cache (see vmkv/flash_support.py)? flash_attn is
    imported for real, once. head_dim None: plan_step checks it from the K/V view instead."""
    return flash_support.flash_usable(
        device, dtype, flash_support.FLASH_MAX_HEAD_DIM if head_dim is None else head_dim
    )


@dataclass
class DecodeGroup:
    """Decode sequences in slots first_slot .. first_slot+len(rows)-1, attended in one call."""

    rows: torch.Tensor  # int64 [m]: each slot's query row in the packed batch, in slot order
    first_slot: int
    max_len: int
    mask: torch.Tensor | None  # bool [m, 1, 1, max_len], True = attend; None when all lengths are max_len

    @property
    def num_slots(self) -> int:
        return len(self.rows)


@dataclass
class SingleSeq:
    """One sequence attended on its own (prefill chunk, or a decode no group could take)."""

    row_start: int
    row_end: int
    slot: int
    context_len: int
    causal_mask: torch.Tensor | None  # bool [num_new, context_len] for a chunk after cached tokens


@dataclass
class FlashDecode:
    """Inputs of the one flash_attn_with_kvcache call that serves every decode sequence."""

    rows: torch.Tensor  # int64 [B] query rows
    slots: torch.Tensor  # int32 [B] cache_batch_idx
    cache_seqlens: torch.Tensor  # int32 [B] tokens cached before this step


@dataclass
class FlashPrefill:
    """cache_batch_idx and cache_seqlens of every prefill call (singles[i] reads entry i), built
    once per step: one host-to-device copy per step instead of two per sequence per layer."""

    slots: torch.Tensor  # int32 [P]
    cache_seqlens: torch.Tensor  # int32 [P] tokens cached before this step


def decode_kernels(mode: str, device: torch.device, shape: KVShape, use_flash: bool) -> DecodeKernels | None:
    """The CPU decode kernel when `mode` ("auto", "cpu_kernel", "sdpa") asks for it and it can run."""
    if mode == "sdpa" or use_flash:
        return None
    if device.type != "cpu":
        if mode == "cpu_kernel":
            raise ValueError("the CPU decode kernel runs on the CPU only")
        return None
    return DecodeKernels(shape.dtype, shape.head_dim, required=mode == "cpu_kernel")


@dataclass
class KernelDecode:
    """Every decode row of the step, attended by the CPU decode kernel: one per decoding
    sequence, and one per token of a short chunk over a cached context (SHORT_CHUNK)."""

    rows: torch.Tensor  # int64 [Bd] query rows
    slots: list[int]  # for the SDPA fallback when the kernel turns out unavailable
    lens: list[int]
    plan: DecodePlan


@dataclass
class DenseSlotPlan:
    """Everything a layer's attend() needs, built once per step."""

    batch: StepBatch
    write_slot: torch.Tensor  # int64 [T]: slot of every new token
    write_pos: torch.Tensor  # int64 [T]: position of every new token
    groups: list[DecodeGroup]
    singles: list[SingleSeq]
    flash_decode: FlashDecode | None = None  # set on the flash-attn path instead of groups
    flash_prefill: FlashPrefill | None = None  # set on the flash-attn path when a prefill runs
    use_flash: bool = False
    kernel_decode: KernelDecode | None = None  # set on the kernel path instead of groups
    kernels: DecodeKernels | None = None
    prefill_kernel: bool = False  # prefill chunks try the CPU prefill kernel (vmkv/prefill_kernel.py)


def plan_step(
    batch: StepBatch,
    slots: list[int],
    readable: list[int],
    device: torch.device,
    max_padding: float = DEFAULT_MAX_PADDING,
    use_flash: bool = False,
    kernels: DecodeKernels | None = None,
    kv_view: torch.Tensor | None = None,
) -> DenseSlotPlan:
    """Group the step's sequences for attention. readable[i]: tokens backed in slots[i].

    With enabled `kernels` (CPU), decodes go to the kernel, which reads slots of views with
    kv_view's strides (every layer's K and V view must share them). Host work is O(batch)
    plus O(new tokens) for the write positions.
    """
    steps = batch.steps
    if len(slots) != len(steps) or len(readable) != len(steps):
        raise ValueError("need one slot and one readable length per sequence of the batch")
    if use_flash and kv_view is not None and not flash_usable(device, kv_view.dtype, kv_view.shape[-1]):
        use_flash = False  # a head_dim flash-attn cannot take: stock SDPA instead
    write_slot: list[int] = []
    write_pos: list[int] = []
    for s, slot in zip(steps, slots, strict=True):
        write_slot += [slot] * s.num_new
        write_pos += range(s.num_cached, s.context_len)
    starts = host_query_starts(batch)
    write = torch.tensor([write_slot, write_pos], device=device)
    plan = DenseSlotPlan(batch, write[0], write[1], [], [], use_flash=use_flash)
    plan.prefill_kernel = kernels is not None and not use_flash  # the layout runs its own kernels
    kernel = not use_flash and kernels is not None and kernels.enabled
    # short chunks over a cached context go to the kernel as decode rows (SHORT_CHUNK)
    short = [kernel and s.num_new > 1 and s.num_cached > 0 and s.num_new <= SHORT_CHUNK for s in steps]
    decodes = [i for i, s in enumerate(steps) if s.num_new == 1]
    chunks = [i for i in range(len(steps)) if short[i]]
    prefills = [i for i, s in enumerate(steps) if s.num_new > 1 and not short[i]]
    if use_flash:
        if decodes:
            plan.flash_decode = FlashDecode(
                rows=torch.tensor([starts[i] for i in decodes], dtype=torch.int64, device=device),
                slots=torch.tensor([slots[i] for i in decodes], dtype=torch.int32, device=device),
                cache_seqlens=torch.tensor(
                    [steps[i].num_cached for i in decodes], dtype=torch.int32, device=device
                ),
            )
    elif kernel and (decodes or chunks):
        if kv_view is None:
            raise ValueError("the decode kernel needs the K/V view's strides (kv_view)")
        rows = [starts[i] for i in decodes]
        lens = [steps[i].context_len for i in decodes]
        slot_list = [slots[i] for i in decodes]
        for i in chunks:  # row j of the chunk sees its context up to its own token
            s = steps[i]
            rows += range(starts[i], starts[i] + s.num_new)
            lens += range(s.num_cached + 1, s.context_len + 1)
            slot_list += [slots[i]] * s.num_new
        rows_t = torch.tensor(rows, dtype=torch.int64)
        plan.kernels = kernels
        plan.kernel_decode = KernelDecode(
            rows_t.to(device),
            slot_list,
            lens,
            dense_plan(rows_t, torch.tensor(lens), torch.tensor(slot_list), kv_view),
        )
    else:
        entries = [(slots[i], steps[i].context_len, readable[i]) for i in decodes]
        for members in group_decodes(entries, max_padding):
            _add_group(plan, [decodes[j] for j in members], slots, steps, starts, device)
    for i in prefills:
        s = steps[i]
        mask = None
        if s.num_cached and not use_flash:  # bottom-right causal: query j sees keys 0..num_cached+j
            pos = torch.arange(s.num_cached, s.context_len).unsqueeze(1)
            mask = (torch.arange(s.context_len).unsqueeze(0) <= pos).to(device)
        plan.singles.append(SingleSeq(starts[i], starts[i + 1], slots[i], s.context_len, mask))
    if use_flash and prefills:
        flash = torch.tensor([[slots[i] for i in prefills], [steps[i].num_cached for i in prefills]])
        flash = flash.to(device=device, dtype=torch.int32)
        plan.flash_prefill = FlashPrefill(flash[0], flash[1])
    return plan


def group_decodes(entries: list[tuple[int, int, int]], max_padding: float) -> list[list[int]]:
    """Greedy runs of consecutive slots whose padded reads stay backed and cheap enough.

    entries[i] = (slot, context_len, readable); returns runs of indices into entries.
    """
    order = sorted(range(len(entries)), key=lambda i: entries[i][0])
    groups: list[list[int]] = []
    for i in order:
        slot, length, _ = entries[i]
        if groups:
            members = [entries[j] for j in groups[-1]] + [entries[i]]
            lmax = max(m[1] for m in members)
            if (
                slot == members[-2][0] + 1
                and lmax <= min(m[2] for m in members)
                and lmax * len(members) <= max_padding * sum(m[1] for m in members)
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _add_group(
    plan: DenseSlotPlan,
    seqs: list[int],
    slots: list[int],
    steps: list[SeqStep],
    starts: list[int],
    device: torch.device,
) -> None:
    """One batched call for a run of consecutive slots (or a single call for a lone sequence)."""
    if len(seqs) == 1:
        i = seqs[0]
        plan.singles.append(SingleSeq(starts[i], starts[i] + 1, slots[i], steps[i].context_len, None))
        return
    lengths = torch.tensor([steps[i].context_len for i in seqs])
    lmax = int(lengths.max())
    mask = None
    if int(lengths.min()) != lmax:
        mask = (torch.arange(lmax).unsqueeze(0) < lengths.unsqueeze(1)).view(len(seqs), 1, 1, lmax).to(device)
    rows = torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device)
    plan.groups.append(DecodeGroup(rows, slots[seqs[0]], lmax, mask))
