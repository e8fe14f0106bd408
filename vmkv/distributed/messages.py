"""What rank 0 sends the other ranks once per step: one pickled StepMessage, broadcast.

Plain ints and lists only, so a message is small (docs/scale-out.md has the measured sizes)
and means the same on every rank: block and slot ids index each rank's own storage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CopyBlock:
    """Paged: block dst now holds a copy of block src (copy-on-write)."""

    src: int
    dst: int


@dataclass(frozen=True)
class BlocksToHost:
    """Paged: blocks block_ids, in every layer, copied to host copy `key` (swap-out)."""

    key: int
    block_ids: list[int]


@dataclass(frozen=True)
class BlocksFromHost:
    """Paged: blocks host_blocks of host copy `key` written into blocks block_ids (swap-in)."""

    key: int
    host_blocks: list[int]
    block_ids: list[int]


@dataclass(frozen=True)
class CopySlot:
    """Contiguous: the first `length` tokens of slot src copied to slot dst (fork)."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class SlotToHost:
    """Contiguous and vattention: the first `length` tokens of slot `slot` copied to host copy
    `key` (swap-out)."""

    key: int
    slot: int
    length: int


@dataclass(frozen=True)
class HostToSlot:
    """Contiguous and vattention: host copy `key` written back into slot `slot` (swap-in);
    contiguous drops it then, vattention at its DropHost."""

    key: int
    slot: int


@dataclass(frozen=True)
class MapPages:
    """vattention: page sets `sets` mapped at pages first.. of slot `slot` (every column, every region)."""

    slot: int
    first: int
    sets: list[int]


@dataclass(frozen=True)
class UnmapPages:
    """vattention: pages first..first+count-1 of slot `slot` unmapped."""

    slot: int
    first: int
    count: int


@dataclass(frozen=True)
class CopyPages:
    """vattention: pages first..first+count-1 of slot src copied to the same pages of slot dst (fork)."""

    src: int
    dst: int
    first: int
    count: int


@dataclass(frozen=True)
class PagesToHost:
    """vattention: pages first..first+count-1 of slot `slot` copied to host copy `key` (copy-on-write)."""

    key: int
    slot: int
    first: int
    count: int


@dataclass(frozen=True)
class PagesFromHost:
    """vattention: host copy `key` written back at pages first.. of slot `slot` (copy-on-write)."""

    key: int
    slot: int
    first: int


@dataclass(frozen=True)
class DropHost:
    """Host copy `key` is no longer needed (its sequences were freed or swapped back in)."""

    key: int


KVOp = (
    CopyBlock
    | BlocksToHost
    | BlocksFromHost
    | CopySlot
    | SlotToHost
    | HostToSlot
    | MapPages
    | UnmapPages
    | CopyPages
    | PagesToHost
    | PagesFromHost
    | DropHost
)


@dataclass(frozen=True)
class PagedStep:
    """Where the step's tokens go in a paged cache: each sequence's block table, every token's row."""

    tables: list[list[int]]
    write_rows: list[int]


@dataclass(frozen=True)
class SlotStep:
    """Where the step's sequences live in a contiguous cache: their slots."""

    slots: list[int]


@dataclass(frozen=True)
class VAttentionStep:
    """Where the step's sequences live in a vattention cache: their slots, and the tokens
    backed in each (what the step's plan may read: it decides which decodes batch together)."""

    slots: list[int]
    readable: list[int]


@dataclass(frozen=True)
class StepMessage:
    """One step for the other ranks: apply `ops` (in order), then run the forward.

    steps[i] = (seq_id, num_cached, num_new), as the step's StepBatch; input_ids and
    positions are the packed batch the decoder runs.
    """

    ops: list[KVOp]
    steps: list[tuple[int, int, int]]
    layout: PagedStep | SlotStep | VAttentionStep
    input_ids: list[int]
    positions: list[int]
