"""Sampler: one pass over the whole batch's logits, on the device that holds them."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from pagedllm.ops import triton_ops_for
from pagedllm.sample.draw import draw, greedy
from pagedllm.sample.sharded import VocabShard, sharded_gumbel_sample

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step (row = one request that samples this step)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None  # [B]
    top_k: torch.Tensor | None = None  # [B] long, vocab size where disabled
    min_p: torch.Tensor | None = None  # [B]
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows only
    max_num_logprobs: int | None = None  # None = no row wants logprobs
    # Penalties: None when no row uses them.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None  # [B, P] padded with vocab_size
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Rarely used per-row edits, applied in Python row by row.
    allowed_token_ids_mask: torch.Tensor | None = None  # [B, V] bool, True = banned
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)  # bad words, min_tokens
    logits_processors: dict[int, tuple[list[Callable], list[int]]] = field(default_factory=dict)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    # When logprobs were asked for: candidate ids [B, 1+K] (sampled first), their
    # logprobs [B, 1+K] and ranks [B, 1+K].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


def compute_logprobs_with_ranks(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row: the given token and the ``num_top`` most likely, with ranks (1 = best)."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        lps = torch.cat([chosen, top_lp], dim=1)
    else:
        ids, lps = token_ids[:, None], chosen
    chosen_rank = (logprobs > chosen).sum(-1, keepdim=True) + 1
    top_ranks = torch.arange(1, num_top + 1, device=logprobs.device).expand(ids.shape[0], num_top)
    return ids, lps, torch.cat([chosen_rank, top_ranks], dim=1)


class Sampler:
    def __call__(self, logits: torch.Tensor | VocabShard, md: SamplingMetadata) -> SamplerOutput:
        """``logits`` [B, V], or this tensor-parallel rank's slice of them (gathered unless the batch
        samples with temperature only on CUDA: ``sample/sharded.py``)."""
        if isinstance(logits, VocabShard):
            if self._only_temperature(md) and triton_ops_for(logits.local) is not None:
                return SamplerOutput(sharded_gumbel_sample(logits, md.temperature))
            logits = logits.gather()
        if self._only_temperature(md):
            if triton_ops_for(logits) is not None:  # CUDA, kernels enabled
                from pagedllm.sample.triton_sampler import gumbel_sample

                return SamplerOutput(gumbel_sample(logits, md.temperature))
            if md.all_greedy:
                # bfloat16 -> float32 is exact: the argmax (ties and NaNs alike) is the same token without
                # the upcast, which took ~2 ms a step for 32 x 49,152 logits in a CPU decode step.
                return SamplerOutput(greedy(logits))
        logits = logits.to(torch.float32)
        # Logprobs are reported for the model's raw distribution, as vLLM does by default.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        logits = self._apply_row_edits(logits, md)
        logits = self._apply_penalties(logits, md)
        sampled = self._sample(logits, md)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            k = raw_logprobs.shape[-1] if md.max_num_logprobs < 0 else md.max_num_logprobs
            out.logprob_token_ids, out.logprobs, out.ranks = compute_logprobs_with_ranks(raw_logprobs, sampled, k)
        return out

    @staticmethod
    def _apply_row_edits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        for row, (procs, prompt_ids) in md.logits_processors.items():
            output_ids = md.output_token_ids[row]
            for proc in procs:
                # vLLM's two signatures: (output_ids, logits) or (prompt_ids, output_ids, logits).
                if _takes_prompt(proc):
                    logits[row] = proc(prompt_ids, output_ids, logits[row])
                else:
                    logits[row] = proc(output_ids, logits[row])
        for row, bias in md.logit_bias.items():
            ids = torch.tensor(list(bias.keys()), device=logits.device)
            logits[row, ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        for row, ids in md.banned_token_ids.items():
            logits[row, ids] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.repetition_penalties is None and md.frequency_penalties is None and md.presence_penalties is None:
            return logits
        b, vocab = logits.shape
        max_out = max((len(o) for o in md.output_token_ids), default=0)
        out_ids = torch.full((b, max(max_out, 1)), vocab, dtype=torch.long)
        for row, ids in enumerate(md.output_token_ids):
            if ids:
                out_ids[row, :len(ids)] = torch.tensor(ids)
        out_ids = out_ids.to(logits.device)
        counts = torch.zeros(b, vocab + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        if md.repetition_penalties is not None:
            seen = counts > 0
            if md.prompt_token_ids is not None:
                prompt_seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=logits.device)
                prompt_seen.scatter_(1, md.prompt_token_ids, True)
                seen |= prompt_seen[:, :vocab]
            rp = md.repetition_penalties[:, None].expand_as(logits)
            penalized = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(seen, penalized, logits)
        if md.frequency_penalties is not None:
            logits = logits - md.frequency_penalties[:, None] * counts
        if md.presence_penalties is not None:
            logits = logits - md.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _only_temperature(md: SamplingMetadata) -> bool:
        """No row uses anything but temperature (and no seeds, no logprobs)."""
        return (md.max_num_logprobs is None and not md.generators and md.top_p is None and md.top_k is None
                and md.min_p is None and md.presence_penalties is None and md.frequency_penalties is None
                and md.repetition_penalties is None and md.allowed_token_ids_mask is None and not md.logit_bias
                and not md.banned_token_ids and not md.logits_processors)

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, min-p, top-k and top-p
        applied (a greedy row's is its softmax at temperature 1; it samples by argmax)."""
        temperature = torch.where(md.temperature < _EPS, 1.0, md.temperature)
        logits = logits / temperature[:, None]
        if md.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * md.min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        return torch.softmax(logits, dim=-1)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return greedy(logits)
        greedy_ids = None if md.all_random else greedy(logits)
        # Seeded rows draw from their own generator, so their tokens do not depend on the batch.
        sampled = draw(self.probs(logits, md), md.generators)
        if md.all_random:
            return sampled
        return torch.where(md.temperature < _EPS, greedy_ids, sampled)


def _takes_prompt(proc: Callable) -> bool:
    try:
        return len(inspect.signature(proc).parameters) >= 3
    except (TypeError, ValueError):
        return False


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but the top-k tokens and the smallest set whose probability reaches p."""
    logits_sort, idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if k is not None:
        kth = logits_sort.gather(1, (vocab - k.clamp(1, vocab))[:, None])
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, logits_sort)
