"""Swap for the vattention layout: a sequence's tokens go to host tensors and its slot is
released; swap-in places it in any idle slot, all or nothing. The caller holds the lock."""

from __future__ import annotations

from collections.abc import Sequence

from vmkv.kv_cache import OutOfKVMemory
from vmkv.vattention.mapping import SlotMapping
from vmkv.vattention.slots import SlotSeq, SlotTable


def swap_out(table: SlotTable, mapping: SlotMapping, seqs: Sequence[SlotSeq]) -> None:
    """Copy each (resident) sequence's KV to host tensors and release its slot and pages."""
    if len({id(seq) for seq in seqs}) != len(seqs):
        raise ValueError("a sequence appears twice in one swap_out")
    for seq in seqs:
        seq.host_kv = mapping.read_tokens(seq.slot, seq.length)
        table.release(table.slots[seq.slot])
        seq.slot = -1
        mapping.events.swap_out_bytes += seq.host_kv.numel() * seq.host_kv.element_size()


def swap_in(
    table: SlotTable, mapping: SlotMapping, seq_ids: Sequence[int], seqs: Sequence[SlotSeq], eager: bool
) -> None:
    """Restore swapped sequences into idle slots (those keeping the most pages first)."""
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError("a sequence appears twice in one swap_in")
    for i, seq in zip(seq_ids, seqs, strict=True):
        if seq.slot >= 0:
            raise ValueError(f"sequence {i} is not swapped out")
    geo = table.geometry
    idle = sorted(table.idle(), key=lambda s: (-len(s.sets), s.index))
    if len(idle) < len(seqs):
        raise OutOfKVMemory(len(seqs), len(idle), "slots")
    targets = idle[: len(seqs)]
    missing = sum(
        max(0, geo.pages_for(q.length) - table.usable(s)) for q, s in zip(seqs, targets, strict=True)
    )
    table.require(missing, exclude=table.reusing(targets))
    for slot in targets:
        table.clear_shared(slot)  # the host copy is written over whatever the slot keeps
    for seq_id, seq, slot in zip(seq_ids, seqs, targets, strict=True):
        table.assign(slot, seq_id)  # all targets first, so mapping one never reclaims another's pages
        seq.slot = slot.index
    try:
        for seq, slot in zip(seqs, targets, strict=True):
            table.back(slot, geo.pages_for(seq.length), seq.length, eager)
    except BaseException:
        for seq, slot in zip(seqs, targets, strict=True):
            table.release(slot, keep_pages=table.config.deferred_reclamation)
            seq.slot = -1
        raise
    for seq, slot in zip(seqs, targets, strict=True):
        mapping.write_tokens(slot.index, seq.host_kv)
        mapping.events.swap_in_bytes += seq.host_kv.numel() * seq.host_kv.element_size()
        seq.host_kv = None
