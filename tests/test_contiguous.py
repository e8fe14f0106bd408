"""The contiguous baseline: max_len reserved per sequence, fork and swap by copying.

Its attention is checked against the reference in test_vattention_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from vmkv.contiguous import ContiguousKVCache
from vmkv.kv_cache import KVShape, OutOfKVMemory, SeqStep, SequenceTooLong, StepBatch

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
MAX_LEN = 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cache(slots: int = 3) -> ContiguousKVCache:
    return ContiguousKVCache(SHAPE, MAX_LEN, slots * MAX_LEN * SHAPE.bytes_per_token + 7)


def write(cache: ContiguousKVCache, steps: list[SeqStep], fill: dict[int, float]) -> None:
    batch = StepBatch.build(steps)
    plan = cache.prepare(batch)
    k = torch.cat([torch.full((s.num_new, 2, 8), fill[s.seq_id]) for s in steps])
    for layer in range(SHAPE.num_layers):
        cache.attend(layer, torch.zeros(batch.num_tokens, 4, 8), k, -k, plan, 1.0)
    cache.finish_step(plan)


def kv_of(cache: ContiguousKVCache, seq_id: int, length: int) -> torch.Tensor:
    return cache.kv[:, :, cache.seqs[seq_id].slot, :, :length].clone()  # [layers, 2, Hkv, length, D]


def test_every_sequence_reserves_max_len_up_front() -> None:
    cache = make_cache(slots=3)
    assert cache.num_slots == 3 and cache.free_capacity() == 3 * MAX_LEN
    cache.admit(1, [0] * 5)
    cache.grow(1, [0] * 5)
    mem = cache.memory()
    assert mem.reserved_bytes == 3 * MAX_LEN * SHAPE.bytes_per_token
    assert mem.allocated_bytes == MAX_LEN * SHAPE.bytes_per_token
    assert mem.used_bytes == 10 * SHAPE.bytes_per_token
    assert mem.fragmentation_bytes == 40 * SHAPE.bytes_per_token
    assert cache.usage() == pytest.approx(1 / 3)
    assert cache.free_capacity() == 2 * MAX_LEN + 40
    cache.free(1)
    assert cache.usage() == 0.0 and cache.memory().allocated_bytes == 0


def test_out_of_slots_raises_and_cache_stays_usable() -> None:
    cache = make_cache(slots=2)
    cache.admit(1, [0] * 3)
    cache.admit(2, [0] * 3)
    write(cache, [SeqStep(1, 0, 3), SeqStep(2, 0, 3)], {1: 1.0, 2: 2.0})
    assert not cache.can_admit(1)
    with pytest.raises(OutOfKVMemory) as err:
        cache.admit(3, [0])
    assert err.value.unit == "slots" and 3 not in cache.seqs
    with pytest.raises(OutOfKVMemory):
        cache.fork(1, 3)
    cache.free(1)
    cache.admit(3, [0] * 4)
    assert kv_of(cache, 2, 3)[:, 0].eq(2.0).all() and kv_of(cache, 2, 3)[:, 1].eq(-2.0).all()


def test_fork_copies_the_parent_and_diverges() -> None:
    cache = make_cache()
    cache.admit(1, [0] * 6)
    write(cache, [SeqStep(1, 0, 6)], {1: 3.0})
    cache.fork(1, 2)
    assert torch.equal(kv_of(cache, 1, 6), kv_of(cache, 2, 6))
    cache.grow(1, [0])
    cache.grow(2, [0])
    write(cache, [SeqStep(1, 6, 1), SeqStep(2, 6, 1)], {1: 4.0, 2: 5.0})
    assert kv_of(cache, 1, 7)[0, 0, :, 6].eq(4.0).all() and kv_of(cache, 2, 7)[0, 0, :, 6].eq(5.0).all()
    assert cache.stats().fork_copies == 1


def test_swap_round_trip_restores_kv_in_another_slot() -> None:
    cache = make_cache(slots=2)
    cache.admit(1, [0] * 9)
    write(cache, [SeqStep(1, 0, 9)], {1: 6.0})
    before = kv_of(cache, 1, 9)
    cache.swap_out([1])
    assert cache.usage() == 0.0
    with pytest.raises(ValueError, match="swapped out"):
        cache.prepare(StepBatch.build([SeqStep(1, 9, 1)]))
    cache.admit(2, [0])
    cache.admit(3, [0])
    with pytest.raises(OutOfKVMemory):
        cache.swap_in([1])
    cache.free(2)
    cache.swap_in([1])
    assert torch.equal(kv_of(cache, 1, 9), before)
    with pytest.raises(ValueError, match="not swapped out"):
        cache.swap_in([1])


def test_wrong_calls_raise_precise_errors() -> None:
    with pytest.raises(ValueError, match="holds no sequence"):
        ContiguousKVCache(SHAPE, MAX_LEN, 10)
    cache = make_cache()
    with pytest.raises(ValueError, match="empty"):
        cache.admit(1, [])
    with pytest.raises(SequenceTooLong):
        cache.admit(1, [0] * (MAX_LEN + 1))
    cache.admit(1, [0] * 4)
    with pytest.raises(ValueError, match="already"):
        cache.admit(1, [0])
    with pytest.raises(SequenceTooLong):
        cache.grow(1, [0] * MAX_LEN)
    with pytest.raises(KeyError):
        cache.free(7)
    with pytest.raises(ValueError, match="room for 4"):
        cache.prepare(StepBatch.build([SeqStep(1, 4, 1)]))
    plan = cache.prepare(StepBatch.build([SeqStep(1, 0, 4)]))
    with pytest.raises(ValueError, match="k and v"):
        cache.attend(0, torch.zeros(4, 4, 8), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), plan, 1.0)
