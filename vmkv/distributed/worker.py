"""A tensor-parallel worker: ranks 1..N-1 (`python -m vmkv.distributed.worker`).

It needs only the rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets
them) and finds the engine's config in the store. It holds its share of the model and a
cache of its KV heads, and loops: receive a step, apply rank 0's KV ops, run the decoder.
It never samples. It exits when rank 0 says so, when a collective fails (rank 0 or another
rank died), or when the process that started it is gone. A thread beats a heartbeat in the
store, by which rank 0 tells a hung rank from a busy one (watchdog.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial

import msgspec
import torch
import torch.distributed as dist

from vmkv.distributed import channel
from vmkv.distributed.messages import StepMessage
from vmkv.distributed.replica import VATTENTION_FOLLOWER, Replica
from vmkv.distributed.sharding import Shard, kv_storage_bytes, rank_config, rank_kv_shape, shard_model
from vmkv.distributed.watchdog import start_heartbeat
from vmkv.engine.attention_hook import step_context
from vmkv.engine.config import EngineConfig
from vmkv.engine.gc_heap import freeze_start_up_heap
from vmkv.engine.kv_factory import build_kv_cache
from vmkv.engine.model_runner import ModelRunner
from vmkv.vattention import VAttentionKVCache

logger = logging.getLogger(__name__)
START_TIMEOUT = timedelta(minutes=10)
PARENT_CHECK_SECONDS = 1.0


class Follower:
    """One rank's model shard and KV storage, stepping as rank 0 says."""

    def __init__(self, config: EngineConfig, shard: Shard) -> None:
        if torch.device(config.device).type == "cuda":  # one device per rank of this host
            local = int(os.environ.get("LOCAL_RANK", shard.rank))
            torch.cuda.set_device(local)
            config = replace(config, device=f"cuda:{local}")
        self.runner = ModelRunner(config, config.model, shard=partial(shard_model, shard=shard))
        shape = rank_kv_shape(self.runner.kv_shape, shard.world_size)
        follower = partial(VAttentionKVCache, **VATTENTION_FOLLOWER)
        self.replica = Replica(build_kv_cache(rank_config(config), shape, config.model, vattention=follower))

    @torch.inference_mode()
    def step(self, message: StepMessage) -> None:
        self.replica.apply(message.ops)
        plan = self.replica.plan(message)
        device = self.runner.device
        input_ids = torch.tensor(message.input_ids, device=device)[None]
        positions = torch.tensor(message.positions, device=device)[None]
        with step_context(self.replica.cache, plan):
            self.runner.decoder(input_ids=input_ids, position_ids=positions, use_cache=False)

    def close(self) -> None:
        self.replica.cache.close()


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format=f"vmkv rank {rank}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the workers stop
    _exit_with_parent(os.getppid())
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=START_TIMEOUT)
    config = msgspec.json.decode(store.get(channel.CONFIG_KEY), type=EngineConfig)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    else:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    start_heartbeat(address, port, rank, config.tensor_parallel_timeout)
    store.set(channel.joined_key(rank), "1")
    group = channel.join(store, rank, world_size, config.device)
    try:
        follower = Follower(config, Shard(rank, world_size))
    except Exception as error:
        store.set(channel.ready_key(rank), f"{type(error).__name__}: {error}")
        raise
    store.set(channel.kv_bytes_key(rank), str(kv_storage_bytes(follower.replica.cache)))
    freeze_start_up_heap()
    store.set(channel.ready_key(rank), "ok")
    try:
        while (message := channel.receive(group)) is not None:
            follower.step(message)
    finally:
        follower.close()
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit once the process that started this one is gone, even if it was killed outright:
    an orphaned rank would hold its share of the model and its cores forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(1)  # the main thread may be blocked in a collective: no cleanup can run

    threading.Thread(target=watch, name="vmkv-parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
