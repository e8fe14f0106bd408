"""The step loop: schedule -> run the model -> sample -> update sequences -> report outputs.

One LLMEngine owns one model, one KV cache (the kv_mode's layout) and one scheduler. It
is single-threaded by design: `LLM` drives it to completion, `AsyncLLM` drives it from a
background thread.
"""

from __future__ import annotations

import gc
import hashlib
import time
import uuid
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from vmkv import faults
from vmkv.engine.beam_search import BeamSearch, Candidate, Hypothesis
from vmkv.engine.config import EngineConfig
from vmkv.engine.detokenizer import IncrementalDetokenizer
from vmkv.engine.engine_info import EngineInfo
from vmkv.engine.errors import ControlRefused, RequestRejected
from vmkv.engine.kv_factory import build_kv_cache
from vmkv.engine.logits_processors import check_extra_args, logits_processor_class
from vmkv.engine.lora import LoRAAdapter, LoRARequest
from vmkv.engine.model_runner import ModelRunner
from vmkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vmkv.engine.prompt_embeds import embeds_cache_salt, prompt_rows, text_context
from vmkv.engine.sampler import Sampler, SampleRow
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import ScheduledSeq, Scheduler
from vmkv.engine.sequence import FinishReason, RequestStatus, Sequence, SequenceGroup
from vmkv.engine.sleep import (
    PauseMode,
    ReleasedWeights,
    check_pause_mode,
    check_sleep_level,
    check_wake_tags,
    release_weights,
    restore_weights,
)
from vmkv.engine.stop_strings import cut_at_stop, find_stop
from vmkv.engine.structured_output import GrammarCompiler
from vmkv.heap import HeapTrimmer, keep_step_buffers
from vmkv.kv_cache import KVMemory, KVStats, UpcomingPrompt
from vmkv.model.store import load_tokenizer, resolve_model

Answer = Callable[[object, BaseException | None], None]  # a control call's (result, error)
# a request whose step's forward raised is retried (recomputed) up to this many times in a row,
# then fails
FORWARD_RETRIES = 1
# how long a step with nothing to run but grammars being compiled waits for one
GRAMMAR_WAIT_SECONDS = 0.05
# how long stats(kv_max_age=...) may reuse the KV cache's figures while the batch is unchanged:
# vattention's walk every mapped page set, 1.3 ms a call at batch 64 x 300 tokens and 7 ms at
# 2,000 tokens (2-4% of a step), and the serving loop asks after every step
KV_STATS_MAX_AGE = 1.0


@dataclass(frozen=True)
class KVReport:
    """The KV cache's figures in an EngineStats, taken together."""

    usage: float
    free_tokens: int
    memory: KVMemory
    stats: KVStats


@dataclass
class EngineStats:
    """A snapshot for metrics endpoints and benchmarks."""

    num_running: int  # requests
    num_waiting: int  # requests never started or preempted by recompute
    num_swapped: int
    num_running_seqs: int
    peak_running_seqs: int
    kv_usage: float
    free_tokens: int  # tokens the KV cache could still take
    num_preemptions: int
    num_steps: int
    prompt_tokens: int  # prompt tokens computed (recomputation included)
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    memory: KVMemory
    kv_stats: KVStats
    paused: int = 0  # 1 while paused or asleep (sleep.py)
    sleep_level: int = 0  # 1: the KV cache's memory given back, 2: the weights' too
    # the LoRA adapters of running and of waiting requests, by name (LoRA-aware routers read them)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # speculative decoding: drafts verified, their tokens, and of those the tokens accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # [p]: drafts whose token p was accepted


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the engine owns its process
        self.model_path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        # the custom logits processors' classes: a name that cannot be used fails before the model loads
        self._processor_classes = [logits_processor_class(name) for name in config.logits_processors]
        # tensor parallelism: this process is rank 0, with the one scheduler and KV manager
        self.tp = None
        if config.tensor_parallel_size > 1:
            from vmkv.distributed.group import TensorParallel  # it builds on this package's modules

            self.tp = TensorParallel(config, str(self.model_path))
        try:
            shard = None if self.tp is None else self.tp.install
            self.runner = ModelRunner(config, str(self.model_path), shard=shard)
            limit = self.runner.max_position_embeddings
            if limit is not None and config.max_model_len > limit:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's {limit} positions"
                )
            build = build_kv_cache if self.tp is None else self.tp.build_cache
            self.cache = build(config, self.runner.kv_shape, str(self.model_path))
            if self.tp is not None:
                self.tp.wait_ready()
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise
        self.scheduler = Scheduler(config, self.cache)
        self.info = EngineInfo(
            model_path=str(self.model_path),
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            vocab_size=self.runner.vocab_size,
            capacity_tokens=self.cache.free_capacity(),
            eos_token_ids=_eos_token_ids(self.runner.model, self.tokenizer),
            kv_units=self.cache.stats().units_total,
            kv_unit=self.cache.stats().unit,
            kv_layout=self.cache.layout,
            scheduling_policy=config.scheduling_policy,
            hidden_size=self.runner.hidden_size,
            takes_prompt_embeds=self.tp is None,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        device, vocab_size = self.runner.device, self.runner.vocab_size
        self.logits_processors = [processor(vocab_size, device) for processor in self._processor_classes]
        self.sampler = Sampler(config.seed, device, self.info.eos_token_ids, self.logits_processors)
        # structured-output grammars compile on a worker thread; their requests wait there
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.info.eos_token_ids)
        # False when the caller detokenizes (the API process, with the engine in its own
        # process): samples then carry token ids only and stop strings are the caller's job.
        self.detokenize = detokenize
        self._groups: dict[str, SequenceGroup] = {}
        self._group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request
        self._next_seq_id = 0
        self._next_arrival = 0
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.peak_running_seqs = 0
        # speculative decoding: drafts verified, their tokens, and of those the tokens accepted
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        spec = config.speculative_config
        self.spec_accepted_per_position = [0] * (0 if spec is None else spec.num_speculative_tokens)
        self._faults = faults.active()  # None unless fault injection is on (vmkv/faults.py)
        self._forward_failures: dict[str, int] = {}  # request id -> failed forwards in a row
        keep_step_buffers()  # a step's buffers stay in the heap for the next step (vmkv/heap.py)
        self._heap = HeapTrimmer()  # what the steps freed goes back to the OS
        self._kv_report: tuple[tuple[int, ...], float, KVReport] | None = None  # batch, time, figures
        # pausing and sleeping (sleep.py)
        self.paused: PauseMode | None = None
        self.asleep: set[str] = set()  # what sleep gave back: "kv_cache", "weights"
        self._held: list[SequenceGroup] = []  # added while paused: they start at resume()
        self._released_weights: ReleasedWeights | None = None
        self._released_kv: KVReport | None = None  # the figures reported while the KV is given back
        self._closed_prefix_counts = (0, 0)  # prefix-cache queries and hits of caches sleep closed
        self._drain_waiters: list[tuple[Callable[[], object], Answer]] = []  # control() in wait mode

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceABC[int] | torch.Tensor,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> SequenceGroup:
        """Queue a request; raises RequestRejected if it could never be served. A prompt is
        text, token ids, or a [tokens, hidden] tensor of embeddings (prompt_embeds.py).

        Requests share cached prompt prefixes only when their cache_salt is equal, so a
        tenant's salt keeps others from learning (by timing) what it has sent. Under the
        priority scheduling policy a lower priority runs first (and is preempted last).
        lora_request runs it with that LoRA adapter, read from its path if not loaded (lora.py).
        """
        params = params or SamplingParams()
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestRejected(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self.info.check_priority(priority)
        text, prompt_ids = self.validate(prompt, params)
        embeds = None
        if isinstance(prompt, torch.Tensor):  # validated above
            embeds = prompt_rows(prompt)
            cache_salt = embeds_cache_salt(embeds, cache_salt)
        lora = self._lora_adapter(lora_request)
        if lora is not None:  # another adapter's KV differs: share only within this load of it
            cache_salt = f"{cache_salt or ''}|lora:{lora.uid}"
        if params.prompt_logprobs is not None or params.pooling == "mean":
            # a cached token has no logits or hidden states: share nothing
            cache_salt = f"computed-whole:{uuid.uuid4().hex}"
        group = SequenceGroup(
            request_id=request_id,
            arrival=self._next_arrival,
            prompt=text,
            prompt_token_ids=prompt_ids,
            params=params,
            seqs=[],
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            cache_salt=cache_salt,
            priority=priority,
            prompt_embeds=embeds,
            lora=lora,
        )
        if params.use_beam_search:
            ends = self._ends_hypothesis(params)
            group.beam = BeamSearch(params.n, ends, len(prompt_ids), params.length_penalty)
        self._next_arrival += 1
        self._new_seq(group, list(prompt_ids), index=0)
        self._groups[request_id] = group
        if self.paused is not None:
            self._held.append(group)
        else:
            self._submit(group)
        return group

    def _lora_adapter(self, request: LoRARequest | None) -> LoRAAdapter | None:
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise RequestRejected(
                f"lora_request must be a LoRARequest, got {type(request).__name__}", "model"
            )
        if self.runner.loras is None:
            raise RequestRejected(
                f"LoRA adapter {request.lora_name!r} asked for, but this engine serves none (enable_lora)",
                "model",
            )
        try:
            return self.runner.loras.get(request)
        except ValueError as error:
            raise RequestRejected(str(error), "model") from None

    def add_lora(self, request: LoRARequest) -> str:
        """Load an adapter now (a request naming it would load it anyway); RequestRejected (a
        ValueError) names what does not fit. Returns its name."""
        return self._lora_adapter(request).name

    def remove_lora(self, name: str) -> bool:
        """Let go of a loaded adapter (requests running with it finish with it); whether it was loaded."""
        return self.runner.loras is not None and self.runner.loras.remove(name)

    def list_loras(self) -> list[str]:
        """The adapters loaded, least recently used first."""
        return [] if self.runner.loras is None else self.runner.loras.names()

    def _submit(self, group: SequenceGroup) -> None:
        if group.params.structured is not None:
            self.grammars.submit(group)
        else:
            self.scheduler.add(group)

    def validate(
        self, prompt: str | SequenceABC[int] | torch.Tensor, params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a request without touching engine state (safe from any thread);
        returns (prompt text or None, prompt token ids) or raises RequestRejected."""
        check_extra_args(self._processor_classes, params)
        return self.info.validate(self.tokenizer, prompt, params)

    def prompts_arrived(self, prompts: SequenceABC[tuple[SequenceABC[int], str | None]]) -> None:
        """Advice from the thread that receives requests, while a step may run: prompts (token
        ids and cache salt) that add_request will queue before the next step. The KV cache may
        start backing them now (KVCache.arrived). Safe from any thread; a sleeping cache ignores it."""
        if "kv_cache" not in self.asleep:
            self.cache.arrived([UpcomingPrompt(ids, salt) for ids, salt in prompts])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV; returns its final output, None if it is not live."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        if group in self._held:
            self._held.remove(group)
        self.grammars.discard(group)
        self.scheduler.finish(group, FinishReason.ABORT)
        return self._retire(group)

    def stop_sample(self, request_id: str, index: int) -> RequestOutput | None:
        """End sample `index` of a request with finish_reason stop, for a caller that found a stop
        string in its text; frees the sample's KV. Returns the request's final output if that was
        its last live sample, else None (also when the request or sample has already ended)."""
        group = self._groups.get(request_id)
        seq = next((s for s in group.live_seqs if s.index == index), None) if group else None
        if seq is None:
            return None
        if len(group.live_seqs) > 1:
            seq.finish_reason = FinishReason.STOP
            if group.status is RequestStatus.RUNNING:
                self.scheduler.release_finished(group)
            return None
        self.scheduler.finish(group, FinishReason.STOP)
        return self._retire(group)

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Finish every live request with FinishReason.ERROR (after a step raised)."""
        for group in self._groups.values():
            group.error = reason
        return self._fail(list(self._groups.values()), reason)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (KVCache.reset_prefix_cache); returns the entries forgotten."""
        if "kv_cache" in self.asleep:
            return 0  # given back: nothing is cached
        return self.cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether requests are in the scheduler or compiling their grammar (held ones are not)."""
        return self.scheduler.has_unfinished() or self.grammars.num_pending > 0

    def has_work(self) -> bool:
        """Whether a step would advance anything: requests are unfinished and not kept paused."""
        return self.paused != "keep" and self.has_unfinished_requests()

    # ------------------------------------------------------ pause and sleep
    def pause(self, mode: PauseMode = "abort") -> list[RequestOutput]:
        """Admit nothing new (sleep.py): requests added from now on are held until resume().
        In-flight ones are aborted (their final outputs returned), run to their end ("wait")
        or kept, frozen ("keep"). Pausing again changes the mode."""
        self.paused = check_pause_mode(mode)
        if mode != "abort":
            return []
        outputs = []
        for request_id in list(self._groups):
            out = self.abort_request(request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    @property
    def drained(self) -> bool:
        """Paused with nothing left running: at once in keep mode, whose requests wait frozen."""
        return self.paused is not None and (self.paused == "keep" or not self.has_unfinished_requests())

    @property
    def sleep_level(self) -> int:
        """0 awake (or paused only), 1 while memory is given back, 2 while the weights are dropped."""
        if "weights" in self.asleep and self._released_weights.host_copies is None:
            return 2
        return int(bool(self.asleep))

    def sleep(self, level: int = 1) -> None:
        """Give memory back (sleep.py's levels); the engine must be drained. A kept request
        whose KV goes recomputes it once the engine runs again."""
        level = self._check_sleep(level)
        if not self.drained:
            raise ControlRefused("the engine must be paused and drained before it sleeps")
        if level >= 1 and "kv_cache" not in self.asleep:
            self.scheduler.recompute_all()
            self._release_kv()
        offload = level == 1 and torch.device(self.config.device).type != "cpu"  # CPU: host memory already
        if (level == 2 or offload) and "weights" not in self.asleep:
            self._released_weights = release_weights(self.runner.model, offload)
            self.asleep.add("weights")
            # compiled, some of the old tensors are held in reference cycles: 266 MiB of the
            # default model's bf16 weights stayed resident until a collection
            gc.collect()
        self._heap.trim()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore what the tags name ("weights", "kv_cache"; None: all) of what sleep gave back;
        once nothing is asleep, resume. Returns whether the engine runs again."""
        for tag in check_wake_tags(tags):
            if tag in self.asleep and tag == "weights":
                self._restore_weights()
            elif tag in self.asleep:
                self._restore_kv()
        if not self.asleep:
            self.resume()
        return not self.asleep

    def resume(self) -> None:
        """Schedule again, the held requests after those already queued. Raises ControlRefused
        while memory is asleep (wake_up first)."""
        if self.asleep:
            raise ControlRefused(f"the engine is asleep ({', '.join(sorted(self.asleep))}): wake it up first")
        self.paused = None
        waiters, self._drain_waiters = self._drain_waiters, []
        for _, answer in waiters:
            answer(None, ControlRefused("the engine resumed before its requests in flight were done"))
        held, self._held = self._held, []
        for group in held:
            self._submit(group)

    def control(self, name: str, args: SequenceABC[object], answer: Answer) -> list[RequestOutput]:
        """Run an operator's call between steps (pause, sleep, wake_up, resume, reset_prefix_cache,
        add_lora, remove_lora, list_loras, state) and answer it with (result, None) or (None,
        error): at once, or for pause and sleep in wait mode once the requests in flight are done
        (the loop driving the engine calls settle() after every step and every batch of
        commands). Returns the outputs the call ended (aborted requests)."""
        outputs: list[RequestOutput] = []
        try:
            match name, *args:
                case "pause", mode:
                    outputs = self.pause(mode)
                    self._drain_waiters.append((lambda: None, answer))
                case "sleep", level, mode:
                    level, mode = self._check_sleep(level), check_pause_mode(mode)
                    outputs = self.pause(mode)
                    self._drain_waiters.append((lambda: self.sleep(level), answer))
                case "wake_up", tags:
                    answer(self.wake_up(tags), None)
                case ("resume",):
                    answer(self.resume(), None)
                case ("reset_prefix_cache",):
                    answer(self.reset_prefix_cache(), None)
                case "add_lora", lora_name, lora_path:
                    answer(self.add_lora(LoRARequest(lora_name, 1, lora_path)), None)
                case "remove_lora", lora_name:
                    answer(self.remove_lora(lora_name), None)
                case ("list_loras",):
                    answer(self.list_loras(), None)
                case ("state",):
                    answer({"paused": self.paused is not None, "asleep": sorted(self.asleep)}, None)
                case _:
                    raise ValueError(f"unknown control call {name!r} with {len(args)} arguments")
        except Exception as error:  # noqa: BLE001 - the caller gets it: ValueError, ControlRefused, a failure
            answer(None, error)
        self.settle()
        return outputs

    def settle(self) -> None:
        """Answer the calls waiting for the engine to drain, if it has (control)."""
        if not self._drain_waiters or not self.drained:
            return
        waiters, self._drain_waiters = self._drain_waiters, []
        for work, answer in waiters:
            try:
                result = work()
            except Exception as error:  # noqa: BLE001 - the caller gets it
                answer(None, error)
            else:
                answer(result, None)

    def _check_sleep(self, level: object) -> int:
        level = check_sleep_level(level)
        if level and self.tp is not None:
            raise ValueError("sleep levels 1 and 2 are not supported with tensor parallelism")
        return level

    def _release_kv(self) -> None:
        stats = self.cache.stats()
        queries, hits = self._closed_prefix_counts
        self._closed_prefix_counts = (queries + stats.prefix_cache_queries, hits + stats.prefix_cache_hits)
        # the figures while asleep: nothing held, no room, the layout's counts as they stood
        self._released_kv = KVReport(0.0, 0, KVMemory(0, 0, 0), stats)
        self.cache.close()
        self.asleep.add("kv_cache")

    def _restore_kv(self) -> None:
        build = build_kv_cache if self.tp is None else self.tp.build_cache
        self.cache = build(self.config, self.runner.kv_shape, str(self.model_path))
        self.scheduler.cache = self.cache
        self._released_kv = None
        self._kv_report = None
        self.asleep.discard("kv_cache")

    def _restore_weights(self) -> None:
        released = self._released_weights
        if released.host_copies is not None:
            restore_weights(released, self.runner.device)
        else:
            self.runner.reload_weights(released)
        self._released_weights = None
        self.asleep.discard("weights")

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; returns the outputs of those that gained
        tokens or finished (a prefill chunk that samples nothing reports nothing)."""
        outputs = self._admit_compiled()
        started, emitted_before = time.perf_counter(), self.generation_tokens
        sched = self.scheduler.schedule()
        outputs += [self._retire(group) for group in sched.failed]
        if not sched.scheduled:
            return outputs
        self.num_steps += 1
        now = time.monotonic()
        sampling: list[ScheduledSeq] = []  # each with its logits rows, in order
        for item in sched.scheduled:
            group = self._group_of[item.seq.seq_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if item.samples and not group.params.pooling:
                sampling.append(item)
            if item.seq.num_computed < item.seq.prompt_len:
                self.prompt_tokens += min(item.num_new, item.seq.prompt_len - item.seq.num_computed)

        try:
            logprob_items = self._prompt_logprob_items(sched.scheduled)
            pooling_items = self._pooling_items(sched.scheduled)
            wanted = sorted(set(logprob_items) | set(pooling_items))
            logits, hidden = self.runner.execute(self.cache, sched.scheduled, wanted, set(pooling_items))
            for i, rows in zip(wanted, hidden, strict=True):
                if i in logprob_items:
                    self._record_prompt_logprobs(sched.scheduled[i], rows)
                if i in pooling_items:
                    self._pool(sched.scheduled[i], rows)
        except Exception as error:  # noqa: BLE001 - the step's requests are retried or fail; others carry on
            return self._checked(outputs + self._retry_or_fail(sched.scheduled, error))
        if self._forward_failures:  # a forward that went through: the count starts again
            for item in sched.scheduled:
                self._forward_failures.pop(self._group_of[item.seq.seq_id].request_id, None)
        # an embedding request whose prompt this step completes ends here, sampling nothing
        embedded = [sched.scheduled[i].seq for i in pooling_items if sched.scheduled[i].samples]
        _advance(sched.scheduled)
        self.peak_running_seqs = max(self.peak_running_seqs, self.scheduler.num_running_seqs)
        if embedded:
            outputs += self._finish_embedded(embedded)

        drafted: list[tuple[ScheduledSeq, torch.Tensor]] = []
        if any(item.draft for item in sampling):
            logits, sampling, drafted = _split_drafts(logits, sampling)
        row_seqs, row_index = self._expand_forks([item.seq for item in sampling])
        if row_index != list(range(len(sampling))):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        self.generation_tokens += len(row_seqs)
        groups = [self._group_of[s.seq_id] for s in row_seqs]
        if any(g.beam is not None for g in groups):  # beams pick their tokens themselves
            beams = [i for i, g in enumerate(groups) if g.beam is not None]
            outputs += self._search_beams(logits[beams], [row_seqs[i] for i in beams])
            rest = [i for i, g in enumerate(groups) if g.beam is None]
            logits, row_seqs, groups = logits[rest], [row_seqs[i] for i in rest], [groups[i] for i in rest]
        rows = [_sample_row(s, g) for s, g in zip(row_seqs, groups, strict=True)]
        token_ids, logprobs_rows, failed = self._sample(logits, rows, groups) if rows else ([], [], {})
        outputs += self._fail(failed.values(), "sampling failed")
        now = time.monotonic()
        for seq, group, token, logprobs in zip(row_seqs, groups, token_ids, logprobs_rows, strict=True):
            if group.finished:  # its sampling failed
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            self._append_token(seq, group, token, logprobs)

        if drafted:  # a sample whose group failed above is gone with it
            drafted = [(item, rows) for item, rows in drafted if item.seq.seq_id in self._group_of]
            verified, verify_outputs = self._verify(drafted) if drafted else ([], [])
            outputs += verify_outputs
            groups += verified
        running = (g for g in groups if id(g) not in failed and g.status is RequestStatus.RUNNING)
        for group in {id(g): g for g in running}.values():
            self.scheduler.release_finished(group)
            outputs.append(self._retire(group) if group.finished else group.output())
        self._heap.trim_if_due()
        draft_length = self.scheduler.draft_length
        if draft_length is not None and all(item.num_new - len(item.draft) == 1 for item in sched.scheduled):
            tokens = sum(item.num_new for item in sched.scheduled)
            emitted, seconds = self.generation_tokens - emitted_before, time.perf_counter() - started
            draft_length.cost.observe(len(sched.scheduled), tokens, emitted, seconds)  # decode steps only
        return self._checked(outputs)

    def stats(self, kv_max_age: float = 0.0) -> EngineStats:
        """kv_max_age: seconds the KV cache's figures (usage, free tokens, memory, KVStats) may be
        reused while the batch keeps the same requests; the counters are always current."""
        sched = self.scheduler
        batch = (len(sched.running), len(sched.waiting), len(sched.swapped), sched.num_preemptions)
        now = time.monotonic()
        report = self._kv_report
        stale = report is None or report[0] != batch or now - report[1] > kv_max_age
        if stale and self._released_kv is None:
            cache = self.cache
            self._kv_report = (
                batch,
                now,
                KVReport(cache.usage(), cache.free_capacity(), cache.memory(), cache.stats()),
            )
        kv = self._released_kv or self._kv_report[2]
        queries, hits = self._closed_prefix_counts
        if self._released_kv is None:  # those of the cache in use; a released one's are counted
            queries, hits = queries + kv.stats.prefix_cache_queries, hits + kv.stats.prefix_cache_hits
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.grammars.num_pending + len(self._held),
            num_swapped=len(self.scheduler.swapped),
            num_running_seqs=self.scheduler.num_running_seqs,
            peak_running_seqs=self.peak_running_seqs,
            kv_usage=kv.usage,
            free_tokens=kv.free_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            memory=kv.memory,
            kv_stats=kv.stats,
            paused=int(self.paused is not None),
            sleep_level=self.sleep_level,
            running_loras=_lora_names(sched.running),
            waiting_loras=_lora_names(sched.waiting),
            spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_accepted_per_position),
        )

    def check_health(self) -> None:
        """Raise TensorParallelError (vmkv.distributed.errors) if a tensor-parallel rank has
        exited: for an idle engine, which no failed step would tell."""
        if self.tp is not None:
            self.tp.check_alive()

    def close(self) -> None:
        self.grammars.close()
        self.cache.close()
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------- helpers
    def _checked(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs, after the allocator self-check when fault injection asks for it."""
        if self._faults is not None and self._faults.check_invariants:
            faults.check_engine(self)
        return outputs

    def _sample(
        self, logits: torch.Tensor, rows: list[SampleRow], groups: list[SequenceGroup]
    ) -> tuple[list[int], list[dict[int, float] | None], dict[int, SequenceGroup]]:
        """(token, logprobs) per row, and the groups whose sampling failed (by id). When the
        batch's sampling raises, each row is sampled alone, so only the requests at fault
        fail; a grammar row may have accepted its token before the failure, so one fails too."""
        try:
            result = self.sampler(logits, rows)
            return result.token_ids, result.logprobs, {}
        except Exception as error:  # noqa: BLE001 - find the rows at fault below
            batch_error = error
        token_ids, logprobs_rows, failed = [], [], {}
        for i, (row, group) in enumerate(zip(rows, groups, strict=True)):
            try:
                if row.grammar is not None:
                    raise batch_error
                result = self.sampler(logits[i : i + 1], [row])
                token_ids.append(result.token_ids[0])
                logprobs_rows.append(result.logprobs[0])
            except Exception as error:  # noqa: BLE001 - this request's own failure
                group.error = f"sampling failed: {error!r}"
                failed[id(group)] = group
                token_ids.append(-1)
                logprobs_rows.append(None)
        return token_ids, logprobs_rows, failed

    def _verify(
        self, drafted: list[tuple[ScheduledSeq, torch.Tensor]]
    ) -> tuple[list[SequenceGroup], list[RequestOutput]]:
        """Sample each drafted sequence's positions in turn, as decode steps would (speculative.py):
        position j's token is appended, and while it equals draft token j the next position is
        sampled too. Then each keeps the KV of its last token and its accepted draft tokens, the
        cache's room past them given back. Returns the groups that gained tokens and the outputs
        of those whose sampling failed."""
        accepted = [0] * len(drafted)
        active = list(range(len(drafted)))
        outputs, failed = [], {}
        for position in range(1 + max(len(item.draft) for item, _ in drafted)):
            if not active:
                break
            seqs = [drafted[i][0].seq for i in active]
            groups = [self._group_of[seq.seq_id] for seq in seqs]
            rows = [_sample_row(seq, group) for seq, group in zip(seqs, groups, strict=True)]
            logits = torch.stack([drafted[i][1][position] for i in active])
            token_ids, logprobs_rows, failures = self._sample(logits, rows, groups)
            failed.update(failures)
            outputs += self._fail(failures.values(), "sampling failed")
            going = []
            sampled = zip(active, seqs, groups, token_ids, logprobs_rows, strict=True)
            for i, seq, group, token, logprobs in sampled:
                if group.finished:  # its sampling failed
                    continue
                self._append_token(seq, group, token, logprobs)
                self.generation_tokens += 1
                draft = drafted[i][0].draft
                if position < len(draft) and token == draft[position] and not seq.finished:
                    accepted[i] += 1
                    going.append(i)
            active = going
        groups = []
        for (item, _), count in zip(drafted, accepted, strict=True):
            seq, group = item.seq, self._group_of.get(item.seq.seq_id)
            self.spec_drafts += 1
            self.spec_draft_tokens += len(item.draft)
            self.spec_accepted_tokens += count
            for position in range(count):
                self.spec_accepted_per_position[position] += 1
            if self.scheduler.draft_length is not None:
                self.scheduler.draft_length.verified(seq.drafts, len(item.draft), count)
            if group is None or id(group) in failed:
                continue
            seq.num_computed += count - len(item.draft)  # _advance counted every draft token
            if not seq.finished:
                self.cache.truncate(seq.seq_id, seq.num_computed)
                seq.num_allocated = seq.num_computed
            groups.append(group)
        return groups, outputs

    def _retry_or_fail(self, scheduled: list[ScheduledSeq], error: Exception) -> list[RequestOutput]:
        """After a forward that raised: each of the step's requests is preempted (its KV freed,
        to be recomputed; nothing of the step was marked written, see KVCache.finish_step) and
        retried, unless its forwards already failed FORWARD_RETRIES times in a row: that one fails."""
        groups = {id(g): g for g in (self._group_of[s.seq.seq_id] for s in scheduled)}.values()
        failed = []
        for group in groups:
            tries = self._forward_failures.get(group.request_id, 0) + 1
            self._forward_failures[group.request_id] = tries
            if tries > FORWARD_RETRIES:
                failed.append(group)
                continue
            for seq in group.seqs:  # recompute whatever the preemption mode: drop the step's KV
                if seq.num_allocated:
                    self.cache.free(seq.seq_id)
                seq.reset_cache_state()
            self.scheduler.running.remove(group)
            self.scheduler.requeue(group)
        return self._fail(failed, f"the model forward failed {FORWARD_RETRIES + 1} times: {error!r}")

    def _fail(self, groups: Iterable[SequenceGroup], reason: str) -> list[RequestOutput]:
        """Finish `groups` with FinishReason.ERROR, freeing their KV; keeps an error already set."""
        outputs = []
        for group in groups:
            group.error = group.error or reason
            self.grammars.discard(group)
            self.scheduler.finish(group, FinishReason.ERROR)
            outputs.append(self._retire(group))
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand requests whose grammar is now compiled to the scheduler (a grammar that failed to
        compile fails its request). With nothing else to run, wait a little for a compile."""
        if not self.scheduler.has_unfinished():
            self.grammars.wait(timeout=GRAMMAR_WAIT_SECONDS)
        outputs = []
        for group, state in self.grammars.ready():
            if isinstance(state, str):
                group.error = f"the structured output's grammar failed to compile: {state}"
                self.scheduler.finish(group, FinishReason.ERROR)
                outputs.append(self._retire(group))
            else:
                group.seqs[0].grammar = state
                self.scheduler.add(group)
        return outputs

    def _new_seq(self, group: SequenceGroup, token_ids: list[int], index: int) -> Sequence:
        seed = group.params.seed
        seq = Sequence(
            seq_id=self._next_seq_id,
            index=index,
            token_ids=token_ids,
            prompt_len=len(group.prompt_token_ids),
            # beams fork and die every step: their text is decoded once, from the answer
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                text_context(group.prompt_token_ids, group.prompt_embeds is not None),
                group.params.skip_special_tokens,
            )
            if self.detokenize and group.beam is None
            else None,
            # each sample draws from its own stream, so its tokens do not depend on the batch
            generator=None
            if seed is None
            else torch.Generator(device=self.runner.device).manual_seed(sample_seed(seed, index)),
            logprobs=None if group.params.logprobs is None else [],
            thinking=group.params.end_of_thinking is not None,
            prompt_embeds=group.prompt_embeds,
            lora=group.lora,
        )
        self._next_seq_id += 1
        group.seqs.append(seq)
        self._group_of[seq.seq_id] = group
        return seq

    def _expand_forks(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A request with n > 1 that just finished its prompt gets n - 1 children here, each
        sampling from the parent's logits row; the scheduler forks their KV before the next step."""
        row_seqs, row_index = [], []
        for i, seq in enumerate(sampling):
            row_seqs.append(seq)
            row_index.append(i)
            group = self._group_of[seq.seq_id]
            if group.beam is None and len(group.seqs) < group.params.n and seq.num_output == 0:
                for index in range(1, group.params.n):
                    child = self._new_seq(group, list(seq.token_ids), index)
                    child.num_computed = seq.num_computed
                    child.fork_parent = seq
                    child.grammar = None if seq.grammar is None else seq.grammar.fork()
                    child.thinking = seq.thinking
                    row_seqs.append(child)
                    row_index.append(i)
        return row_seqs, row_index

    def _ends_hypothesis(self, params: SamplingParams) -> Callable[[int], bool]:
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.info.eos_token_ids))
        return ends.__contains__

    def _search_beams(self, logits: torch.Tensor, beams: list[Sequence]) -> list[RequestOutput]:
        """One step of each beam-searching request among `beams` (every live beam of each, as
        the scheduler plans them in lockstep); returns the outputs of the searches that ended."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        by_group: dict[int, tuple[SequenceGroup, list[int]]] = {}
        for i, seq in enumerate(beams):
            group = self._group_of[seq.seq_id]
            by_group.setdefault(id(group), (group, []))[1].append(i)
        outputs, now = [], time.monotonic()
        for group, rows in by_group.values():
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            if self._advance_beams(group, [beams[i] for i in rows], logprobs[rows]):
                outputs.append(self._retire(group))
        return outputs

    def _advance_beams(self, group: SequenceGroup, beams: list[Sequence], logprobs: torch.Tensor) -> bool:
        """Extend, fork and drop a request's beams by their candidates; True when its search
        ended (max_tokens reached, or every candidate finished), with the answer written."""
        search, params = group.beam, group.params
        if len(beams) != len(group.live_seqs):
            raise RuntimeError(f"request {group.request_id}: beams stepped out of lockstep")
        k = params.logprobs or 0
        proposals = search.propose(beams, logprobs, k)

        def extended(beam: Sequence, candidate: Candidate) -> tuple[list[int], list[dict[int, float]] | None]:
            logprobs = None if beam.logprobs is None else beam.logprobs + [proposals.logprobs(candidate, k)]
            return beam.token_ids + [candidate.token], logprobs

        ended = []
        for candidate in proposals.ended:
            beam = beams[candidate.beam]
            tokens, logprobs_list = extended(beam, candidate)
            eos = not params.ignore_eos and candidate.token in self.info.eos_token_ids
            stop_reason = None if eos else candidate.token
            hypothesis = Hypothesis(
                tokens[beam.prompt_len :],
                candidate.cumulative_logprob,
                logprobs_list,
                FinishReason.STOP,
                stop_reason,
            )
            ended.append(hypothesis)
        search.finish(ended)
        generated = beams[0].num_output + 1
        continuations: dict[int, list[Candidate]] = {}
        for candidate in proposals.carried:
            continuations.setdefault(candidate.beam, []).append(candidate)
        dropped = [beam for i, beam in enumerate(beams) if i not in continuations]
        self.scheduler.drop(group, dropped)
        for beam in dropped:
            del self._group_of[beam.seq_id]
        for i, (first, *others) in continuations.items():
            beam = beams[i]
            for candidate in others:  # a fork: it shares the beam's KV so far
                tokens, logprobs_list = extended(beam, candidate)
                child = self._new_seq(group, tokens, index=0)
                child.num_computed, child.fork_parent = beam.num_computed, beam
                child.cumulative_logprob, child.logprobs = candidate.cumulative_logprob, logprobs_list
            beam.token_ids.append(first.token)  # after its forks copied the tokens so far
            if beam.logprobs is not None:
                beam.logprobs.append(proposals.logprobs(first, k))
            beam.cumulative_logprob = first.cumulative_logprob
        for index, beam in enumerate(group.seqs):
            beam.index = index
        if proposals.carried and generated < params.max_tokens:
            return False
        best = search.best(group.seqs)
        self.scheduler.finish(group, FinishReason.LENGTH)
        group.beam_results = [
            CompletionOutput(
                index=index,
                text=self._decode(group, h.token_ids),
                token_ids=h.token_ids,
                finish_reason=str(h.finish_reason),
                stop_reason=h.stop_reason,
                cumulative_logprob=h.cumulative_logprob,
                logprobs=h.logprobs,
            )
            for index, h in enumerate(best)
        ]
        return True

    def _decode(self, group: SequenceGroup, token_ids: list[int]) -> str:
        """A whole output's text, as incremental detokenizing would have built it ("" when the
        caller detokenizes)."""
        if not self.detokenize:
            return ""
        prompt = text_context(group.prompt_token_ids, group.prompt_embeds is not None)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, group.params.skip_special_tokens)
        return detokenizer.step(prompt + token_ids, final=True)

    def _append_token(
        self, seq: Sequence, group: SequenceGroup, token: int, logprobs: dict[int, float] | None
    ) -> None:
        params = group.params
        seq.token_ids.append(token)
        end = params.end_of_thinking
        if seq.thinking and seq.num_output >= len(end) and seq.token_ids[-len(end) :] == end:
            seq.thinking = False  # a constraint holds from the next token
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        if not params.ignore_eos and token in self.info.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif seq.grammar is not None and not seq.thinking and seq.grammar.terminated:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif (
            (detection := params.repetition_detection) is not None
            and seq.num_output >= params.min_tokens
            and detection.repeats(seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - detection.span) :])
        ):
            seq.finish_reason, seq.stop_reason = FinishReason.REPETITION, "repetition_detected"
        if seq.detokenizer is None:
            return
        delta = seq.detokenizer.step(seq.token_ids, final=seq.finished)
        if not delta:
            return
        seq.text += delta
        # as vLLM: no stop string ends a sample before min_tokens (the sampler masks the stop ids)
        if (
            params.stop
            and seq.num_output >= params.min_tokens
            and (stop := find_stop(seq.text, params.stop, len(delta)))
        ):
            at, seq.stop_reason = stop
            seq.text = cut_at_stop(seq.text, at, stop[1], params.include_stop_str_in_output)
            seq.finish_reason = FinishReason.STOP

    def _prompt_logprob_items(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """The scheduled items whose rows predict prompt tokens not yet given a logprob."""
        wanted = []
        for i, item in enumerate(scheduled):
            recorded = self._group_of[item.seq.seq_id].prompt_logprobs
            seq = item.seq
            # row at position p predicts token p + 1; rows predicting 1 .. len(recorded) - 1 are done
            end = min(seq.num_computed + item.num_new, seq.prompt_len - 1)
            if recorded is not None and len(recorded) - 1 < end:
                wanted.append(i)
        return wanted

    def _pooling_items(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """The scheduled items of embedding requests (all their steps are prompt chunks)."""
        return [i for i, item in enumerate(scheduled) if self._group_of[item.seq.seq_id].params.pooling]

    def _pool(self, item: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Fold a prompt chunk's final hidden states into its request's pooled state; rows a
        recompute after preemption repeats are skipped."""
        seq, group = item.seq, self._group_of[item.seq.seq_id]
        rows = hidden[max(0, group.pooled_tokens - seq.num_computed) :].float()
        if not len(rows):
            return
        if group.params.pooling == "last":
            group.pooled = rows[-1]
        else:
            total = rows.sum(dim=0)
            group.pooled = total if group.pooled is None else group.pooled + total
        group.pooled_tokens = seq.num_computed + item.num_new

    def _finish_embedded(self, seqs: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        for seq in seqs:
            group = self._group_of[seq.seq_id]
            pooled = group.pooled / (group.pooled_tokens if group.params.pooling == "mean" else 1)
            group.embedding = torch.nn.functional.normalize(pooled, dim=0).tolist()
            group.pooled = None
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = time.monotonic()
            seq.finish_reason = FinishReason.STOP
            self.scheduler.release_finished(group)
            outputs.append(self._retire(group))
        return outputs

    def _record_prompt_logprobs(self, item: ScheduledSeq, hidden: torch.Tensor) -> None:
        seq, group = item.seq, self._group_of[item.seq.seq_id]
        recorded = group.prompt_logprobs
        first = max(seq.num_computed, len(recorded) - 1)  # a recompute after preemption skips done rows
        end = min(seq.num_computed + item.num_new, seq.prompt_len - 1)
        targets = group.prompt_token_ids[first + 1 : end + 1]
        rows = hidden[first - seq.num_computed : end - seq.num_computed]
        recorded += self.runner.prompt_logprobs(rows, targets, group.params.prompt_logprobs)

    def _retire(self, group: SequenceGroup) -> RequestOutput:
        self._forward_failures.pop(group.request_id, None)
        group.metrics.finished_time = time.monotonic()
        del self._groups[group.request_id]
        for seq in group.seqs:
            del self._group_of[seq.seq_id]
        if not self._groups:  # the last request left: what the steps freed goes back to the OS
            self._heap.trim()
        return group.output()


def _sample_row(seq: Sequence, group: SequenceGroup) -> SampleRow:
    grammar = None if seq.thinking else seq.grammar
    return SampleRow(group.params, seq.generator, seq.token_ids, seq.prompt_len, grammar, seq.thinking)


def _split_drafts(
    logits: torch.Tensor, sampling: list[ScheduledSeq]
) -> tuple[torch.Tensor, list[ScheduledSeq], list[tuple[ScheduledSeq, torch.Tensor]]]:
    """The step's logits (ModelRunner.execute) parted: the rows of the items without a draft,
    those items, and each item with a draft with its 1 + len(draft) rows."""
    plain_rows, plain, drafted = [], [], []
    row = 0
    for item in sampling:
        if item.draft:
            drafted.append((item, logits[row : row + 1 + len(item.draft)]))
        else:
            plain_rows.append(row)
            plain.append(item)
        row += 1 + len(item.draft)
    return logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)], plain, drafted


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index` of a request seeded with `seed` (any int >= 0).

    A hash rather than arithmetic: it never leaves manual_seed's 64-bit range, and it mixes
    every bit of the request seed into the low 32, the only ones torch's CPU generator uses.
    """
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _advance(scheduled: list[ScheduledSeq]) -> None:
    for item in scheduled:
        item.seq.num_computed += item.num_new


def _lora_names(groups: Iterable[SequenceGroup]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(group.lora.name for group in groups if group.lora is not None))


def _eos_token_ids(model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    """End-of-sequence ids from the generation config (as transformers' generate stops) and tokenizer."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
