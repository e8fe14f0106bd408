"""vattention under tensor parallelism, in one process: a prompt cached whole is copied on write
(its last page saved, unmapped, remapped and written back) on rank 0 and, from the log alone,
on a replica, whose slot must then hold rank 0's bytes. The random lifecycles in
test_tensor_parallel.py may not draw this case, so it is driven here directly."""

from __future__ import annotations

import pytest
import torch
from test_kv_contract import MAX_LEN, PAGE, Q_HEADS, SCALE, SHAPE

from vmkv.dense.plan import DenseSlotPlan
from vmkv.distributed.messages import KVOp, PagesFromHost, PagesToHost, StepMessage
from vmkv.distributed.recording_vattention import RecordingVAttentionKVCache
from vmkv.distributed.replica import VATTENTION_FOLLOWER, Replica
from vmkv.kv_cache import SeqStep, StepBatch
from vmkv.vattention import VAttentionKVCache

OPTIONS = {"page_size": PAGE, "order": "packed", "prefix_caching": True, "model_id": "m"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def step(
    rank_0: RecordingVAttentionKVCache, replica: Replica, seq_id: int, cached: int, new: int
) -> list[KVOp]:
    """One step of `new` tokens on both ranks with the same random K/V; returns the ops it carried."""
    batch = StepBatch.build([SeqStep(seq_id, cached, new)])
    plan: DenseSlotPlan = rank_0.prepare(batch)
    ops, steps, layout = rank_0.log.take()
    replica.apply(ops)
    replica_plan = replica.plan(StepMessage(ops, steps, layout, [], []))
    gen = torch.Generator().manual_seed(seq_id)
    for layer in range(SHAPE.num_layers):
        k, v = torch.randn(2, new, SHAPE.num_kv_heads, SHAPE.head_dim, generator=gen)
        q = torch.randn(new, Q_HEADS, SHAPE.head_dim, generator=gen)
        mine = rank_0.attend(layer, q, k, v, plan, SCALE)
        theirs = replica.cache.attend(layer, q, k, v, replica_plan, SCALE)
        assert torch.equal(theirs, mine)
    rank_0.finish_step(plan)
    return ops


def test_a_whole_prompt_hit_is_copied_on_write_on_every_rank() -> None:
    budget = 28 * PAGE
    rank_0 = RecordingVAttentionKVCache(SHAPE, MAX_LEN, budget, **OPTIONS)
    replica = Replica(VAttentionKVCache(SHAPE, MAX_LEN, budget, **OPTIONS, **VATTENTION_FOLLOWER))
    try:
        prompt = list(range(1, 4 * rank_0.geometry.tokens_backed(1) + 1))  # whole pages
        rank_0.admit(1, prompt)
        step(rank_0, replica, 1, 0, len(prompt))
        rank_0.free(1)
        cached = rank_0.admit(2, prompt)  # all but the last token, which is recomputed in place
        ops = step(rank_0, replica, 2, cached, len(prompt) - cached)
        assert cached == len(prompt) - 1 and rank_0.stats().cow_copies > 0
        kinds = {type(op) for op in ops}
        assert PagesToHost in kinds and PagesFromHost in kinds
        slot = rank_0.seqs[2].slot
        for mine, theirs in zip(rank_0.mapping.tensors(), replica.cache.mapping.tensors(), strict=True):
            assert torch.equal(theirs[slot, : len(prompt)], mine[slot, : len(prompt)])
        assert not replica.hosts, "the saved page is dropped on every rank once written back"
    finally:
        rank_0.close()
        replica.cache.close()
