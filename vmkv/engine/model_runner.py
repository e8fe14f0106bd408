"""Runs an unmodified transformers decoder over one packed (varlen) step.

Every scheduled sequence's new tokens are concatenated into a single [1, T] batch with
their true positions, so prefill chunks and decode tokens share one forward. The model's
attention layers reach the KV cache through attention_hook.py; the decoder runs eagerly or
compiled (compiled.py), and half-precision linears run the CPU's best GEMM (cpu_linear.py).
Logits are computed only for the rows that sample.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from functools import partial
from itertools import chain

import torch

from vmkv import faults
from vmkv.engine import native_attention
from vmkv.engine.attention_hook import ATTENTION_NAME, step_context
from vmkv.engine.compiled import compile_decoder, compiled_stance
from vmkv.engine.config import EngineConfig
from vmkv.engine.cpu_linear import linear_packing, pack_linears, pack_weight, packed_logits
from vmkv.engine.lora import LoRAAdapters
from vmkv.engine.lora_layers import hook_lora_slots, lora_step, step_plan
from vmkv.engine.outputs import PromptLogprob
from vmkv.engine.scheduler import ScheduledSeq
from vmkv.engine.sleep import ReleasedWeights, refill_weights
from vmkv.kv_cache import KVCache, KVShape, SeqStep, StepBatch
from vmkv.model.store import load_model

LOGIT_SLICE = 1024  # vocabulary rows per lm_head GEMM on the CPU
PROMPT_LOGPROB_ROWS = 256  # prompt rows per lm_head call for prompt logprobs: [256, V] fp32 at most


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_path: str, shard: Callable[[torch.nn.Module], None] | None = None
    ) -> None:
        """shard, if given, cuts the loaded model down to this rank's part (tensor parallelism)."""
        self.device = torch.device(config.device)
        self.config, self.model_path = config, model_path
        self.model, self.packing = prepare_model(config, model_path, shard)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        hf = self.model.config
        self.vocab_size = hf.vocab_size
        self.hidden_size = hf.hidden_size
        self.kv_shape = KVShape(
            num_layers=hf.num_hidden_layers,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            dtype=config.torch_dtype,
        )
        self.max_position_embeddings = getattr(hf, "max_position_embeddings", None)
        self._positions = torch.arange(config.max_num_batched_tokens, device=self.device)
        # hooked before compiling, so the compiled graphs carry the LoRA op
        self.loras = self._lora_adapters(config) if config.enable_lora else None
        if self.device.type == "cpu":
            native_attention.load()  # built here (first use) rather than in the first decode step
        compiled = compile_decoder(self.decoder, self.device) if config.compile_model else None
        self.compiled = compiled is not None
        self._forward = self.decoder if compiled is None else compiled
        self._faults = faults.active()  # None unless fault injection is on (vmkv/faults.py)

    def _lora_adapters(self, config: EngineConfig) -> LoRAAdapters:
        """The model's linears hooked for LoRA, and the set adapters are loaded into: their A
        and B packed for the CPU's GEMM as the model's own linears are (cpu_linear.py)."""
        slots = hook_lora_slots(self.model)
        pack = None if self.packing is None else partial(pack_weight, packing=self.packing)
        return LoRAAdapters(
            slots, config.max_lora_rank, config.max_cpu_loras, config.torch_dtype, self.device, pack
        )

    def reload_weights(self, released: ReleasedWeights) -> None:
        """Read weights sleep.release_weights let go of from the checkpoint, prepared as at start.
        The model's modules and Parameter objects stay, so a compiled decoder is not compiled
        again."""
        source, _ = prepare_model(self.config, self.model_path)
        refill_weights(released, source)

    @property
    def fp32_gemm(self) -> bool:
        """Whether half-precision linears run as fp32 GEMMs of their values (cpu_linear.py)."""
        return self.packing == "fp32"

    @torch.inference_mode()
    def execute(
        self,
        cache: KVCache,
        scheduled: list[ScheduledSeq],
        keep_hidden: Sequence[int] = (),
        pooling: Collection[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one step; returns float32 logits [S, V] for the scheduled items that sample, in
        order, 1 + len(draft) rows for an item with a draft (its last token's and each draft
        token's), and the final hidden states [num_new, H] of the scheduled items `keep_hidden`
        names (for prompt logprobs and pooling). Items in `pooling` are embedding requests:
        they never sample, so their last rows get no logits."""
        steps = [SeqStep(s.seq.seq_id, s.seq.num_computed, s.num_new) for s in scheduled]
        batch = StepBatch.build(steps, self.device)
        num_tokens = int(batch.query_start[-1])
        input_ids = torch.tensor(
            list(chain.from_iterable(s.input_ids for s in scheduled)), dtype=torch.long, device=self.device
        )
        if batch.is_decode_only:  # row b is sequence b's one new token
            positions = batch.num_cached
        else:  # packed row r: r - (first row of its sequence) + (its sequence's num_cached)
            first_rows, counts = batch.query_start[:-1], batch.query_start.diff()
            positions = self._positions[:num_tokens] + torch.repeat_interleave(
                batch.num_cached - first_rows, counts
            )

        embeds = self._prompt_embeds(scheduled, input_ids, batch.query_start)
        adapters = [s.seq.lora for s in scheduled] if self.loras is not None else []
        loras = step_plan(adapters, batch.query_start.tolist(), self.device) if any(adapters) else []
        plan = cache.prepare(batch)
        if self._faults is not None:
            self._faults.on_forward()
        with (
            step_context(cache, plan),
            lora_step(loras),
            compiled_stance() if self.compiled else nullcontext(),
        ):
            if embeds is None:
                hidden = self._forward(
                    input_ids=input_ids[None], position_ids=positions[None], use_cache=False
                )
            else:  # eager: the compiled graphs take token ids
                hidden = self.decoder(
                    inputs_embeds=embeds[None], position_ids=positions[None], use_cache=False
                )
            hidden = hidden.last_hidden_state[0]
        cache.finish_step(plan)
        last_rows = [i for i, s in enumerate(scheduled) if s.samples and i not in pooling]
        if any(s.draft for s in scheduled):
            ends = batch.query_start[1:].tolist()
            rows = torch.tensor(
                [r for i in last_rows for r in range(ends[i] - 1 - len(scheduled[i].draft), ends[i])],
                device=self.device,
            )
        else:
            rows = batch.query_start[1:][last_rows] - 1
        starts = batch.query_start.tolist() if keep_hidden else []
        kept = [hidden[starts[i] : starts[i + 1]] for i in keep_hidden]
        return self._logits(hidden[rows]), kept

    def _prompt_embeds(
        self, scheduled: list[ScheduledSeq], input_ids: torch.Tensor, query_start: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's input embeddings where it computes positions of a prompt given as
        embeddings (those rows theirs, the others looked up), else None: the ids will do."""
        rows = [
            (i, s.seq)
            for i, s in enumerate(scheduled)
            if s.seq.prompt_embeds is not None and s.seq.num_computed < s.seq.prompt_len
        ]
        if not rows:
            return None
        embeds = self.model.get_input_embeddings()(input_ids)
        starts = query_start.tolist()
        for i, seq in rows:
            given = seq.prompt_embeds[seq.num_computed : seq.num_computed + scheduled[i].num_new]
            embeds[starts[i] : starts[i] + len(given)] = given.to(embeds.device, embeds.dtype)
        return embeds

    @torch.inference_mode()
    def prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
        """For each hidden row, the top-k log-probabilities of the next token, the target's own
        and its rank. Rows go through lm_head PROMPT_LOGPROB_ROWS at a time, so a long prompt
        never holds a [prompt, vocabulary] matrix."""
        out: list[PromptLogprob] = []
        for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            rows = slice(start, start + PROMPT_LOGPROB_ROWS)
            logprobs = self._logits(hidden[rows]).log_softmax(dim=-1)
            target = torch.tensor(targets[rows], device=logprobs.device)
            chosen = logprobs.gather(1, target[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_values, top_ids = logprobs.topk(k, dim=-1)
            for ids, values, token, value, rank in zip(
                top_ids.tolist(),
                top_values.tolist(),
                targets[rows],
                chosen[:, 0].tolist(),
                ranks.tolist(),
                strict=True,
            ):
                entry = dict(zip(ids, values, strict=True))
                entry[token] = value
                out.append((entry, rank))
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on the sampling rows, as float32 [S, V]; plain CPU weights through linear_in_slices."""
        if getattr(self.lm_head, "packed_weight", None) is not None:  # one C++ call (cpu_linear.py)
            return packed_logits(self.lm_head, hidden)
        if self.device.type != "cpu" or self.packing or not isinstance(self.lm_head, torch.nn.Linear):
            return self.lm_head(hidden).float()
        weight, bias = self.lm_head.weight, self.lm_head.bias
        x = hidden.to(weight.dtype)
        out = linear_in_slices(
            x, weight, torch.empty(len(x), weight.shape[0], dtype=weight.dtype, device=x.device)
        )
        if bias is not None:
            out += bias
        return out.to(hidden.dtype).float()  # a half-precision model rounds its logits, as the model would


def prepare_model(
    config: EngineConfig, model_path: str, shard: Callable[[torch.nn.Module], None] | None = None
) -> tuple[torch.nn.Module, str | None]:
    """The checkpoint's model as the runner runs it: on its device, cut down to this rank's part
    (shard, tensor parallelism), its half-precision linears packed; and the packing used."""
    model = load_model(model_path, dtype=config.torch_dtype, attn_implementation=ATTENTION_NAME)
    window = getattr(model.config, "sliding_window", None)
    if window is not None and window < config.max_model_len:
        # every layout attends over the whole context; past the window that would be wrong
        raise ValueError(
            f"{model_path} attends over a sliding window of {window} tokens, which vmkv does not "
            f"implement; set max_model_len <= {window} (it is {config.max_model_len})"
        )
    model.to(config.device)
    if shard is not None:  # before the linears are converted or packed: they see the rank's part
        shard(model)
    packing = linear_packing(config)
    if packing is not None:
        pack_linears(model, packing)
    return model, packing


def linear_in_slices(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T, LOGIT_SLICE rows of weight per GEMM; returns out.

    For the vocabulary projection on the CPU: a slice's output stays in cache, and MKL runs
    [64, 576] x [576, 49152] about 1.7x faster this way (benchmarks/bench_engine.py lm-head).
    Each output is the same dot product either way.
    """
    for start in range(0, weight.shape[0], LOGIT_SLICE):
        rows = slice(start, start + LOGIT_SLICE)
        torch.mm(x, weight[rows].t(), out=out[:, rows])
    return out
