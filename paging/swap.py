"""Preemption by swapping: a sequence group's blocks go to host memory and come back later.

A group is swapped out with one copy of its distinct blocks, so blocks shared inside the group
(a fork's prompt) travel once and are shared again when the group comes back in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SwappedBlocks:
    """Where a swapped-out sequence's KV is; the group's members share one host copy, which
    lives as long as one of them does."""

    host: torch.Tensor  # [num_layers, n, 2, block_size, kv_heads, head_dim]: the group's distinct blocks
    host_blocks: list[int]  # the sequence's logical block i is host[:, host_blocks[i]]


def copy_to_host(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Blocks block_ids of the pool kv, in every layer, as a new host tensor (pinned for a GPU)."""
    picked = kv.index_select(1, torch.tensor(block_ids, device=kv.device))
    if kv.device.type == "cpu":
        return picked  # index_select already made the copy
    host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
    host.copy_(picked)
    return host


def copy_from_host(
    kv: torch.Tensor, host: torch.Tensor, host_blocks: list[int], block_ids: list[int]
) -> None:
    """Write host blocks host_blocks into the pool's blocks block_ids, in every layer."""
    picked = host[:, host_blocks].to(kv.device)
    kv.index_copy_(1, torch.tensor(block_ids, device=kv.device), picked)
    if kv.device.type == "cuda":
        torch.cuda.synchronize(kv.device)
