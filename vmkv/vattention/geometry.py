"""Where every byte of the virtual KV tensors lives, for both orders.

A slot is one sequence's region in each K or V tensor. It is split into columns, each
rounded up to whole pages so no page ever holds two slots' (or two columns') data:
- token-major [slots, max_len, Hkv, D]: one column per slot; a token is Hkv*D elements,
  so a page may end mid-token (384 B tokens: 170.67 per 64 KiB page);
- head-major [slots, Hkv, max_len, D]: one column per KV head; a token is D elements of
  each column, so pages hold whole tokens (128 B: 512 per 64 KiB page).
Every column of every tensor of a slot holds the same number of mapped pages, so one
integer per slot describes its whole mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vmkv.kv_cache import KVShape

ORDERS = ("token", "head")


@dataclass(frozen=True)
class SlotGeometry:
    shape: KVShape
    max_len: int
    max_slots: int
    page_size: int
    order: str

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.max_len < 1 or self.max_slots < 1:
            raise ValueError(f"max_len and max_slots must be >= 1, got {self.max_len} and {self.max_slots}")
        if self.page_size % self.itemsize:
            raise ValueError(f"page size {self.page_size} is not a multiple of the {self.shape.dtype} size")

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.shape.dtype).element_size()

    @cached_property
    def num_tensors(self) -> int:
        """K and V of every layer."""
        return 2 * self.shape.num_layers

    @cached_property
    def columns(self) -> int:
        """Page-aligned regions per slot per tensor."""
        return 1 if self.order == "token" else self.shape.num_kv_heads

    @cached_property
    def units(self) -> int:
        """Pages mapped together when a slot grows by one page: one per column of every tensor."""
        return self.num_tensors * self.columns

    @cached_property
    def column_token_bytes(self) -> int:
        """Bytes one token takes in one column."""
        return self.shape.num_kv_heads * self.shape.head_dim * self.itemsize // self.columns

    @cached_property
    def column_pages(self) -> int:
        """Pages of a full (max_len) column."""
        return -(-self.max_len * self.column_token_bytes // self.page_size)

    @cached_property
    def column_bytes(self) -> int:
        return self.column_pages * self.page_size

    @cached_property
    def slot_bytes(self) -> int:
        return self.columns * self.column_bytes

    @cached_property
    def tensor_bytes(self) -> int:
        return self.max_slots * self.slot_bytes

    @cached_property
    def page_set_bytes(self) -> int:
        return self.units * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages per column that back tokens 0..num_tokens-1 (capped at a full column)."""
        num_tokens = min(num_tokens, self.max_len)
        return -(-num_tokens * self.column_token_bytes // self.page_size)

    def tokens_backed(self, num_pages: int) -> int:
        """Leading tokens whose every byte lies in the first num_pages pages of each column."""
        return min(self.max_len, num_pages * self.page_size // self.column_token_bytes)

    def page_offset(self, slot: int, column: int, page: int) -> int:
        """Byte offset of a column's page within one tensor."""
        return slot * self.slot_bytes + column * self.column_bytes + page * self.page_size

    def as_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor's [slots, max_len, Hkv, D] view (any order) over its flat dtype view."""
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        slot_stride = self.slot_bytes // self.itemsize
        if self.order == "token":
            strides = (slot_stride, h * d, d, 1)
        else:
            strides = (slot_stride, d, self.column_bytes // self.itemsize, 1)
        return flat.as_strided((self.max_slots, self.max_len, h, d), strides)
