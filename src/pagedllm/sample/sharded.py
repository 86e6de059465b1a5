"""Sampling from logits split over the tensor-parallel ranks, without gathering them.

Under tensor parallelism each rank's LM head computes one slice of the vocabulary. Gathering the
slices costs an all-gather of the whole [rows, vocab] logits, a concatenation and a full-vocabulary
pass per step (on 2x H200, llama3-8b at 32 rows: ~36 µs of NCCL, ~4 µs of copy and ~26 µs of
sampling, a step being ~3.5 ms). A batch that samples with temperature only (the one-pass Gumbel-max
sampler's case) needs just each row's best perturbed logit: every rank scans its own slice with the
noise the whole row would have drawn at those ids, the ranks exchange their chunk winners (8 bytes
per chunk), and each picks the best, the lowest id among equals: the token the gathered logits
would have given, bit for bit, on every rank. Anything else (logprobs, top-k/p, penalties, grammar
masks, drafts) gathers the slices first (``VocabShard.gather``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from pagedllm.distributed import tensor_model_parallel_all_gather


@dataclass(frozen=True)
class VocabShard:
    """This rank's logits slice: ``local`` [rows, vocab_per_rank], whose first ``valid`` columns are
    vocabulary ids ``start`` on (the rest pad the last rank's slice) of a ``vocab_size``-token vocabulary."""

    local: torch.Tensor
    start: int
    valid: int
    vocab_size: int

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> VocabShard:
        """The same slice with an elementwise ``fn`` applied (a logit soft cap)."""
        return replace(self, local=fn(self.local))

    def gather(self) -> torch.Tensor:
        """The full [rows, vocab_size] logits, on every rank."""
        return tensor_model_parallel_all_gather(self.local, dim=-1)[..., :self.vocab_size]


def sharded_gumbel_sample(shard: VocabShard, temperature: torch.Tensor) -> torch.Tensor:
    """``triton_sampler.gumbel_sample`` of the gathered logits, from this rank's slice (collective:
    every tensor-parallel rank calls it with the same rows and its own slice)."""
    from pagedllm.sample.triton_sampler import gumbel_partials, pick

    rows = shard.local.shape[0]
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=shard.local.device)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # the ranks' CPU generators agree, as the unsharded path needs
    vals, idxs = gumbel_partials(shard.local, temperature, seed, valid=shard.valid, col_offset=shard.start,
                                 noise_vocab=shard.vocab_size)
    return pick_gathered(tensor_model_parallel_all_gather(pack(vals, idxs), dim=0), rows)


def pack(vals: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
    """A rank's chunk winners as one int32 tensor [rows, 2 * chunks] (values as their bits): one all-gather."""
    return torch.cat([vals.view(torch.int32), idxs], dim=1)


def pick_gathered(gathered: torch.Tensor, rows: int) -> torch.Tensor:
    """The token of each row from every rank's ``pack`` stacked in rank order ([ranks * rows, 2 * chunks])."""
    from pagedllm.sample.triton_sampler import pick

    chunks = gathered.shape[1] // 2
    both = gathered.view(-1, rows, 2 * chunks).transpose(0, 1)  # [rows, ranks, 2 * chunks]: ranks in id order
    return pick(both[..., :chunks].reshape(rows, -1).view(torch.float32), both[..., chunks:].reshape(rows, -1))
