"""Rank 0's side of tensor parallelism: it starts the workers, shards its own model, builds the
one KV manager, and sends every step to the other ranks just before its own forward.

The send happens in a forward pre-hook on the decoder, so the engine's step code is the same
with one rank or N: by then the step's cache.prepare has run (the layout step is known) and
the decoder's inputs are the packed batch. Only rank 0 runs lm_head and samples.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from transformers import AutoConfig

from vmkv.distributed import channel
from vmkv.distributed.errors import TensorParallelError
from vmkv.distributed.messages import StepMessage
from vmkv.distributed.recording import RecordingContiguousKVCache, RecordingPagedKVCache
from vmkv.distributed.recording_vattention import RecordingVAttentionKVCache
from vmkv.distributed.sharding import (
    Shard,
    check_divides,
    kv_storage_bytes,
    rank_config,
    rank_kv_shape,
    shard_model,
)
from vmkv.distributed.watchdog import Watchdog
from vmkv.engine.config import EngineConfig
from vmkv.engine.kv_factory import build_kv_cache
from vmkv.kv_cache import KVCache, KVShape

logger = logging.getLogger(__name__)
RecordingCache = RecordingPagedKVCache | RecordingContiguousKVCache | RecordingVAttentionKVCache
START_TIMEOUT_SECONDS = 600.0  # loading a model can take minutes
STOP_TIMEOUT_SECONDS = 10.0
POLL_SECONDS = 0.05
REAP_SECONDS = 2.0


@dataclass
class ChannelStats:
    """What rank 0 sent the other ranks (docs/scale-out.md reports these)."""

    steps: int = 0
    message_bytes: int = 0
    largest_message_bytes: int = 0
    send_seconds: float = 0.0


class TensorParallel:
    """The group of ranks 0..N-1; this process is rank 0 and starts the workers of this
    machine's other ranks (tensor_parallel_local_ranks, default all); the rest join from
    other machines through the same rendezvous."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.world_size = n = config.tensor_parallel_size
        check_divides(AutoConfig.from_pretrained(model_path, local_files_only=True), n)
        local = config.tensor_parallel_local_ranks or n
        if local < n and "MASTER_PORT" not in os.environ:
            raise ValueError(
                "ranks started on other machines need a known rendezvous: set MASTER_ADDR to an "
                "address of this machine they reach and MASTER_PORT to a free port"
            )
        if config.num_threads is None:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // n))
        self.shard = Shard(0, n, failure_reason=self.failure_reason)
        self.stats = ChannelStats()
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.cache: RecordingCache | None = None
        self._group: dist.ProcessGroup | None = None
        self._joined = False
        self._in_forward = False  # set between the step's send and the end of rank 0's forward
        self._closed = False
        self._timeout = config.tensor_parallel_timeout
        self.watchdog: Watchdog | None = None
        self._host = host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.store = dist.TCPStore(
            host,
            int(os.environ.get("MASTER_PORT", "0")),
            n,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=START_TIMEOUT_SECONDS),
        )
        self.store.set(channel.CONFIG_KEY, msgspec.json.encode(replace(config, model=model_path)))
        try:
            for rank in range(1, local):
                self.workers[rank] = _spawn_worker(rank, n, host, self.store.port)
            if local < n:
                logger.info(
                    "waiting for tensor-parallel ranks %d..%d to join at %s:%d",
                    local,
                    n - 1,
                    host,
                    self.store.port,
                )
            self._wait_for_joined()
            self._group = channel.join(self.store, 0, n, config.device)
            self._joined = True
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ start-up
    def install(self, model: torch.nn.Module) -> None:
        """ModelRunner's shard hook: keep rank 0's part and send each step before the decoder runs."""
        shard_model(model, self.shard)
        decoder = model.get_decoder()
        decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        decoder.register_forward_hook(self._after_forward)

    def build_cache(self, config: EngineConfig, shape: KVShape, model_id: str) -> KVCache:
        """The one KV manager: rank 0's layout, recording what the other ranks repeat."""
        self.cache = build_kv_cache(
            rank_config(config),
            rank_kv_shape(shape, self.world_size),
            model_id,
            paged=RecordingPagedKVCache,
            contiguous=RecordingContiguousKVCache,
            vattention=RecordingVAttentionKVCache,
        )
        return self.cache

    def wait_ready(self) -> None:
        """Return once every worker has built its model and cache; raise, with the worker's own
        reason where it gave one, if one could not."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        waiting = set(range(1, self.world_size))
        while waiting:
            # liveness first: a worker that failed set its reason before it exited, so the
            # store, read after, has it
            try:
                self.check_alive()
                gone = None
            except TensorParallelError as error:
                gone = error
            for rank in sorted(waiting):
                if self.store.check([channel.ready_key(rank)]):
                    status = self.store.get(channel.ready_key(rank)).decode()
                    if status != "ok":
                        raise TensorParallelError(f"tensor-parallel rank {rank} could not start: {status}")
                    waiting.discard(rank)
            if gone is not None:
                raise gone
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel ranks {sorted(waiting)} were not ready in {START_TIMEOUT_SECONDS:.0f} s"
                )
            time.sleep(POLL_SECONDS)
        self.watchdog = Watchdog(self._host, self.store.port, self.world_size, self._timeout, self.workers)

    def kv_bytes_per_rank(self) -> list[int]:
        """The physical bytes of KV storage each rank holds, rank 0 first."""
        workers = [int(self.store.get(channel.kv_bytes_key(rank))) for rank in range(1, self.world_size)]
        return [kv_storage_bytes(self.cache), *workers]

    # ---------------------------------------------------------------- steps
    def check_alive(self) -> None:
        """Raise TensorParallelError naming a rank that stopped responding, or the first worker of
        this machine that has exited (a rank on another machine shows only as a failed collective)."""
        if self.watchdog is not None and self.watchdog.reason is not None:
            raise TensorParallelError(self.watchdog.reason)
        for rank, process in self.workers.items():
            if (code := process.poll()) is not None:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited ({_exit_text(code)})"
                )

    def failure_reason(self) -> str | None:
        """After a failed collective: which worker exited, waiting a moment for it to be reaped
        (its sockets close as it dies, which may be just before it shows as exited)."""
        deadline = time.monotonic() + REAP_SECONDS
        while True:
            try:
                self.check_alive()
            except TensorParallelError as gone:
                return str(gone)
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_SECONDS)

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._in_forward:
            raise TensorParallelError(
                "a forward on rank 0 stopped part way while the other ranks ran it: the ranks are out of step"
            )
        self.check_alive()
        ops, steps, layout = self.cache.log.take()
        message = StepMessage(
            ops, steps, layout, kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()
        )
        start = time.perf_counter()
        try:
            size = channel.send(message, self._group)
        except RuntimeError as error:
            reason = self.failure_reason() or f"sending the step to the other ranks failed: {error}"
            raise TensorParallelError(reason) from error
        self._in_forward = True
        self.stats.steps += 1
        self.stats.message_bytes += size
        self.stats.largest_message_bytes = max(self.stats.largest_message_bytes, size)
        self.stats.send_seconds += time.perf_counter() - start

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self._in_forward = False

    # ------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers (asked, then SIGTERM, then SIGKILL) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.close()
        alive = all(p.poll() is None for p in self.workers.values())
        if self._joined and alive and not self._in_forward:
            try:
                channel.send(None, self._group)  # the workers' cue to exit
            except RuntimeError:
                logger.warning("could not tell the tensor-parallel workers to stop; terminating them")
        for stop in ("wait", "terminate", "kill"):
            for process in self.workers.values():
                if process.poll() is None and stop != "wait":
                    getattr(process, stop)()
            deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
            while any(p.poll() is None for p in self.workers.values()) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
        if self._joined:
            dist.destroy_process_group()

    def _wait_for_joined(self) -> None:
        """Wait until every worker has reached the group's rendezvous, failing early if one exits."""
        keys = [channel.joined_key(rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"the tensor-parallel workers did not start in {START_TIMEOUT_SECONDS:.0f} s"
                )
            time.sleep(POLL_SECONDS)


def _spawn_worker(rank: int, world_size: int, host: str, port: int) -> subprocess.Popen[bytes]:
    """A fresh interpreter (never a fork of one whose torch threads exist), told only the
    rendezvous, with torchrun's variable names."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    env.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, "-m", "vmkv.distributed.worker"], env=env)


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
