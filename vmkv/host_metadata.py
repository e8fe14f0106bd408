"""Step metadata the planners read on the host, from the steps rather than from device tensors.

`StepBatch.query_start` lives on the cache's device; reading it back with `.tolist()` on a GPU
is a device-to-host copy that waits for every queued kernel, once per step, before the plan can
even be built. The same offsets follow from the steps' own counts in O(batch) Python.
"""

from __future__ import annotations

from itertools import accumulate

from vmkv.kv_cache import StepBatch


def host_query_starts(batch: StepBatch) -> list[int]:
    """query_start of the batch as Python ints (B + 1 of them), without touching the device."""
    return [0, *accumulate(s.num_new for s in batch.steps)]
