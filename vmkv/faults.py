"""Fault injection and the engine's self-check, for tests and the soak run: off unless asked for.

`VMKV_FAULTS` (read once, at import, so an engine process inherits it) or `install()` turns on:

- `map_enomem_every=N`: every Nth memory-driver map call fails with ENOMEM, as if the OS or the
  device were out of memory (the vattention layout turns that into OutOfKVMemory: preemption);
- `map_delay_ms=F`: every map call sleeps first, a slow mapper;
- `forward_fail_every=N`: every Nth model forward raises after the cache prepared the step;
- `sample_poison_token=T`: sampling raises for any row whose prompt holds token id T (one
  request's sampler failing, reproducibly, however the batch is cut);
- `check_invariants=1`: after every engine step, `check_engine` verifies the allocator's books.

For example `VMKV_FAULTS=map_enomem_every=7,forward_fail_every=40,check_invariants=1`.
Components take `active()` once when built and keep None when nothing is injected, so the
production paths pay one `is not None` test per call.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from vmkv.drivers.errors import RawCallError

if TYPE_CHECKING:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.sampler import SampleRow

ENV = "VMKV_FAULTS"
_PARSERS = {"int": int, "float": float, "bool": lambda value: value not in ("0", "false", "")}


class InjectedFault(RuntimeError):
    """An error raised on purpose by fault injection; its message says which fault."""


@dataclass
class Faults:
    """Which faults to inject; counters are shared by every component of one process."""

    map_enomem_every: int = 0
    map_delay_ms: float = 0.0
    forward_fail_every: int = 0
    sample_poison_token: int = -1
    check_invariants: bool = False
    injected: dict[str, int] = field(default_factory=dict)  # fault name -> times injected
    _calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """`name=value,name=value`; an unknown name or a bad value raises ValueError."""
        types = {f.name: f.type for f in fields(cls) if f.type in _PARSERS}
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in types:
                raise ValueError(f"{ENV}: unknown fault {name!r}; known: {', '.join(types)}")
            values[name] = _PARSERS[types[name]](value)
        return cls(**values)

    def _every(self, name: str, period: int) -> bool:
        """Whether this call is the period-th of `name` since the last injection."""
        if period <= 0:
            return False
        with self._lock:
            self._calls[name] = self._calls.get(name, 0) + 1
            hit = self._calls[name] % period == 0
            if hit:
                self.injected[name] = self.injected.get(name, 0) + 1
            return hit

    def on_map(self) -> None:
        """Called by a driver before each raw map call."""
        if self.map_delay_ms:
            time.sleep(self.map_delay_ms / 1e3)
        if self._every("map_enomem", self.map_enomem_every):
            raise RawCallError(errno.ENOMEM, "map failed: out of memory (injected fault)")

    def on_forward(self) -> None:
        """Called by the model runner once the cache has prepared a step."""
        if self._every("forward", self.forward_fail_every):
            raise InjectedFault("the model forward failed (injected fault)")

    def on_sample(self, rows: Sequence[SampleRow]) -> None:
        """Called by the sampler before it samples `rows`."""
        token = self.sample_poison_token
        if token >= 0 and any(token in row.token_ids[: row.prompt_len] for row in rows):
            with self._lock:
                self.injected["sample"] = self.injected.get("sample", 0) + 1
            raise InjectedFault(f"the sampler failed on a prompt holding token {token} (injected fault)")


_active: Faults | None = Faults.parse(os.environ[ENV]) if os.environ.get(ENV) else None


def active() -> Faults | None:
    """The faults to inject in this process, None (the default) when none."""
    return _active


@contextmanager
def install(faults: Faults) -> Iterator[Faults]:
    """Inject `faults` into components built inside the block (in this process)."""
    global _active
    before, _active = _active, faults
    try:
        yield faults
    finally:
        _active = before


class InvariantError(AssertionError):
    """The engine's books disagree with its KV cache's: something leaked or was freed twice."""


def check_engine(engine: LLMEngine) -> None:
    """Cheap checks, run after a step: every sequence the cache holds belongs to a live request
    and every live sequence with KV is held; no request sits in two queues; the cache's counts
    are in range, and with nothing held it holds no bytes and offers its whole capacity."""
    scheduler, cache = engine.scheduler, engine.cache
    queues = [list(scheduler.running), list(scheduler.waiting), list(scheduler.swapped)]
    queued = [g.request_id for q in queues for g in q]
    _require(len(queued) == len(set(queued)), f"a request is in two scheduler queues: {sorted(queued)}")
    _require(set(queued) <= set(engine._groups), "a queued request is not live in the engine")
    held = set(cache.seqs)
    allocated = {s.seq_id for q in queues for g in q for s in g.seqs if s.num_allocated}
    _require(held <= allocated, f"the cache holds sequences no live request owns: {sorted(held - allocated)}")
    running = {s.seq_id for g in scheduler.running for s in g.live_seqs if s.num_allocated}
    _require(running <= held, f"running sequences with KV the cache does not hold: {sorted(running - held)}")
    stats, memory = cache.stats(), cache.memory()
    _require(0 <= stats.units_in_use <= stats.units_total, f"units in use out of range: {stats}")
    _require(0 <= memory.used_bytes <= memory.allocated_bytes, f"KV bytes out of range: {memory}")
    if not held:
        _require(memory.used_bytes == 0, f"no sequence held but {memory.used_bytes} bytes used")
        free = cache.free_capacity()
        _require(
            free == engine.info.capacity_tokens,
            f"nothing held but {free} of {engine.info.capacity_tokens} tokens free",
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)
