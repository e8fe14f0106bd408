"""Where every byte of the virtual KV lives, for the three orders.

A slot is one sequence's region in each virtual region. It is split into columns, each
rounded up to whole pages so no page ever holds two slots' (or two columns') data:
- token-major "token" [slots, max_len, Hkv, D], one region per layer's K or V: one column per
  slot; a token is Hkv*D elements, so a page may end mid-token (384 B tokens: 170.67 per
  64 KiB page);
- head-major "head" [slots, Hkv, max_len, D], one region per layer's K or V: one column per KV
  head; a token is D elements of each column, so pages hold whole tokens (128 B: 512 per page);
- layer-packed "packed" [slots, max_len, layers, 2, Hkv, D], one region for everything: a token
  is every layer's K and V (SmolLM2-135M: 30*2*3*64 bf16 = 23,040 B, 91 tokens per 2 MiB page,
  where a per-layer order pins 2*30 pages of 2 MiB for a one-token sequence). Pages may end
  mid-token, as token-major ones do.
In every order each layer's K and V is a [slots, max_len, Hkv, D] strided view, last dim
contiguous, so stock kernels read it in place. Every column of every region of a slot holds
the same number of mapped pages, so one integer per slot describes its whole mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from vmkv.kv_cache import KVShape

ORDERS = ("token", "head", "packed")
ORDER_NAMES = {"token": "token-major", "head": "head-major", "packed": "layer-packed"}


@dataclass(frozen=True)
class SlotGeometry:
    shape: KVShape
    max_len: int
    max_slots: int
    page_size: int
    order: str
    huge_run: int = 0  # the driver's (MemoryDriver.huge_run): packed slots start on such runs

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
        """K and V of every layer: the views a kernel reads."""
        return 2 * self.shape.num_layers

    @cached_property
    def regions(self) -> int:
        """Virtual regions reserved and mapped: one per K/V tensor, or one holding all (packed)."""
        return 1 if self.order == "packed" else self.num_tensors

    @cached_property
    def columns(self) -> int:
        """Page-aligned regions per slot per region."""
        return self.shape.num_kv_heads if self.order == "head" else 1

    @cached_property
    def units(self) -> int:
        """Pages mapped together when a slot grows by one page: one per column of every region."""
        return self.regions * self.columns

    @cached_property
    def row_elems(self) -> int:
        """Elements of one token of one K or V tensor (Hkv * D)."""
        return self.shape.num_kv_heads * self.shape.head_dim

    @cached_property
    def column_token_bytes(self) -> int:
        """Bytes one token takes in one column."""
        per_region = self.num_tensors // self.regions  # tensors sharing a region: all (packed) or one
        return per_region * self.row_elems * self.itemsize // self.columns

    @cached_property
    def run_pages(self) -> int:
        """Pages of a huge-page run that a layer-packed slot keeps aligned, so that its full runs
        become huge pages (1: none). Only that order: its rows of one layer are a page apart, so
        it is the one whose reads the TLB slows (docs/vattention.md, "Huge pages")."""
        if self.order != "packed" or self.huge_run <= self.page_size or self.huge_run % self.page_size:
            return 1
        return self.huge_run // self.page_size

    @cached_property
    def column_pages(self) -> int:
        """Pages of a full (max_len) column, in whole runs so every slot starts on one."""
        pages = -(-self.max_len * self.column_token_bytes // self.page_size)
        return -(-pages // self.run_pages) * self.run_pages

    @cached_property
    def column_bytes(self) -> int:
        return self.column_pages * self.page_size

    @cached_property
    def slot_bytes(self) -> int:
        return self.columns * self.column_bytes

    @cached_property
    def region_bytes(self) -> int:
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
        """Byte offset of a column's page within one region."""
        return slot * self.slot_bytes + column * self.column_bytes + page * self.page_size

    def views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's K and V (K0, V0, K1, V1, ...) as [slots, max_len, Hkv, D] views over the
        regions' flat dtype views (one per region)."""
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        size = (self.max_slots, self.max_len, h, d)
        slot_stride = self.slot_bytes // self.itemsize
        if self.order == "packed":
            # tensor t starts t rows into each token; as_strided keeps the slice's storage offset
            (flat,) = flats
            strides = (slot_stride, self.num_tensors * self.row_elems, d, 1)
            return [flat[t * self.row_elems :].as_strided(size, strides) for t in range(self.num_tensors)]
        if self.order == "token":
            strides = (slot_stride, h * d, d, 1)
        else:
            strides = (slot_stride, d, self.column_bytes // self.itemsize, 1)
        return [flat.as_strided(size, strides) for flat in flats]
