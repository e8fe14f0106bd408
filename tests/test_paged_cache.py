"""Block accounting of the paged layout: allocation, fork and copy-on-write, memory signals,
swap, and precise errors for wrong use."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import Runner, make_cache
from vmkv.paging import PagedKVCache

from vmkv.kv_cache import KVShape, OutOfKVMemory, SeqStep, SequenceTooLong, StepBatch


def refcounts(cache: PagedKVCache, seq_id: int) -> list[int]:
    return [cache.pool.blocks[b].ref_count for b in cache.seqs[seq_id].block_table]


def test_prefill_takes_ceil_blocks_and_decode_one_block_when_the_last_is_full() -> None:
    cache = make_cache(block_size=4)
    cache.admit(0, list(range(9)))
    assert len(cache.seqs[0].block_table) == 3
    counts = []
    for _ in range(8):
        cache.grow(0, [1])
        counts.append(len(cache.seqs[0].block_table))
    assert counts == [3, 3, 3, 4, 4, 4, 4, 5]  # 10, 11, 12 tokens fit in 3 blocks; 13 needs a 4th
    assert cache.stats().blocks_allocated == 5
    cache.grow(0, [1, 2, 3, 4, 5, 6])  # several tokens at once (a chunk): 23 tokens -> 6 blocks
    assert len(cache.seqs[0].block_table) == 6


def test_sequences_growing_in_turn_keep_their_blocks_in_runs() -> None:
    shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    cache = PagedKVCache(shape, 256, 64 * 4 * shape.bytes_per_token, block_size=4)
    for seq_id in range(3):
        cache.admit(seq_id, list(range(6)))  # two blocks each, admitted one after the other
    for _ in range(24):  # six more blocks each, taken in turn
        for seq_id in range(3):
            cache.grow(seq_id, [1])
    tables = [cache.seqs[i].block_table for i in range(3)]
    for table in tables:
        assert table == list(range(table[0], table[0] + len(table)))
    # the first starts the pool; each later one the middle of the longest free run
    assert [t[0] for t in tables] == [0, 33, 17]


def test_a_sequence_whose_next_block_is_taken_continues_in_the_longest_free_run() -> None:
    shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    cache = PagedKVCache(shape, 256, 16 * 4 * shape.bytes_per_token, block_size=4)
    cache.admit(0, list(range(8)))  # blocks 0, 1
    cache.admit(1, list(range(4)))  # the middle of the free run 2..15: block 9
    cache.admit(2, list(range(4)))  # the middle of 2..8, the longest run left: block 5
    assert [cache.seqs[i].block_table for i in (1, 2)] == [[9], [5]]
    for _ in range(4 * 4):
        cache.grow(0, [1])  # blocks 2, 3, 4; then 5 is taken
    # it continues in the middle of 10..15 (longer than 6..8)
    assert cache.seqs[0].block_table == [0, 1, 2, 3, 4, 13]


def test_scattered_pool_hands_out_blocks_out_of_order() -> None:
    cache = make_cache(block_size=4, num_blocks=64)  # scattered, as the attention tests want
    cache.admit(0, list(range(40)))
    table = cache.seqs[0].block_table
    assert sorted(table) != table and len(set(table)) == 10


def test_fork_shares_every_block_and_copy_on_write_copies_only_the_written_one() -> None:
    cache = make_cache(block_size=4)
    runner = Runner(cache, num_q_heads=4)
    cache.admit(0, list(range(10)))  # blocks: full, full, 2 of 4
    runner.max_error([SeqStep(0, 0, 10)])
    in_use = cache.stats().units_in_use
    runner.fork(0, 1)
    assert cache.seqs[1].block_table == cache.seqs[0].block_table
    assert refcounts(cache, 0) == [2, 2, 2]
    assert cache.stats().units_in_use == in_use  # nothing new

    cache.grow(1, [5])  # the child writes into the shared, partly filled last block: copied
    child, parent = cache.seqs[1].block_table, cache.seqs[0].block_table
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert refcounts(cache, 0) == [2, 2, 1] and refcounts(cache, 1) == [2, 2, 1]
    assert cache.stats().cow_copies == 1
    runner.assert_stored(1)  # the copy carries the shared tokens

    cache.grow(0, [6])  # the parent's last block is its own again: no copy
    assert cache.stats().cow_copies == 1
    assert runner.max_error([SeqStep(0, 10, 1), SeqStep(1, 10, 1)]) < 2e-5
    runner.assert_stored(0)  # neither write touched the other sequence
    runner.assert_stored(1)

    cache.free(0)
    assert refcounts(cache, 1) == [1, 1, 1]
    cache.free(1)
    assert cache.pool.num_free == cache.pool.num_blocks


def test_fork_of_a_full_last_block_needs_no_copy() -> None:
    cache = make_cache(block_size=4)
    runner = Runner(cache, num_q_heads=2)
    cache.admit(0, list(range(8)))
    runner.max_error([SeqStep(0, 0, 8)])
    runner.fork(0, 1)
    runner.fork(0, 2)
    for seq_id in range(3):
        cache.grow(seq_id, [seq_id])
    assert cache.stats().cow_copies == 0
    assert refcounts(cache, 0) == [3, 3, 1]
    assert runner.max_error([SeqStep(i, 8, 1) for i in range(3)]) < 2e-5
    for seq_id in range(3):
        runner.assert_stored(seq_id)


def test_a_step_may_not_write_a_shared_block() -> None:
    cache = make_cache(block_size=4)
    runner = Runner(cache, num_q_heads=2)
    cache.admit(0, list(range(6)))
    runner.max_error([SeqStep(0, 0, 6)])
    cache.fork(0, 1)
    with pytest.raises(ValueError, match="shared"):
        cache.prepare(StepBatch.build([SeqStep(0, 4, 2)]))  # rewriting tokens 4, 5 of the shared block
    with pytest.raises(ValueError, match="grow first"):
        cache.prepare(StepBatch.build([SeqStep(0, 6, 1)]))


def test_out_of_memory_is_raised_before_any_change_and_the_cache_stays_usable() -> None:
    cache = make_cache(block_size=4, num_blocks=6)
    cache.admit(0, list(range(16)))  # 4 blocks
    before = (cache.pool.num_free, cache.stats(), list(cache.seqs[0].block_table))
    with pytest.raises(OutOfKVMemory) as e:
        cache.admit(1, list(range(100, 112)))  # 3 blocks, 2 free
    assert (e.value.needed, e.value.free, e.value.unit) == (3, 2, "blocks")
    assert 1 not in cache.seqs
    with pytest.raises(OutOfKVMemory):
        cache.grow(0, list(range(9)))  # 25 tokens need 7 blocks
    assert (cache.pool.num_free, cache.stats(), cache.seqs[0].block_table) == before
    assert cache.seqs[0].num_tokens == 16
    assert not cache.can_admit(12) and cache.can_admit(8)
    cache.free(0)
    cache.admit(1, list(range(100, 112)))
    assert cache.can_admit(12)


def test_copy_on_write_needs_a_free_block_too() -> None:
    cache = make_cache(block_size=4, num_blocks=2)
    cache.admit(0, list(range(6)))
    cache.fork(0, 1)
    with pytest.raises(OutOfKVMemory):
        cache.grow(1, [1])  # the shared last block must be copied, and no block is free
    assert refcounts(cache, 1) == [2, 2]


def test_lengths_past_max_len_are_refused() -> None:
    cache = make_cache(max_len=20)
    with pytest.raises(SequenceTooLong):
        cache.admit(0, list(range(21)))
    cache.admit(0, list(range(20)))
    with pytest.raises(SequenceTooLong):
        cache.grow(0, [1])
    assert not cache.can_admit(21)


def test_wrong_use_raises_precise_errors() -> None:
    cache = make_cache()
    cache.admit(0, [1, 2, 3])
    with pytest.raises(ValueError, match="already admitted"):
        cache.admit(0, [1])
    with pytest.raises(ValueError, match="at least one token"):
        cache.admit(1, [])
    with pytest.raises(ValueError, match="at least one token"):
        cache.grow(0, [])
    with pytest.raises(KeyError):
        cache.grow(7, [1])
    with pytest.raises(KeyError):
        cache.free(7)
    with pytest.raises(ValueError, match="already exists"):
        cache.fork(0, 0)
    with pytest.raises(ValueError, match="not swapped out"):
        cache.swap_in([0])
    with pytest.raises(ValueError, match="twice"):
        cache.swap_out([0, 0])
    with pytest.raises(ValueError, match="twice"):
        cache.prepare(StepBatch.build([SeqStep(0, 0, 3), SeqStep(0, 0, 3)]))
    plan = cache.prepare(StepBatch.build([SeqStep(0, 0, 3)]))
    q, kv = torch.zeros(3, 2, 16), torch.zeros(3, 2, 16)
    with pytest.raises(IndexError):
        cache.attend(-1, q, kv, kv, plan, 1.0)
    with pytest.raises(ValueError, match="holds"):
        cache.attend(0, q.double(), kv, kv, plan, 1.0)
    shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="less than one block"):
        PagedKVCache(shape, 16, 100)
    with pytest.raises(ValueError, match="attention must be one of"):
        PagedKVCache(shape, 16, 1 << 20, attention="fast")
    with pytest.raises(ValueError, match="flash"):
        PagedKVCache(shape, 16, 1 << 20, attention="flash")


def test_memory_counts_shared_blocks_once_and_fragmentation_is_under_a_block_per_sequence() -> None:
    cache = make_cache(block_size=4, num_blocks=40)
    per_token = cache.shape.bytes_per_token
    assert cache.memory().allocated_bytes == 0 and cache.usage() == 0.0
    cache.admit(0, list(range(10)))
    cache.admit(1, list(range(20, 25)))
    m = cache.memory()
    assert m.reserved_bytes == 40 * 4 * per_token
    assert m.allocated_bytes == 5 * 4 * per_token
    assert m.used_bytes == 15 * per_token
    assert m.fragmentation_bytes == 5 * per_token < 2 * 4 * per_token
    cache.fork(0, 2)  # shares all three blocks: nothing more allocated or used
    assert cache.memory() == m
    assert cache.usage() == pytest.approx(5 / 40)
    assert cache.free_capacity() == 35 * 4


def test_swap_round_trip_restores_the_data_and_keeps_a_group_shared() -> None:
    cache = make_cache(block_size=4, num_blocks=12)
    runner = Runner(cache, num_q_heads=4)
    cache.admit(0, list(range(10)))
    runner.max_error([SeqStep(0, 0, 10)])
    runner.fork(0, 1)
    cache.grow(0, [1])
    cache.grow(1, [2])
    runner.max_error([SeqStep(0, 10, 1), SeqStep(1, 10, 1)])
    cache.admit(2, list(range(50, 55)))
    in_use = cache.stats().units_in_use

    cache.swap_out([0, 1])  # 2 shared blocks + 2 private last blocks travel once each
    c = cache.stats()
    assert c.units_in_use == in_use - 4
    assert c.swap_out_bytes == 4 * cache.block_bytes and c.swap_out_seconds > 0
    with pytest.raises(ValueError, match="swapped out"):
        cache.grow(0, [1])
    with pytest.raises(ValueError, match="swapped out"):
        cache.prepare(StepBatch.build([SeqStep(0, 11, 1)]))

    cache.swap_in([0, 1])
    assert cache.stats().units_in_use == in_use
    assert cache.stats().swap_in_bytes == 4 * cache.block_bytes
    assert refcounts(cache, 0) == [2, 2, 1] and refcounts(cache, 1) == [2, 2, 1]
    runner.assert_stored(0)
    runner.assert_stored(1)
    for seq_id in (0, 1):
        cache.grow(seq_id, [3])
    assert runner.max_error([SeqStep(0, 11, 1), SeqStep(1, 11, 1)]) < 2e-5


def test_swap_in_without_room_raises_and_changes_nothing() -> None:
    cache = make_cache(block_size=4, num_blocks=4)
    cache.admit(0, list(range(12)))
    cache.swap_out([0])
    cache.admit(1, list(range(100, 108)))  # 2 of 4 blocks; 0 needs 3 back
    with pytest.raises(OutOfKVMemory):
        cache.swap_in([0])
    assert cache.pool.num_free == 2 and cache.seqs[0].swapped is not None
    cache.free(1)
    cache.swap_in([0])
    assert len(cache.seqs[0].block_table) == 3


def test_members_of_a_group_swapped_in_separately_get_private_copies() -> None:
    cache = make_cache(block_size=4)
    runner = Runner(cache, num_q_heads=2)
    cache.admit(0, list(range(8)))
    runner.max_error([SeqStep(0, 0, 8)])
    runner.fork(0, 1)
    cache.swap_out([0, 1])
    cache.swap_in([1])
    cache.swap_in([0])
    assert refcounts(cache, 0) == [1, 1] and refcounts(cache, 1) == [1, 1]
    runner.assert_stored(0)
    runner.assert_stored(1)
    cache.free(0)
    cache.free(1)
    assert cache.pool.num_free == cache.pool.num_blocks


def test_freeing_a_swapped_out_sequence_drops_its_host_copy() -> None:
    cache = make_cache(block_size=4)
    cache.admit(0, list(range(8)))
    cache.swap_out([0])
    cache.free(0)
    assert not cache.seqs and cache.pool.num_free == cache.pool.num_blocks


def test_close_releases_the_pool() -> None:
    cache = make_cache()
    cache.admit(0, [1, 2])
    cache.close()
    assert cache.kv.numel() == 0 and not cache.seqs
