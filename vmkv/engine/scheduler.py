"""Iteration-level continuous batching over the KV-cache contract.

Every queue is kept in queue order: arrival (FCFS), or under the priority policy each
request's priority first (lower runs first), then arrival. Each step the scheduler picks
which sequences run and how many tokens each writes:
1. running groups that decode (one token per sample), then running groups still
   prefilling (a chunk each), under the step's token budget;
2. if nothing was preempted this step: swapped groups back in, then waiting groups
   (preempted ones first, all in queue order), while sequences, tokens and KV last; a
   group whose LoRA adapter would make more than max_loras distinct adapters in the step
   is passed over (it keeps its place; later ones may go first).

Before a sequence is scheduled the cache must have room for every token the step writes
(fork, grow). When it has not, the running group last in queue order is preempted,
by recompute (free its KV; it re-prefills prompt + generated tokens later) or by swap
(its KV moves to host memory). A group that cannot get memory even alone is retried on
the next few steps (a driver's ENOMEM can be momentary: the machine short of memory, a
device busy freeing), then finished with an error: the engine never spins for long. The
front doors refuse up front what could never fit the cache, so this is not about size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from vmkv.engine.config import EngineConfig
from vmkv.engine.draft_length import DraftLength
from vmkv.engine.sequence import FinishReason, RequestStatus, Sequence, SequenceGroup
from vmkv.engine.speculative import propose_ngram
from vmkv.kv_cache import KVCache, OutOfKVMemory, UpcomingPrompt

# Admit new work only while this fraction of the KV capacity stays free for running
# sequences to grow into; admitting to the last token would preempt on the next decode.
WATERMARK = 0.01
# Steps in a row a group alone in the cache may fail to get memory before it fails.
ALONE_RETRIES = 4


def queue_order(group: SequenceGroup) -> tuple[int, int]:
    """Who goes first: the lower priority (always 0 under fcfs), then the earlier arrival; a
    preempted group keeps its place, ahead of the groups that arrived after it."""
    return group.priority, group.arrival


@dataclass
class ScheduledSeq:
    """A sequence's share of a step: num_new tokens from its first uncomputed one; a draft's
    tokens (speculative decoding) come after its last token and count in num_new."""

    seq: Sequence
    num_new: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, whose logits pick the next."""
        return self.seq.num_computed + self.num_new - len(self.draft) == len(self.seq.token_ids)

    @property
    def input_ids(self) -> list[int]:
        """The tokens the step computes for the sequence."""
        start = self.seq.num_computed
        end = start + self.num_new - len(self.draft)
        return self.seq.token_ids[start:end] + self.draft


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    failed: list[SequenceGroup] = field(default_factory=list)  # finished with FinishReason.ERROR

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache) -> None:
        self.config = config
        self.cache = cache
        # each in queue order: the head of waiting and swapped runs next, running's last is preempted
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.watermark_tokens = int(cache.free_capacity() * WATERMARK)
        self.speculative = config.speculative_config
        self._draft_tokens = 0  # this step's most draft tokens a sample may have
        adaptive = self.speculative is not None and self.speculative.adaptive_length
        self.draft_length = DraftLength() if adaptive else None

    # ------------------------------------------------------------- queries
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_seq_slots for g in self.running)

    # ---------------------------------------------------------- lifecycle
    def add(self, group: SequenceGroup) -> None:
        bisect.insort(self.waiting, group, key=queue_order)

    def requeue(self, group: SequenceGroup) -> None:
        """Back to waiting, its KV already freed: it re-prefills when it comes to the head again."""
        group.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, group, key=queue_order)

    def finish(self, group: SequenceGroup, reason: FinishReason) -> None:
        """End a group early (abort, error): finish its live samples and give back its KV."""
        for seq in group.live_seqs:
            seq.finish_reason = reason
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.running:
            self.running.remove(group)
        self._free_all(group)
        group.status = RequestStatus.FINISHED

    def recompute_all(self) -> None:
        """Free every request's KV (swapped-out copies too) and queue it to recompute, as a
        preemption by recompute would: before the KV cache's memory goes (an engine sleeping)."""
        for group in self.running + self.swapped:
            self._free_all(group)
            self.requeue(group)
        self.running.clear()
        self.swapped.clear()

    def release_finished(self, group: SequenceGroup) -> None:
        """After a step: free finished samples' KV and retire the group once all are done."""
        self._free_finished(group)
        if not group.live_seqs:
            self.running.remove(group)
            group.status = RequestStatus.FINISHED

    def drop(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """Free samples the request no longer needs (beams no continuation extends) and take
        them out of the group; none is a pending fork's source (a beam it extends survives)."""
        for seq in seqs:
            if seq.num_allocated:
                self.cache.free(seq.seq_id)
            group.seqs.remove(seq)

    # ---------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.speculative is not None:
            self._draft_tokens = self.speculative.tokens_at(self.num_running_seqs)
            if self.draft_length is not None:
                self.draft_length.start_step(self.num_running_seqs)
        planned: dict[SequenceGroup, list[ScheduledSeq]] = {}

        decoding = [g for g in self.running if not g.is_prefilling]
        prefilling = [g for g in self.running if g.is_prefilling]
        for group in decoding + prefilling:
            if group.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            plan = self._plan(group, budget, speculate=True)
            if not plan:
                continue
            while (fitted := self._fit(group, plan)) is None:
                if len(self.running) == 1:
                    self._retry_alone(group, out)
                    break
                victim = self.running[-1]
                budget += sum(s.num_new for s in planned.pop(victim, []))
                self._preempt(victim)
                out.num_preempted += 1
                if victim is group:
                    break
            else:
                group.alone_failures = 0
                planned[group] = fitted
                budget -= sum(s.num_new for s in fitted)

        if out.num_preempted == 0:
            loras = self._running_loras()  # grows as groups start
            budget = self._resume_swapped(budget, planned, loras)
            if not self.swapped:
                self._admit_waiting(budget, planned, out, loras)

        for plan in planned.values():
            out.scheduled.extend(plan)
        if self.config.enable_lora:  # each adapter's rows one contiguous run (lora_layers.step_plan)
            out.scheduled.sort(key=lambda s: "" if s.seq.lora is None else s.seq.lora.uid)
        self.cache.expect(self._upcoming(out))
        return out

    def _upcoming(self, out: SchedulerOutput) -> list[UpcomingPrompt]:
        """The waiting prompts the next step likely admits, as _admit_waiting would take them:
        from the queue's head while the token budget the running sequences leave next step and
        the free sequence seats last. None while groups are swapped out (they resume first) or
        after a preemption (memory is short)."""
        if not self.waiting or self.swapped or out.num_preempted:
            return []
        new = {id(s.seq): s.num_new for s in out.scheduled}
        running = (seq for group in self.running for seq in group.live_seqs)
        budget = self.config.max_num_batched_tokens - sum(
            max(1, seq.num_uncomputed - new.get(id(seq), 0)) for seq in running
        )
        seats = self.config.max_num_seqs - self.num_running_seqs
        upcoming: list[UpcomingPrompt] = []
        loras = self._running_loras()
        for group in self.waiting:
            if not self._lora_fits(group, loras):
                continue
            if budget <= 0 or group.num_seq_slots > seats:
                break
            upcoming += [UpcomingPrompt(seq.token_ids, group.cache_salt) for seq in group.live_seqs]
            budget -= sum(seq.num_uncomputed for seq in group.live_seqs)
            seats -= group.num_seq_slots
        return upcoming

    # ------------------------------------------------------------ planning
    def _plan(self, group: SequenceGroup, budget: int, speculate: bool = False) -> list[ScheduledSeq]:
        """Tokens each live sample writes this step: all its uncomputed ones, chunked by budget,
        and with `speculate` a decoding sample's draft (the caller reserves its room: _fit).

        A decoding group is planned whole or not at all, so its samples stay in lockstep.
        """
        plan = []
        # beams recomputing after a preemption leave their last token for one step they all
        # share: a beam search step needs every beam's next-token logits at once
        lockstep = group.beam is not None and group.is_prefilling and len(group.live_seqs) > 1
        held_back = 1 if lockstep else 0
        for seq in group.live_seqs:
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed - held_back, budget)
            if num_new:
                plan.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        if not group.is_prefilling and len(plan) < len(group.live_seqs):
            return []
        if speculate and self.speculative is not None and not group.is_prefilling and group.beam is None:
            for item in plan:  # the budget left after every sample's own token
                if item.seq.num_output == 0:  # the first token samples alone: n > 1 forks from it
                    continue
                item.draft = self._draft(item.seq, group, budget)
                item.num_new += len(item.draft)
                budget -= len(item.draft)
        return plan

    def _draft(self, seq: Sequence, group: SequenceGroup, budget: int) -> list[int]:
        """The sequence's draft tokens (speculative.py): none past max_tokens, whose token
        ends the sample, or past max_model_len, which the cache cannot hold."""
        room = min(
            budget,
            self._draft_tokens,
            group.params.max_tokens - seq.num_output - 1,
            self.config.max_model_len - len(seq.token_ids),
        )
        if self.draft_length is not None and room > 0:
            room = self.draft_length.allowed(seq.drafts, room)
        return propose_ngram(seq.token_ids, self.speculative, room)

    def _fit(self, group: SequenceGroup, plan: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """The plan, its cache room reserved; short of memory, the plan without its drafts (a
        draft never preempts anyone); None when even that does not fit."""
        if self._reserve(group, plan):
            return plan
        if any(item.draft for item in plan):
            plan = self._without_drafts(plan)
            if self._reserve(group, plan):
                return plan
        return None

    def _without_drafts(self, plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The plan with no draft, the cache room already taken for drafts given back."""
        for item in plan:
            self._drop_draft_room(item.seq)
        return [ScheduledSeq(item.seq, item.num_new - len(item.draft)) for item in plan]

    def _drop_draft_room(self, seq: Sequence) -> None:
        """Give back cache room taken for the sequence's draft this step (the only time a
        sequence holds room past its tokens)."""
        if seq.num_allocated > len(seq.token_ids):
            self.cache.truncate(seq.seq_id, len(seq.token_ids))
            seq.num_allocated = len(seq.token_ids)

    def _reserve(self, group: SequenceGroup, plan: list[ScheduledSeq]) -> bool:
        """Make the cache hold every token the group may write this step, its plan's drafts too:
        pending forks first (they copy the parent as prefilled, before the parent grows), then
        grows. Work already done stays done when memory runs out midway, so a retry continues
        where this stopped."""
        drafts = {id(item.seq): item.draft for item in plan if item.draft}
        try:
            for seq in group.live_seqs:
                if seq.fork_parent is not None:
                    self.cache.fork(seq.fork_parent.seq_id, seq.seq_id)
                    seq.num_allocated = seq.fork_parent.num_computed
                    seq.fork_parent = None
            self._free_finished(group)
            for seq in group.live_seqs:
                draft, start = drafts.get(id(seq), []), seq.num_allocated
                if start < len(seq.token_ids) + len(draft):  # no copy of the whole sequence
                    new = seq.token_ids[start:] + draft[max(0, start - len(seq.token_ids)) :]
                    self.cache.grow(seq.seq_id, new)
                    seq.num_allocated = start + len(new)
        except OutOfKVMemory:
            return False
        return True

    def _free_finished(self, group: SequenceGroup) -> None:
        """Free finished samples, except one a pending fork still copies from (a sample can
        finish on its first token before its siblings are forked off it)."""
        fork_sources = {s.fork_parent for s in group.seqs if s.fork_parent is not None}
        for seq in group.seqs:
            if seq.finished and seq.num_allocated and seq not in fork_sources:
                self.cache.free(seq.seq_id)
                seq.num_allocated = 0

    # ----------------------------------------------------------- preemption
    def _preempt(self, group: SequenceGroup) -> None:
        self.running.remove(group)
        self.num_preemptions += 1
        group.metrics.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            for seq in group.seqs:  # its step will not run
                self._drop_draft_room(seq)
            self.cache.swap_out([s.seq_id for s in group.seqs if s.num_allocated])
            group.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, group, key=queue_order)
        else:
            self._free_all(group)
            self.requeue(group)

    def _free_all(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if seq.num_allocated:
                self.cache.free(seq.seq_id)
            seq.reset_cache_state()

    def _retry_alone(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Nothing else holds KV memory, yet the group got none: skip it this step, and fail it
        once that has happened ALONE_RETRIES + 1 times in a row. True if it failed."""
        if group.alone_failures < ALONE_RETRIES:
            group.alone_failures += 1
            return False
        self._fail(
            group,
            f"the KV cache could not back the request even with nothing else in it "
            f"({ALONE_RETRIES + 1} steps in a row; the memory driver refused)",
            out,
        )
        return True

    def _fail(self, group: SequenceGroup, reason: str, out: SchedulerOutput) -> None:
        group.error = reason
        self.finish(group, FinishReason.ERROR)
        out.failed.append(group)

    # -------------------------------------------------------------- resume
    def _resume_swapped(
        self, budget: int, planned: dict[SequenceGroup, list[ScheduledSeq]], loras: set[int]
    ) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            if self.num_running_seqs + group.num_seq_slots > self.config.max_num_seqs:
                break
            if not self._lora_fits(group, loras):
                break
            try:
                self.cache.swap_in([s.seq_id for s in group.seqs if s.num_allocated])
            except OutOfKVMemory:
                break
            self.swapped.pop(0)
            self._start(group, loras)
            plan = self._plan(group, budget, speculate=True)
            if plan and (plan := self._fit(group, plan)) is not None:
                planned[group] = plan
                budget -= sum(s.num_new for s in plan)
        return budget

    def _admit_waiting(
        self,
        budget: int,
        planned: dict[SequenceGroup, list[ScheduledSeq]],
        out: SchedulerOutput,
        loras: set[int],
    ) -> None:
        head = 0  # the first waiting group not passed over for its LoRA adapter
        while head < len(self.waiting) and budget > 0:
            group = self.waiting[head]
            if not self._lora_fits(group, loras):  # vLLM's rule: later requests may go first
                head += 1
                continue
            if self.num_running_seqs + group.num_seq_slots > self.config.max_num_seqs:
                break
            alone = not self.running and not self.swapped
            needed = sum(len(s.token_ids) for s in group.live_seqs)
            if not alone and self.cache.free_capacity() < needed + self.watermark_tokens:
                break
            if not self._admit(group):
                if alone and self._retry_alone(group, out):
                    continue  # failed: finish() took it off the queue
                break
            group.alone_failures = 0
            self.waiting.pop(head)
            self._start(group, loras)
            plan = self._plan(group, budget)
            planned[group] = plan
            budget -= sum(s.num_new for s in plan)

    def _running_loras(self) -> set[int]:
        """The LoRA adapters (ids) of the running groups; none without LoRA."""
        if not self.config.enable_lora:
            return set()
        return {id(g.lora) for g in self.running if g.lora is not None}

    def _lora_fits(self, group: SequenceGroup, loras: set[int]) -> bool:
        """Whether the group may run beside running groups whose adapters are `loras`: at most
        max_loras distinct LoRA adapters run in one step, which bounds each step's LoRA work."""
        return group.lora is None or id(group.lora) in loras or len(loras) < self.config.max_loras

    def _admit(self, group: SequenceGroup) -> bool:
        """Admit every live sample (one, or each sample of a recomputed group), all or none."""
        admitted = []
        try:
            for seq in group.live_seqs:
                seq.num_computed = self.cache.admit(seq.seq_id, seq.token_ids, group.cache_salt)
                seq.num_allocated = len(seq.token_ids)
                admitted.append(seq)
        except OutOfKVMemory:
            for seq in admitted:
                self.cache.free(seq.seq_id)
                seq.reset_cache_state()
            return False
        if group.status is RequestStatus.WAITING:  # the prompt's tokens the prefix cache held
            group.num_cached_tokens = admitted[0].num_computed
        return True

    def _start(self, group: SequenceGroup, loras: set[int]) -> None:
        """Run the group from now on; its adapter joins the step's `loras`."""
        if group.lora is not None:
            loras.add(id(group.lora))
        group.status = RequestStatus.RUNNING
        bisect.insort(self.running, group, key=queue_order)
