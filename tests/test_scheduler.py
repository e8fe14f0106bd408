"""Scheduler policy over a token-counting KV cache: FCFS, budgets, chunking, preemption, forks."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import pytest

from vmkv.engine.config import EngineConfig
from vmkv.engine.outputs import RequestMetrics
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import ALONE_RETRIES, Scheduler, SchedulerOutput
from vmkv.engine.sequence import FinishReason, RequestStatus, Sequence, SequenceGroup
from vmkv.kv_cache import KVCache, KVMemory, KVShape, KVStats, OutOfKVMemory, StepBatch, UpcomingPrompt


class TokenCache(KVCache):
    """Holds up to `capacity` tokens in total; records every lifecycle call."""

    kv_mode = "tokens"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lengths: dict[int, int] = {}
        self.swapped: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []
        self.upcoming: list[int] = []  # prompt lengths of the last expect()

    def _need(self, tokens: int) -> None:
        if tokens > self.free_capacity():
            raise OutOfKVMemory(tokens, self.free_capacity(), "tokens")

    def can_admit(self, num_tokens: int) -> bool:
        return num_tokens <= self.free_capacity()

    def admit(self, seq_id: int, token_ids: SequenceABC[int], cache_salt: str | None = None) -> int:
        assert seq_id not in self.lengths
        self._need(len(token_ids))
        self.lengths[seq_id] = len(token_ids)
        self.events.append(("admit", seq_id))
        return 0

    def grow(self, seq_id: int, token_ids: SequenceABC[int]) -> None:
        self._need(len(token_ids))
        self.lengths[seq_id] += len(token_ids)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.lengths[seq_id]
        self.lengths[seq_id] = num_tokens
        self.events.append(("truncate", seq_id))

    def fork(self, parent_id: int, child_id: int) -> None:
        self._need(self.lengths[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        self.events.append(("fork", child_id))

    def free(self, seq_id: int) -> None:
        self.lengths.pop(seq_id, None) or self.swapped.pop(seq_id)
        self.events.append(("free", seq_id))

    def free_capacity(self) -> int:
        return self.capacity - sum(self.lengths.values())

    def usage(self) -> float:
        return 1 - self.free_capacity() / self.capacity

    def memory(self) -> KVMemory:
        used = sum(self.lengths.values())
        return KVMemory(self.capacity, used, used)

    def stats(self) -> KVStats:
        used = sum(self.lengths.values())
        return KVStats(unit="token", units_total=self.capacity, units_in_use=used, units_peak=used)

    def swap_out(self, seq_ids: SequenceABC[int]) -> None:
        for i in seq_ids:
            self.swapped[i] = self.lengths.pop(i)
            self.events.append(("swap_out", i))

    def swap_in(self, seq_ids: SequenceABC[int]) -> None:
        self._need(sum(self.swapped[i] for i in seq_ids))
        for i in seq_ids:
            self.lengths[i] = self.swapped.pop(i)
            self.events.append(("swap_in", i))

    def expect(self, prompts: SequenceABC[UpcomingPrompt]) -> None:
        self.upcoming = [len(p.token_ids) for p in prompts]

    def prepare(self, batch: StepBatch) -> object:
        raise AssertionError("scheduler tests never run a step")

    def attend(self, layer, q, k, v, plan, scale):  # noqa: ANN001, ANN201
        raise AssertionError("scheduler tests never run a step")

    def finish_step(self, plan: object) -> None:
        raise AssertionError("scheduler tests never run a step")


SHAPE = KVShape(1, 1, 1, None)  # unused by TokenCache


def make_group(
    arrival: int, prompt_len: int, max_tokens: int = 4, n: int = 1, priority: int = 0
) -> SequenceGroup:
    prompt = list(range(1, prompt_len + 1))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    group = SequenceGroup(
        str(arrival), arrival, None, prompt, params, [], RequestMetrics(0.0), priority=priority
    )
    group.seqs.append(Sequence(arrival * 10, 0, list(prompt), prompt_len, detokenizer=None, generator=None))
    return group


def make_scheduler(capacity: int, **config: object) -> tuple[Scheduler, TokenCache]:
    cache = TokenCache(capacity)
    defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    return Scheduler(EngineConfig(**(defaults | config)), cache), cache


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """What the engine does around the model: advance the KV, append a token to sampling rows."""
    out = scheduler.schedule()
    sampling = [item.seq for item in out.scheduled if item.samples]
    groups = {id(g): g for g in scheduler.running for s in g.seqs if any(s is i.seq for i in out.scheduled)}
    for item in out.scheduled:
        item.seq.num_computed += item.num_new
    for seq in sampling:
        seq.token_ids.append(1000 + seq.num_output)
        group = next(g for g in groups.values() if seq in g.seqs)
        if seq.num_output >= group.params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
    for group in groups.values():
        scheduler.release_finished(group)
    return out


def scheduled_ids(out: SchedulerOutput) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new for item in out.scheduled}


def test_fcfs_admission_respects_max_num_seqs() -> None:
    scheduler, _ = make_scheduler(1000, max_num_seqs=2)
    groups = [make_group(i, 5, max_tokens=2) for i in range(3)]
    for g in groups:
        scheduler.add(g)
    out = run_step(scheduler)
    assert scheduled_ids(out) == {0: 5, 10: 5}
    assert groups[2].status is RequestStatus.WAITING
    run_step(scheduler)  # both sample their second token and finish
    assert groups[0].finished and groups[1].finished
    out = run_step(scheduler)
    assert scheduled_ids(out) == {20: 5}


def test_decodes_go_first_and_long_prompts_are_chunked() -> None:
    scheduler, _ = make_scheduler(1000, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_group(0, 4, max_tokens=10)
    scheduler.add(short)
    run_step(scheduler)
    long = make_group(1, 20, max_tokens=2)
    scheduler.add(long)
    chunks = []
    while long.seqs[0].num_output == 0:
        out = run_step(scheduler)
        assert out.scheduled[0].seq is short.seqs[0] and out.scheduled[0].num_new == 1  # decode first
        chunks.append(scheduled_ids(out)[10])
        assert out.num_tokens <= 8
    assert chunks == [7, 7, 6]


def test_recompute_preempts_the_newest_and_resumes_it_before_new_work() -> None:
    scheduler, cache = make_scheduler(26, preemption_mode="recompute")
    old, new = make_group(0, 10, max_tokens=8), make_group(1, 10, max_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    latecomer = make_group(2, 3, max_tokens=2)
    scheduler.add(latecomer)
    preempted = 0
    for _ in range(4):
        preempted += run_step(scheduler).num_preempted
    assert preempted >= 1
    assert new.status is RequestStatus.PREEMPTED and new.metrics.num_preemptions >= 1
    assert 10 not in cache.lengths  # its KV was freed
    assert list(scheduler.waiting) == [new, latecomer]
    generated = new.seqs[0].num_output
    while not old.finished:
        run_step(scheduler)
    out = run_step(scheduler)
    # the preempted group comes back first, recomputing its prompt and generated tokens
    assert new.status is RequestStatus.RUNNING
    assert scheduled_ids(out)[10] == 10 + generated
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert all(len(g.seqs[0].token_ids) == g.seqs[0].prompt_len + g.params.max_tokens for g in (old, new))


def test_priority_policy_admits_the_lowest_priority_first_and_preempts_the_highest() -> None:
    scheduler, _ = make_scheduler(26, max_num_seqs=2, scheduling_policy="priority")
    background = make_group(0, 10, max_tokens=8, priority=5)
    urgent = make_group(1, 10, max_tokens=8, priority=-1)
    normal = make_group(2, 3, max_tokens=2, priority=0)
    for group in (background, normal, urgent):
        scheduler.add(group)
    assert scheduler.waiting == [urgent, normal, background]
    assert set(scheduled_ids(run_step(scheduler))) == {10, 20}  # urgent and normal; background waits
    while not normal.finished:
        run_step(scheduler)
    preempted = 0
    for _ in range(6):  # background comes in, then both grow past the 26 tokens there are
        preempted += run_step(scheduler).num_preempted
    # under fcfs the newest (urgent) would go; here the highest priority value does
    assert preempted >= 1 and background.metrics.num_preemptions >= 1
    assert urgent.metrics.num_preemptions == 0
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert urgent.finished and background.finished


def test_swap_preemption_moves_kv_out_and_back_in_order() -> None:
    scheduler, cache = make_scheduler(26, preemption_mode="swap")
    old, new = make_group(0, 10, max_tokens=8), make_group(1, 10, max_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    latecomer = make_group(2, 3, max_tokens=2)
    for _ in range(5):
        run_step(scheduler)
        if new.status is RequestStatus.SWAPPED:
            break
    assert new.status is RequestStatus.SWAPPED and ("swap_out", 10) in cache.events
    scheduler.add(latecomer)
    computed = new.seqs[0].num_computed
    while not new.finished:
        run_step(scheduler)
        assert latecomer.status is RequestStatus.WAITING or ("swap_in", 10) in cache.events
    assert new.seqs[0].num_computed >= computed  # nothing was recomputed
    assert cache.events.index(("swap_in", 10)) < cache.events.index(("admit", 20))


def test_a_group_that_cannot_fit_alone_fails_instead_of_spinning() -> None:
    scheduler, cache = make_scheduler(12)
    group = make_group(0, 8, max_tokens=10)
    scheduler.add(group)
    failed = []
    for _ in range(20):
        failed += run_step(scheduler).failed
        if not scheduler.has_unfinished():
            break
    assert failed == [group]
    assert group.seqs[0].finish_reason is FinishReason.ERROR and group.error
    assert cache.lengths == {}


def test_a_prompt_larger_than_the_cache_fails_at_admission_after_a_few_tries() -> None:
    # the front doors refuse it first; here the scheduler alone still ends it, without spinning
    scheduler, _ = make_scheduler(12)
    group = make_group(0, 20)
    scheduler.add(group)
    outs = [scheduler.schedule() for _ in range(ALONE_RETRIES + 1)]
    assert [out.failed for out in outs] == [[]] * ALONE_RETRIES + [[group]]
    assert not scheduler.has_unfinished()


def test_forks_copy_the_parent_before_it_grows_and_a_finished_parent_waits_for_them() -> None:
    scheduler, cache = make_scheduler(100)
    group = make_group(0, 6, max_tokens=3, n=2)
    scheduler.add(group)
    run_step(scheduler)
    parent = group.seqs[0]
    parent.finish_reason = FinishReason.STOP  # finished on its first token
    child = Sequence(1, 1, parent.token_ids[:6] + [7], 6, detokenizer=None, generator=None)
    child.num_computed, child.fork_parent = parent.num_computed, parent
    group.seqs.append(child)
    scheduler.release_finished(group)
    assert cache.lengths[0] == 6  # kept: the child still forks from it
    out = scheduler.schedule()
    assert scheduled_ids(out) == {1: 1}
    assert ("fork", 1) in cache.events and 0 not in cache.lengths
    assert cache.lengths[1] == 7  # forked with the prompt, grew by its own first token


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_many_groups_under_pressure_all_finish(mode: str) -> None:
    scheduler, cache = make_scheduler(50, preemption_mode=mode, max_num_seqs=6, max_num_batched_tokens=16)
    groups = [make_group(i, 3 + i % 5, max_tokens=10 + i % 7) for i in range(12)]
    for g in groups:
        scheduler.add(g)
    preempted = 0
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        preempted += run_step(scheduler).num_preempted
    assert not scheduler.has_unfinished() and preempted > 0
    for g in groups:
        assert g.seqs[0].num_output == g.params.max_tokens
    assert cache.lengths == {} and cache.swapped == {}


def test_the_cache_is_told_the_waiting_prompts_the_next_step_admits() -> None:
    scheduler, cache = make_scheduler(1000, max_num_seqs=8, max_num_batched_tokens=64)
    groups = [make_group(i, n, max_tokens=8) for i, n in enumerate([30, 30, 30, 20, 10, 10, 10])]
    for g in groups:
        scheduler.add(g)
    run_step(scheduler)  # 0 and 1 whole, 4 tokens of 2
    # next step: 64 - 2 decodes - 26 of prompt 2 leaves 36 tokens: 20 + 10 + (6 of) 10
    assert cache.upcoming == [20, 10, 10]
    out = run_step(scheduler)
    assert {30, 40, 50} <= set(scheduled_ids(out)) and 60 not in scheduled_ids(out)
    assert groups[6].status is RequestStatus.WAITING


def test_no_waiting_prompt_is_announced_beyond_the_free_sequence_seats() -> None:
    scheduler, cache = make_scheduler(1000, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(5):
        scheduler.add(make_group(i, 8, max_tokens=8))
    run_step(scheduler)
    assert cache.upcoming == []  # three run: no seat until one finishes


def test_a_draft_never_preempts_anyone() -> None:
    """Speculative decoding: a decoding sample gets a draft when the cache has room for it;
    when it has not, the sample decodes its one token where a preemption would have made room."""
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 1, "prompt_lookup_min": 1}
    scheduler, cache = make_scheduler(21, speculative_config=spec)
    groups = [make_group(0, 8, max_tokens=6), make_group(1, 8, max_tokens=6)]
    for group in groups:
        scheduler.add(group)
    run_step(scheduler)  # both prompts (16 tokens), and one output token each
    for group in groups:
        group.seqs[0].token_ids[-1] = 1  # a token the prompt begins with: the proposer drafts 2, 3, 4
    out = scheduler.schedule()
    assert out.num_preempted == 0
    assert {item.seq.seq_id: item.draft for item in out.scheduled} == {0: [2, 3, 4], 10: []}
    assert cache.lengths == {0: 12, 10: 9}


def test_a_batch_size_schedule_stops_drafting_in_wide_batches() -> None:
    spec = {
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 1,
        "prompt_lookup_min": 1,
        "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 0]],
    }
    scheduler, _ = make_scheduler(1000, speculative_config=spec)
    groups = [make_group(0, 8, max_tokens=6), make_group(1, 8, max_tokens=6)]
    for group in groups:
        scheduler.add(group)
    run_step(scheduler)
    for group in groups:
        group.seqs[0].token_ids[-1] = 1
    assert all(not item.draft for item in scheduler.schedule().scheduled)  # two running: k = 0
