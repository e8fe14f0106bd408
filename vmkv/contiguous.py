"""The pre-paging baseline: every admitted sequence reserves max_len tokens of KV up front.

KV lives in plain tensors, per layer K and V of [num_slots, Hkv, max_len, D], where
num_slots is how many max_len sequences the budget holds. They are head-major like the
vattention layout on the host, so both run the same kernels on the same strides and
differ only in memory. A sequence's slot is reserved whole at admit, however short it
stays: that waste is what the capacity comparison measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from vmkv.dense.attention import attend_dense, check_attend_args
from vmkv.dense.plan import DEFAULT_MAX_PADDING, DenseSlotPlan, plan_step
from vmkv.dense.sequences import DenseSlotSequences
from vmkv.drivers import require_available
from vmkv.kv_cache import KVCache, KVMemory, KVShape, KVStats, OutOfKVMemory, StepBatch, check_truncate


@dataclass
class CopyEvents:
    """Whole-context copies (KVStats fields of the same names)."""

    fork_copies: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    copied_bytes: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0


@dataclass
class _Seq:
    slot: int  # -1 while swapped out
    length: int  # tokens reserved: prompt + every grow
    host_kv: torch.Tensor | None = None  # [layers, 2, Hkv, length, D] while swapped out


class ContiguousKVCache(DenseSlotSequences[_Seq], KVCache[DenseSlotPlan]):
    """Static max_len reservation per sequence; fork and swap copy whole contexts."""

    kv_mode = "contiguous"

    def __init__(
        self,
        shape: KVShape,
        max_len: int,
        kv_budget_bytes: int,
        device: torch.device | str = "cpu",
        max_padding: float = DEFAULT_MAX_PADDING,
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        slot_bytes = max_len * shape.bytes_per_token
        num_slots = kv_budget_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(
                f"a budget of {kv_budget_bytes} bytes holds no sequence of max_len {max_len} "
                f"({slot_bytes} bytes each)"
            )
        self.shape = shape
        self.max_len = max_len
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.max_padding = max_padding
        if self.device.type == "cpu":
            require_available(num_slots * slot_bytes, "the contiguous KV cache")
        # Zero-filled so the masked padding a batched decode reads is never NaN garbage.
        self.kv = torch.zeros(
            shape.num_layers,
            2,
            num_slots,
            shape.num_kv_heads,
            max_len,
            shape.head_dim,
            dtype=shape.dtype,
            device=self.device,
        )
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self.seqs: dict[int, _Seq] = {}  # by id; read them, change them only through the contract
        self._events = CopyEvents()
        self._peak_slots = 0

    # ------------------------------------------------------------ lifecycle
    def can_admit(self, num_tokens: int) -> bool:
        return bool(self._free_slots) and 0 < num_tokens <= self.max_len

    def admit(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        if not token_ids:
            raise ValueError("cannot admit an empty prompt")
        self._check_len(len(token_ids))
        self.seqs[seq_id] = _Seq(self._take_slot(), len(token_ids))
        return 0

    def grow(self, seq_id: int, token_ids: Sequence[int]) -> None:
        seq = self._resident(seq_id)
        self._check_len(seq.length + len(token_ids))
        seq.length += len(token_ids)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        seq = self._resident(seq_id)
        check_truncate(seq_id, num_tokens, seq.length)
        seq.length = num_tokens

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._resident(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id} is already in the cache")
        slot = self._take_slot()
        self.kv[:, :, slot, :, : parent.length] = self.kv[:, :, parent.slot, :, : parent.length]
        self.seqs[child_id] = _Seq(slot, parent.length)
        self._events.fork_copies += 1
        self._events.copied_bytes += parent.length * self.shape.bytes_per_token

    def free(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
        del self.seqs[seq_id]

    def free_capacity(self) -> int:
        """Free slots' tokens plus what the resident sequences can still grow into."""
        room = sum(self.max_len - s.length for s in self.seqs.values() if s.slot >= 0)
        return len(self._free_slots) * self.max_len + room

    def usage(self) -> float:
        return 1.0 - len(self._free_slots) / self.num_slots

    def memory(self) -> KVMemory:
        resident = [s for s in self.seqs.values() if s.slot >= 0]
        return KVMemory(
            reserved_bytes=self.num_slots * self.slot_bytes,
            allocated_bytes=len(resident) * self.slot_bytes,
            used_bytes=sum(s.length for s in resident) * self.shape.bytes_per_token,
        )

    def stats(self) -> KVStats:
        return KVStats(
            unit="slot",
            units_total=self.num_slots,
            units_in_use=self.num_slots - len(self._free_slots),
            units_peak=self._peak_slots,
            **asdict(self._events),
        )

    # ----------------------------------------------------------- preemption
    def swap_out(self, seq_ids: Sequence[int]) -> None:
        seqs = [self._resident(i) for i in seq_ids]
        for seq in seqs:
            seq.host_kv = self.kv[:, :, seq.slot, :, : seq.length].to("cpu", copy=True)
            self._free_slots.append(seq.slot)
            seq.slot = -1
            self._events.swap_outs += 1
            self._events.copied_bytes += seq.length * self.shape.bytes_per_token
            self._events.swap_out_bytes += seq.length * self.shape.bytes_per_token

    def swap_in(self, seq_ids: Sequence[int]) -> None:
        seqs = [self._get(i) for i in seq_ids]
        for i, seq in zip(seq_ids, seqs, strict=True):
            if seq.slot >= 0:
                raise ValueError(f"sequence {i} is not swapped out")
        if len(seqs) > len(self._free_slots):
            raise OutOfKVMemory(len(seqs), len(self._free_slots), "slots")
        for seq in seqs:
            seq.slot = self._take_slot()
            self.kv[:, :, seq.slot, :, : seq.length] = seq.host_kv.to(self.device)
            seq.host_kv = None
            self._events.swap_ins += 1
            self._events.copied_bytes += seq.length * self.shape.bytes_per_token
            self._events.swap_in_bytes += seq.length * self.shape.bytes_per_token

    # -------------------------------------------------------------- a step
    def prepare(self, batch: StepBatch) -> DenseSlotPlan:
        slots = []
        for s in batch.steps:
            seq = self._resident(s.seq_id)
            if s.context_len > seq.length:
                raise ValueError(
                    f"sequence {s.seq_id} writes up to token {s.context_len} but holds room for {seq.length}"
                )
            slots.append(seq.slot)
        return plan_step(batch, slots, [self.max_len] * len(slots), self.device, self.max_padding)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DenseSlotPlan, scale: float
    ) -> torch.Tensor:
        check_attend_args(self.shape, layer, q, k, v, plan)
        keys, values = self.kv[layer, 0].transpose(1, 2), self.kv[layer, 1].transpose(1, 2)  # [S, L, Hkv, D]
        return attend_dense(keys, values, q, k, v, plan, scale)

    def finish_step(self, plan: DenseSlotPlan) -> None:
        """Nothing to record: a fork copies the parent's whole context."""

    def close(self) -> None:
        self.seqs.clear()
        self.kv = torch.empty(0, dtype=self.shape.dtype, device=self.device)

    # -------------------------------------------------------------- helpers
    def _take_slot(self) -> int:
        if not self._free_slots:
            raise OutOfKVMemory(1, 0, "slots")
        slot = self._free_slots.pop()
        self._peak_slots = max(self._peak_slots, self.num_slots - len(self._free_slots))
        return slot
