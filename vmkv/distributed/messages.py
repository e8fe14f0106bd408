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
    """Contiguous: the first `length` tokens of slot `slot` copied to host copy `key` (swap-out)."""

    key: int
    slot: int
    length: int


@dataclass(frozen=True)
class HostToSlot:
    """Contiguous: host copy `key` written back into slot `slot`, then dropped (swap-in)."""

    key: int
    slot: int


@dataclass(frozen=True)
class DropHost:
    """Host copy `key` is no longer needed (its sequences were freed or swapped back in)."""

    key: int


KVOp = CopyBlock | BlocksToHost | BlocksFromHost | CopySlot | SlotToHost | HostToSlot | DropHost


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
class StepMessage:
    """One step for the other ranks: apply `ops` (in order), then run the forward.

    steps[i] = (seq_id, num_cached, num_new), as the step's StepBatch; input_ids and
    positions are the packed batch the decoder runs.
    """

    ops: list[KVOp]
    steps: list[tuple[int, int, int]]
    layout: PagedStep | SlotStep
    input_ids: list[int]
    positions: list[int]
