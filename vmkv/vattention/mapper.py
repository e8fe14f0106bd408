"""The background mapping thread: maps pages for the next step while this one computes.

Jobs carry the slot's generation at request time. The work function runs every state
change under the cache's lock and drops a job whose slot was freed or reassigned since,
so a late job can never map into a slot that now belongs to someone else.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MapJob:
    slot: int
    generation: int
    target_tokens: int
    least_tokens: int = 0  # a running sequence's job may back fewer than target, never fewer than this
    group_pad: bool = False  # surplus pages that let the slot join a batched decode call
    idle: bool = False  # pre-mapping an idle slot for the next admission (its generation is the idle one)
    upcoming: bool = False  # that admission is a waiting prompt's the scheduler named (KVCache.expect)


class BackgroundMapper:
    """One daemon thread draining a queue of MapJobs into `work`."""

    def __init__(self, work: Callable[[MapJob], None]) -> None:
        self._work = work
        self._jobs: queue.Queue[MapJob | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.cpu_seconds = 0.0  # the thread's CPU time in jobs: what it takes from the step's cores
        self._thread = threading.Thread(target=self._run, name="vattention-mapper", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[MapJob]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the background mapper is stopped")
        for job in jobs:
            self._jobs.put(job)

    def wait_idle(self) -> None:
        """Block until every submitted job ran (tests and benchmarks use it)."""
        self._jobs.join()

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued jobs, then stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError("the background mapper did not stop")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            started = time.thread_time()
            try:
                if job is None:
                    return
                self._work(job)
            except Exception as e:  # mapping ahead is best effort; the step maps what it needs itself
                self.errors.append(e)
            finally:
                self.cpu_seconds += time.thread_time() - started  # a failed job's time too
                self._jobs.task_done()
