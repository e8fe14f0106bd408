"""Heartbeats: a rank that stops responding without exiting (SIGSTOP, a frozen host) is noticed
within a bounded time, not after the group's timeout.

Every worker bumps a counter in the rendezvous store from a thread of its own, so the beat goes
on while its main thread computes or waits in a collective (both release the GIL). Rank 0
watches the counters on its own clock: one that has not moved for `timeout` seconds marks its
rank hung. A hung rank of this machine is then killed, which fails any collective rank 0 is
waiting in at once (a rank that stopped can never be brought back in step anyway); the reason
rank 0 reports names the hang, not the kill.
"""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import timedelta

import torch.distributed as dist

CONNECT_TIMEOUT = timedelta(seconds=30)


def heartbeat_key(rank: int) -> str:
    return f"vmkv/heartbeat/{rank}"


def interval(timeout: float) -> float:
    """How often a worker beats and rank 0 looks: several beats fit in one timeout."""
    return max(0.05, timeout / 5)


def start_heartbeat(host: str, port: int, rank: int, timeout: float) -> None:
    """Bump this rank's counter every interval(timeout) seconds until the store goes away."""
    store = dist.TCPStore(host, port, is_master=False, timeout=CONNECT_TIMEOUT)  # this thread's own client
    store.add(heartbeat_key(rank), 1)

    def beat() -> None:
        while True:
            time.sleep(interval(timeout))
            try:
                store.add(heartbeat_key(rank), 1)
            except RuntimeError:  # rank 0 is gone; the worker's other watch ends the process
                return

    threading.Thread(target=beat, name="vmkv-heartbeat", daemon=True).start()


class Watchdog:
    """Rank 0's thread that watches ranks 1..N-1's heartbeats; `reason` is set once one is hung."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout: float,
        workers: dict[int, subprocess.Popen[bytes]],
    ) -> None:
        self.timeout, self.workers = timeout, workers
        self.reason: str | None = None
        self._store = dist.TCPStore(host, port, is_master=False, timeout=CONNECT_TIMEOUT)
        now = time.monotonic()
        self._seen = {rank: (-1, now) for rank in range(1, world_size)}  # rank -> (count, when it moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vmkv-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(interval(self.timeout)):
            now = time.monotonic()
            for rank, (count, moved) in self._seen.items():
                try:
                    latest = self._store.add(heartbeat_key(rank), 0)
                except RuntimeError:  # the store is closing with rank 0
                    return
                if latest != count:
                    self._seen[rank] = (latest, now)
                elif now - moved > self.timeout:
                    self._hung(rank, now - moved)
                    return

    def _hung(self, rank: int, silent: float) -> None:
        process = self.workers.get(rank)
        who = f"tensor-parallel rank {rank}" + (f" (pid {process.pid})" if process is not None else "")
        killing = process is not None and process.poll() is None
        # set before the kill: the collective that the kill fails reports this reason
        self.reason = f"{who} stopped responding: no heartbeat for {silent:.1f} s" + (
            "; killed" if killing else ""
        )
        if killing:
            process.kill()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
