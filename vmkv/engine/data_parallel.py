"""`DataParallelLLM`: M engine processes behind one front end, with prefix-aware routing.

Each replica is an `AsyncProcessLLM` (its own engine process, model copy and KV cache), so
a replica's prefix cache only helps requests routed to it. The router sends a request to
the replica that already computed the longest part of its prompt (the same cache salt and
the same leading full blocks), unless that replica's load exceeds the least-loaded one's by
more than the prefill it would save (the matched tokens) plus one step's worth of tokens;
a request with nothing cached anywhere goes to the least-loaded replica. Once a busy
prefix has spread to several replicas, it goes to the least loaded of those. Load is what
this front end has in flight on a replica: prompt plus max_tokens x n of every unfinished
request it routed there.

The interface is AsyncProcessLLM's, so the server and the bench take either.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from itertools import zip_longest

import torch

from vmkv.engine.async_process import AsyncProcessLLM
from vmkv.engine.config import EngineConfig
from vmkv.engine.errors import RequestRejected
from vmkv.engine.llm_engine import EngineStats
from vmkv.engine.lora import LoRARequest
from vmkv.engine.outputs import RequestOutput
from vmkv.engine.prompt_embeds import embeds_cache_salt, prompt_rows
from vmkv.engine.sampling_params import SamplingParams
from vmkv.kv_cache import KVMemory, KVStats

MAX_ROUTED_BLOCKS = 64  # prompt blocks the router keys on: enough to tell long shared prefixes apart
MAX_REMEMBERED_PREFIXES = 1 << 16  # per replica, least recently routed forgotten first


@dataclass
class _Replica:
    llm: AsyncProcessLLM
    load: int = 0  # tokens in flight from this front end


ROUTINGS = ("prefix", "round-robin")


class PrefixRouter:
    """Longest routed prefix first, least load otherwise; pure bookkeeping, no engine calls.

    A prefix is keyed as a hash chain over full blocks of block_tokens ids, seeded with the
    cache salt, as the paged prefix cache keys its blocks: two prompts share key i only if
    their salts and first i+1 blocks are equal. The router remembers which keys it sent where;
    it cannot see evictions, so a remembered prefix is a likely hit, never a promise.
    """

    def __init__(self, num_replicas: int, block_tokens: int, max_imbalance_tokens: int) -> None:
        if num_replicas < 1 or block_tokens < 1 or max_imbalance_tokens < 0:
            raise ValueError("num_replicas and block_tokens must be >= 1, max_imbalance_tokens >= 0")
        self.block_tokens = block_tokens
        self.max_imbalance_tokens = max_imbalance_tokens
        self.prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def chain(self, prompt_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """The keys of the prompt's leading full blocks (at most MAX_ROUTED_BLOCKS)."""
        size = self.block_tokens
        keys, key = [], hash(("vmkv-prefix", cache_salt))
        for start in range(0, min(len(prompt_ids) // size, MAX_ROUTED_BLOCKS) * size, size):
            key = hash((key, tuple(prompt_ids[start : start + size])))
            keys.append(key)
        return keys

    def pick(self, chain: list[int], loads: list[int]) -> int:
        """The replica to send a request with these keys to, given each replica's load."""
        least = min(range(len(loads)), key=lambda r: (loads[r], r))
        best, matched = least, 0
        for r, remembered in enumerate(self.prefixes):
            m = 0
            while m < len(chain) and chain[m] in remembered:
                m += 1
            if m > matched or (m == matched and m > 0 and loads[r] < loads[best]):
                best, matched = r, m
        saved = matched * self.block_tokens  # prefill tokens the holder need not compute
        if matched == 0 or loads[best] - loads[least] > self.max_imbalance_tokens + saved:
            return least
        return best

    def forget(self) -> None:
        """Forget every routed prefix (the replicas' caches were emptied)."""
        for remembered in self.prefixes:
            remembered.clear()

    def record(self, replica: int, chain: list[int]) -> None:
        remembered = self.prefixes[replica]
        for key in chain:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > MAX_REMEMBERED_PREFIXES:
            remembered.popitem(last=False)


class DataParallelLLM:
    """`size` AsyncProcessLLM replicas of one config; see the module docstring. routing
    "round-robin" ignores prefixes and load (the baseline prefix routing is measured against)."""

    def __init__(self, config: EngineConfig, size: int, routing: str = "prefix") -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.routing = routing
        self._turn = 0
        if config.num_threads is None:  # the machine's cores shared out, not each replica taking all
            config = replace(config, num_threads=max(1, (os.cpu_count() or 1) // size))
        with ThreadPoolExecutor(size) as pool:  # each start loads a model: start them together
            starts = [pool.submit(AsyncProcessLLM, config) for _ in range(size)]
        replicas, errors = [], []
        for start in starts:
            try:
                replicas.append(start.result())
            except Exception as error:  # noqa: BLE001 - every started one is stopped, then it is raised
                errors.append(error)
        if errors:
            for llm in replicas:
                llm.shutdown()
            raise errors[0]
        self._replicas = [_Replica(llm) for llm in replicas]
        self.router = PrefixRouter(size, config.block_size, config.max_num_batched_tokens)
        self.tokenizer = replicas[0].tokenizer
        self.info = replicas[0].info
        self._where: dict[str, _Replica] = {}

    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def pids(self) -> list[int]:
        return [r.llm.pid for r in self._replicas]

    def validate(
        self, prompt: str | Sequence[int] | torch.Tensor, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        return self._replicas[0].llm.validate(prompt, params)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix in every replica, and where the router sent them."""
        return await self.control("reset_prefix_cache")  # type: ignore[return-value]

    async def control(self, name: str, *args: object) -> object:
        """The call in every replica at once; their answers combined: entries forgotten summed,
        awake only when all are, paused when any is, asleep what any replica gave back."""
        results = await asyncio.gather(*(replica.llm.control(name, *args) for replica in self._replicas))
        if name == "reset_prefix_cache":
            self.router.forget()
            return sum(results)
        if name == "wake_up":
            return all(results)
        if name == "state":
            asleep = sorted({tag for state in results for tag in state["asleep"]})
            return {"paused": any(state["paused"] for state in results), "asleep": asleep}
        return results[0]

    async def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncProcessLLM.generate, on the replica the router picks."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        _, prompt_ids = self.validate(prompt, params)
        self.info.check_priority(priority)
        if request_id in self._where:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if self.routing == "round-robin":
            index, self._turn = self._turn, (self._turn + 1) % self.size
        else:
            salt = cache_salt
            if isinstance(prompt, torch.Tensor):  # placeholders: the embeddings' digest tells prompts apart
                salt = embeds_cache_salt(prompt_rows(prompt), cache_salt)
            if lora_request is not None:  # the replica keys the adapter's prefixes apart too
                salt = f"{salt or ''}|lora:{lora_request.lora_name}"
            chain = self.router.chain(prompt_ids, salt)
            index = self.router.pick(chain, [r.load for r in self._replicas])
            self.router.record(index, chain)
        replica = self._replicas[index]
        cost = len(prompt_ids) + params.max_tokens * params.n
        replica.load += cost
        self._where[request_id] = replica
        try:
            generation = replica.llm.generate(prompt, params, request_id, cache_salt, priority, lora_request)
            async for output in generation:
                yield output
        finally:
            replica.load -= cost
            del self._where[request_id]

    def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            replica.llm.abort(request_id)

    def replica_stats(self) -> list[EngineStats]:
        return [r.llm.stats() for r in self._replicas]

    def stats(self) -> EngineStats:
        """Every replica's counts summed; kv_usage is the mean of the replicas' fractions."""
        return sum_stats(self.replica_stats())

    @property
    def dead_reason(self) -> str | None:
        """A replica that stopped stops the whole: the server answers 503 until restarted, rather
        than sending every request to the survivors' share of the capacity unannounced."""
        for r, replica in enumerate(self._replicas):
            if (reason := replica.llm.dead_reason) is not None:
                return f"replica {r}: {reason}"
        return None

    def shutdown(self) -> None:
        for replica in self._replicas:
            replica.llm.shutdown()


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """One EngineStats for several engines: counts and bytes summed, kv_usage averaged, the
    pause and sleep states the deepest any replica is in, the LoRA adapters any one runs or has
    waiting."""
    combine = {
        "paused": max,
        "sleep_level": max,
        "running_loras": _names,
        "waiting_loras": _names,
        "spec_accepted_per_position": _per_position,
    }
    summed = {
        f.name: combine.get(f.name, sum)(getattr(s, f.name) for s in stats)
        for f in fields(EngineStats)
        if f.name not in ("kv_usage", "memory", "kv_stats")
    }
    memory = KVMemory(**{f.name: sum(getattr(s.memory, f.name) for s in stats) for f in fields(KVMemory)})
    kv = {}
    for f in fields(KVStats):
        values = [getattr(s.kv_stats, f.name) for s in stats]
        kv[f.name] = values[0] if f.name == "unit" or values[0] is None else sum(values)
    return EngineStats(
        **summed,
        kv_usage=sum(s.kv_usage for s in stats) / len(stats),
        memory=memory,
        kv_stats=KVStats(**kv),
    )


def _per_position(per_engine: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(map(sum, zip_longest(*per_engine, fillvalue=0)))


def _names(per_engine: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for names in per_engine for name in names))
