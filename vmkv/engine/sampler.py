"""Token selection for a whole step at once: logits processors, greedy, temperature, top-k,
top-p, min-p, seeds, logprobs.

All rows are processed as one [S, V] tensor and no Python loop touches a vocabulary-sized
tensor. Rows whose parameters change the logits (penalties, min_tokens, logit_bias,
allowed_token_ids, structured outputs) are gathered and processed together; a step without such rows skips
that work entirely, so plain requests pay nothing for it. Greedy rows take the first maximum
(argmax_kernel.py; a step without random rows or logprobs does nothing else). Random rows are drawn by
inverting each row's CDF at one uniform number, so a per-request seed only decides that
row's single draw per step from its own generator, whatever else is in the batch (a row with
a top-k or top-p inverts the CDF of its few kept tokens, sorted by probability). Rows with
only a temperature (the API's default) are drawn by draw_kernel.py without writing the
probabilities: 1.28 against 2.45 ms for 64 rows of a 49,152-token vocabulary from memory on two
cores of an AMX Xeon. The torch path (softmax, then inverse_cdf) serves the other rows: 39 ms when
one float64 running sum spanned the vocabulary (see inverse_cdf), 68 ms with the exponential race
(argmax of probs / Exp(1) noise, V random numbers per row).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from vmkv import faults
from vmkv.engine.argmax_kernel import first_max_indices
from vmkv.engine.draw_kernel import CDF_BLOCK, draw_tokens
from vmkv.engine.logits_processors import LogitsProcessor
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.structured_output import GrammarState, apply_token_bitmask, new_token_bitmask

# A top-p row's nucleus is looked for among its tokens of at least 1/N of its mass, for each N
# in turn, then in the whole row. On SmolLM2's own distributions at temperature 1 and top_p 0.95
# the first held 91% of rows' nuclei (at most ~1,700 tokens), the second all of them.
NUCLEUS_TIERS = (16384, 262144)


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None  # None: the engine's shared stream
    token_ids: Sequence[int] = ()  # prompt + output so far: penalties and min_tokens read them
    prompt_len: int = 0
    grammar: GrammarState | None = None  # its structured-output matcher, advanced by the sampler
    thinking: bool = False  # not yet past params.end_of_thinking

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: top-k plus the sampled token, if asked


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        eos_token_ids: Collection[int] = (),
        custom: Sequence[LogitsProcessor] = (),
    ) -> None:
        """custom: the engine's own logits processors (logits_processors.py)."""
        # for rows without a seed of their own
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = sorted(eos_token_ids)  # masked, with stop_token_ids, until min_tokens
        self.custom = list(custom)
        self._faults = faults.active()  # None unless fault injection is on (vmkv/faults.py)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """logits: float32 [S, V], one row per entry of `rows`. Logprobs come from these raw
        logits; tokens from the processed ones. Rows with a grammar accept their token here."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows: one row each")
        if not rows:
            return SamplerOutput([], [])
        if self._faults is not None:
            self._faults.on_sample(rows)
        raw = logits
        custom = [[i for i, r in enumerate(rows) if p.applies_to(r.params)] for p in self.custom]
        processed = sorted({i for i, r in enumerate(rows) if r.params.processes_logits}.union(*custom))
        blocked: set[int] = set()
        if processed:
            logits = logits.clone()
            self._process(logits, rows, processed, custom)
            tokens = first_max_indices(logits)
            best_values = logits.gather(1, tokens[:, None])[:, 0].tolist()
            blocked = {i for i in processed if best_values[i] == float("-inf")}
            for i in blocked:
                tokens[i] = self._blocked_token(raw[i])
        elif any(r.params.greedy for r in rows):  # when every row draws: no argmax, no gather
            tokens = first_max_indices(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy and i not in blocked]
        if len(random_rows) == len(rows):
            tokens = self._sample(logits, rows)
        elif random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._sample(logits[index], [rows[i] for i in random_rows])
        token_ids = tokens.tolist()
        for i, row in enumerate(rows):
            if row.grammar is not None:
                row.grammar.accept(token_ids[i])
        return SamplerOutput(token_ids, self._logprobs(raw, rows, tokens))

    def _blocked_token(self, raw_logits: torch.Tensor) -> int:
        """The token for a row whose processors left nothing allowed (a grammar that is complete
        while min_tokens still masks end-of-sequence, or one that allows nothing): end-of-sequence,
        which ends the sample, or the raw argmax for a model without one; never an id past the
        vocabulary, which a draw from an all -inf row would give."""
        return self.eos_token_ids[0] if self.eos_token_ids else int(raw_logits.argmax())

    # ------------------------------------------------------------------ logits processors
    def _process(
        self, logits: torch.Tensor, rows: list[SampleRow], processed: list[int], custom: list[list[int]]
    ) -> None:
        """Apply, in place and in this order, allowed_token_ids, the grammar masks, the min_tokens
        and bad_words masks, logit_bias and the penalties of the `processed` rows (vLLM's order:
        masks and biases, then penalties), then each custom processor to the rows in its list of
        `custom`, and last a spent thinking budget's forced token."""
        for i in processed:
            allowed = rows[i].params.allowed_token_ids
            if allowed is not None:
                index = torch.tensor(allowed, device=logits.device)
                kept = logits[i, index]
                logits[i].fill_(float("-inf"))
                logits[i, index] = kept
        grammar_rows = [i for i in processed if rows[i].grammar is not None]
        if grammar_rows:
            bitmask = new_token_bitmask(len(grammar_rows), logits.shape[1])
            for j, i in enumerate(grammar_rows):
                rows[i].grammar.fill(bitmask, j)
            apply_token_bitmask(logits, bitmask, torch.tensor(grammar_rows, device=logits.device))
        # (row, token) pairs to mask or bias: a few per row, never the vocabulary
        mask_rows, mask_tokens = [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        penalized = []
        for i in processed:
            row, params = rows[i], rows[i].params
            if row.num_output < params.min_tokens:
                stops = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
                mask_rows += [i] * len(stops)
                mask_tokens += stops
            if params.bad_words_token_ids:
                banned = _banned_next_tokens(params.bad_words_token_ids, row.token_ids[row.prompt_len :])
                mask_rows += [i] * len(banned)
                mask_tokens += banned
            if params.logit_bias:
                bias_rows += [i] * len(params.logit_bias)
                bias_tokens += params.logit_bias.keys()
                bias_values += params.logit_bias.values()
            if params.penalized:
                penalized.append(i)
        device = logits.device
        if mask_rows:
            logits[torch.tensor(mask_rows, device=device), torch.tensor(mask_tokens, device=device)] = float(
                "-inf"
            )
        if bias_rows:
            logits.index_put_(
                (torch.tensor(bias_rows, device=device), torch.tensor(bias_tokens, device=device)),
                torch.tensor(bias_values, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        if penalized:
            _apply_penalties(logits, rows, penalized)
        for processor, indices in zip(self.custom, custom, strict=True):
            if indices:
                index = torch.tensor(indices, device=device)
                part = logits[index]
                processor.apply(part, [rows[i] for i in indices])
                logits[index] = part
        for i in processed:  # last: a spent thinking budget overrides every other processor
            forced = _thinking_end_token(rows[i])
            if forced is not None:
                logits[i].fill_(float("-inf"))
                logits[i, forced] = 0.0

    # ------------------------------------------------------------------------- sampling
    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        draw = {"dtype": torch.float64, "device": logits.device}
        uniform = torch.rand(len(rows), 1, generator=self.generator, **draw)
        for i, row in enumerate(rows):  # one number per seeded row, from its own stream
            if row.generator is not None:
                uniform[i] = torch.rand(1, generator=row.generator, **draw)
        temperature = [r.params.temperature for r in rows]
        min_p = [r.params.min_p for r in rows]
        vocab = logits.shape[1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        cut = [i for i in range(len(rows)) if top_k[i] < vocab or top_p[i] < 1.0]
        if not cut and not any(min_p):  # plain temperature rows: no [S, V] tensor written
            tokens = draw_tokens(logits, temperature, uniform)
            if tokens is not None:
                return tokens
        if any(t != 1.0 for t in temperature):  # 1.0 is the API's default: skip a [S, V] pass
            logits = logits / torch.tensor(temperature, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        probs = logits.softmax(dim=-1)  # this step's own tensor: filters change it in place
        # A tiny temperature or repetition penalty (5e-324 is a float > 0) can overflow a logit
        # to +inf, which makes its whole row NaN: there the largest logits share the mass.
        overflowed = probs[:, 0].isnan()
        if overflowed.any():
            probs[overflowed] = logits[overflowed].clamp(max=torch.finfo(logits.dtype).max).softmax(dim=-1)
        if any(min_p):
            _mask_min_p(probs, min_p)
        if len(cut) == len(rows):
            return _draw_top_k_top_p(probs, top_k, top_p, uniform)
        # every row, the cut ones overwritten below: 0.2 ms for 64 x 49,152, against 0.6 ms to
        # copy out half the rows and draw only those
        tokens = inverse_cdf(probs, uniform)
        if cut:
            index = torch.tensor(cut, device=probs.device)
            tokens[index] = _draw_top_k_top_p(
                probs[index], [top_k[i] for i in cut], [top_p[i] for i in cut], uniform[index]
            )
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor
    ) -> list[dict[int, float] | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[dict[int, float] | None] = [None] * len(rows)
        if not wanted:
            return out
        index = torch.tensor(wanted, device=logits.device)
        logprobs = logits[index].log_softmax(dim=-1)
        k = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(k, dim=-1)
        chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            listed = rows[i].params.logprob_token_ids
            if listed is not None:  # these tokens' logprobs instead of the k most likely
                entry = dict(zip(listed, logprobs[j, listed].tolist(), strict=True))
            else:
                n = rows[i].params.logprobs
                entry = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True))
            entry[int(tokens[i])] = chosen[j]
            out[i] = entry
        return out


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds uniform x the row's total.

    Running sums are float64 (fp32 ones drift by up to ~V ulps over a 49k vocabulary), but
    never over the whole vocabulary: a float64 cumsum of 64 x 49,152 took 19 ms on two cores,
    half of that step's whole 39 ms draw. So two levels: a float64 running sum over the fp32
    sums of CDF_BLOCK-token blocks finds the block, a float64 cumsum inside that one block finds
    the token.
    """
    num_rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(num_rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # a block's fp32 sum: 256 terms
    total = block_cdf[:, -1:].contiguous()
    target = uniform * total
    # the first block whose cdf exceeds the target has mass > 0; rounding can only push the
    # target up to the total itself, so cap at the last block with mass (likewise for tokens)
    block = torch.minimum(
        torch.searchsorted(block_cdf, target, right=True), torch.searchsorted(block_cdf, total)
    )
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(num_rows, device=probs.device), block.squeeze(1)].cumsum(
        dim=-1, dtype=torch.float64
    )
    token = torch.minimum(
        torch.searchsorted(inner, target - before, right=True),
        torch.searchsorted(inner, inner[:, -1:].contiguous()),
    )
    return (block * CDF_BLOCK + token).squeeze(1)


def _thinking_end_token(row: SampleRow) -> int | None:
    """The end-of-thinking token a row whose thinking budget is spent must take next: the one
    after the longest start of the end sequence its output already ends with."""
    params = row.params
    if params.thinking_budget is None or not row.thinking or row.num_output < params.thinking_budget:
        return None
    end, output = params.end_of_thinking, row.token_ids[row.prompt_len :]
    done = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or list(output[-k:]) == end[:k])
    return end[done]


def _banned_next_tokens(words: list[list[int]], output: Sequence[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output (a one-token word is
    always banned), as vLLM's bad_words processor decides."""
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix <= len(output) and (prefix == 0 or list(output[-prefix:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def _apply_penalties(logits: torch.Tensor, all_rows: list[SampleRow], penalized: list[int]) -> None:
    """vLLM's penalties: repetition over prompt + output (divide positive logits, multiply
    negative ones), then frequency (x count) and presence (once) over the output, as OpenAI
    defines them.

    Only the logits of tokens a row has seen change, so the work is on flat indices
    (row x V + token) of the rows' histories, never on [P, V] count tensors: 64 rows of 600
    tokens took 54 ms with dense counts over a 49,152-token vocabulary, 12 ms this way. Changes
    the `penalized` rows of `logits` in place.
    """
    device, vocab = logits.device, logits.shape[1]
    rows = [all_rows[i] for i in penalized]
    row_starts = torch.tensor(penalized, device=device) * vocab
    outputs = [r.token_ids[r.prompt_len :] for r in rows]
    prompts = [r.token_ids[: r.prompt_len] for r in rows]
    flat = logits.view(-1)

    def positions(parts: list[Sequence[int]]) -> torch.Tensor:
        """Flat indices of every token of every row, repeats kept."""
        tokens = torch.tensor([t for part in parts for t in part], dtype=torch.long, device=device)
        lengths = torch.tensor([len(part) for part in parts], device=device)
        return torch.repeat_interleave(row_starts, lengths) + tokens

    def per_row(values: list[float], index: torch.Tensor) -> torch.Tensor:
        """Each flat index's row's value (`values` in `penalized` order)."""
        by_row = torch.zeros(len(all_rows), dtype=logits.dtype, device=device)
        by_row[row_starts // vocab] = torch.tensor(values, dtype=logits.dtype, device=device)
        return by_row[index // vocab]

    in_output = positions(outputs)
    seen = torch.cat([positions(prompts), in_output]).unique()
    repetition = per_row([r.params.repetition_penalty for r in rows], seen)
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / repetition, values * repetition)
    flat.index_add_(0, in_output, -per_row([r.params.frequency_penalty for r in rows], in_output))
    once = in_output.unique()
    flat.index_add_(0, once, -per_row([r.params.presence_penalty for r in rows], once))


def _mask_min_p(probs: torch.Tensor, min_p: list[float]) -> None:
    """Zero, in place, every token less likely than min_p x its row's most likely token."""
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(
        min_p, dtype=probs.dtype, device=probs.device
    ).unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


def _draw_top_k_top_p(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], uniform: torch.Tensor
) -> torch.Tensor:
    """One token per row of `probs` (softmax, min-p already applied), drawn at `uniform` from the
    row's top-k and top-p nucleus renormalized: only the few tokens a row can draw are sorted,
    never the vocabulary (see top_k_top_p_windows)."""
    tokens = torch.empty(len(top_k), dtype=torch.long, device=probs.device)
    for rows, values, ids in top_k_top_p_windows(probs, top_k, top_p):
        tokens[rows] = ids.gather(1, inverse_cdf(values, uniform[rows]).unsqueeze(1)).squeeze(1)
    return tokens


def top_k_top_p_windows(
    probs: torch.Tensor, top_k: list[int], top_p: list[float]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yields (rows, probabilities, token ids) per group of rows: each row's most likely tokens
    sorted, at 0 those outside its top-k and its top-p nucleus (top-p over the top-k
    renormalized, as vLLM does). A top_k at the vocabulary size means none; every row has a
    top-k or a top-p below 1.

    Rows with a top-k take a `topk` as wide as the largest one. A row with a top-p alone takes
    its tokens of at least 1/N of its mass for N in NUCLEUS_TIERS (at most N of them, so the
    sort is short): they lead its sorted order, so when their mass reaches top_p they hold the
    nucleus; a flatter row is sorted whole. For 64 of SmolLM2's own distributions on two cores,
    temperature 0.7 and top_p 0.9 drew in 8 ms; 32 ms when every row was sorted by a `topk` of
    1,024 and the result scattered back over the vocabulary; a whole-row sort takes 114 ms.
    """
    vocab, device = probs.shape[1], probs.device
    k = torch.tensor(top_k, device=device)
    p = torch.tensor([x if x < 1.0 else 2.0 for x in top_p], dtype=torch.float64, device=device)  # 1: all
    by_k = [i for i, kk in enumerate(top_k) if kk < vocab]
    if by_k:
        rows = torch.tensor(by_k, device=device)
        values, ids = _rows(probs, by_k).topk(max(top_k[i] for i in by_k), dim=-1)
        yield rows, _nucleus(values, k[rows], p[rows]), ids
    alone = [i for i, kk in enumerate(top_k) if kk == vocab]
    if not alone:
        return
    rows = torch.tensor(alone, device=device)
    candidates = _rows(probs, alone)
    total = candidates.sum(dim=-1).double()  # a float64 sum would first copy [S, V] to float64
    for tier in NUCLEUS_TIERS:
        values, ids, held = _likeliest(candidates, total, tier)
        complete = held >= p[rows] * total
        if bool(complete.any()):
            done = rows[complete]
            yield done, _nucleus(values[complete], k[done], p[done], total[complete]), ids[complete]
        if bool(complete.all()):
            return
        rows, candidates, total = rows[~complete], candidates[~complete], total[~complete]
    values, ids = candidates.sort(dim=-1, descending=True)  # the flattest rows: sorted whole
    yield rows, _nucleus(values, k[rows], p[rows], total), ids


def _rows(probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """probs' `rows`, copied only when they are not all of them."""
    return probs if len(rows) == probs.shape[0] else probs[torch.tensor(rows, device=probs.device)]


def _likeliest(
    probs: torch.Tensor, total: torch.Tensor, tier: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the tokens with at least 1/tier of its `total` mass (at most `tier` of them):
    their probabilities sorted (padded with 0), their ids, and their mass."""
    num_rows = probs.shape[0]
    row, token = (probs >= (total / tier).to(probs.dtype).unsqueeze(1)).nonzero(as_tuple=True)
    values = probs[row, token]
    held = torch.zeros(num_rows, dtype=torch.float64, device=probs.device).index_add_(0, row, values.double())
    counts = torch.bincount(row, minlength=num_rows)
    column = torch.arange(len(row), device=probs.device) - (counts.cumsum(0) - counts)[row]
    width = int(counts.max()) if len(row) else 1
    window = torch.zeros(num_rows, width, dtype=probs.dtype, device=probs.device)
    window[row, column] = values
    ids = torch.zeros(num_rows, width, dtype=torch.long, device=probs.device)
    ids[row, column] = token
    window, order = window.sort(dim=-1, descending=True, stable=True)
    return window, ids.gather(1, order), held


def _nucleus(
    values: torch.Tensor, k: torch.Tensor, p: torch.Tensor, total: torch.Tensor | None = None
) -> torch.Tensor:
    """values: each row's likeliest tokens' probabilities, sorted; k: its top-k (the vocabulary
    size for none); p: its top-p (above 1 for none); total: the mass top-p is a fraction of
    (None: that of its top-k, which `values` holds). Returns the values with the tokens outside
    the top-k and the nucleus at 0."""
    ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    values = values.masked_fill(ranks >= k.unsqueeze(1), 0.0)
    mass = values.cumsum(dim=-1, dtype=torch.float64)
    norm = mass[:, -1] if total is None else total
    # the top token always stays, even for a top_p that rounds to 0 in this dtype
    return values.masked_fill((mass - values >= (p * norm).unsqueeze(1)) & (ranks > 0), 0.0)
