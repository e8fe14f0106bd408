"""Rendezvous and the per-step channel between rank 0 and the other ranks.

Rendezvous is torch.distributed's own: a TCP store at MASTER_ADDR:MASTER_PORT (the
variables torchrun sets), hosted by rank 0. Every rank finds the engine's config there, so a
worker needs nothing but the rendezvous variables and the model at the same path.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

CONFIG_KEY = "vmkv/config"
# Followers wait in a broadcast for the next step however long the engine is idle; a rank
# that dies closes its sockets, which fails the others' collectives at once, so the group's
# timeout only bounds a rank that hangs without dying.
GROUP_TIMEOUT = timedelta(days=7)


def joined_key(rank: int) -> str:
    return f"vmkv/joined/{rank}"


def ready_key(rank: int) -> str:
    """Set by a worker once its model and cache are built: "ok", or why it could not start."""
    return f"vmkv/ready/{rank}"


def kv_bytes_key(rank: int) -> str:
    """Set by a worker with the physical bytes its KV storage holds (what rank 0 reports per rank)."""
    return f"vmkv/kv-bytes/{rank}"


def join(store: dist.Store, rank: int, world_size: int, device: str) -> dist.ProcessGroup | None:
    """Join the group (NCCL for CUDA, gloo otherwise); returns the group that carries the
    steps' messages: a gloo group beside NCCL (host objects), else None (the default group)."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    store = dist.PrefixStore("vmkv/group", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend == "nccl" else None


def send(message: object, group: dist.ProcessGroup | None) -> int:
    """Broadcast one pickled object from rank 0 (its length, then its bytes); returns its size."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)
    return len(data)


def receive(group: dist.ProcessGroup | None) -> object:
    """The object rank 0's next send() broadcasts."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())  # only rank 0 of this engine's own group sends
