"""One token per row drawn from a batch of distributions, the fast way for each device.

On the GPU: the exponential race (argmax of p / q with q ~ Exp(1): one fused pass). On the
CPU, torch's ``exponential_`` is slow (about 17 ms for 16 rows of a 49k vocabulary on two
cores, more than the rest of a small model's step), so rows are drawn by inverting their
cumulative distribution, in two levels for accuracy: a block of ``BLOCK`` tokens from the
blocks' masses, then a token inside the block. Each level draws its own uniform and
accumulates in float64 (a block's mass is a float32 sum of 256 terms), so a token's chance is
off by float32 rounding of its own block's mass at most, not of the whole vocabulary's, and a
token of probability zero is never drawn (a searched point u < cdf[-1] lands on the first
index whose cdf exceeds it, where the probability is positive). About 30x faster than the race
on the CPU at batch 16.

Seeded rows draw from their own generator, so their tokens do not depend on the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] → [B] int64: each row's argmax, the first index among ties and the first
    NaN where a row holds one, as ``torch.argmax``. torch's CPU argmax is not vectorized: 0.85 ms
    for 32 rows of a 49,152-token vocabulary on two cores, against 0.04 ms for ``amax``. So on the
    CPU each row's ``BLOCK``-token blocks are reduced with ``amax``, and argmax runs over the
    block maxima and inside the first block that holds the maximum: 0.09 ms there."""
    rows, vocab = logits.shape
    n = vocab // BLOCK
    if logits.device.type != "cpu" or n < 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    main = logits[:, :n * BLOCK].view(rows, n, BLOCK)
    block_max = main.amax(dim=-1)  # NaN where a block holds one (amax propagates it)
    block = block_max.argmax(dim=-1)  # the first block holding the row's maximum (or first NaN)
    ids = block * BLOCK + main[torch.arange(rows), block].argmax(dim=-1)
    if n * BLOCK < vocab:  # the tail after the last whole block wins only with a larger value (or a first NaN)
        tail = logits[:, n * BLOCK:]
        tail_max, best = tail.amax(dim=-1), block_max.gather(1, block[:, None]).squeeze(1)
        takes = (tail_max > best) | (tail_max.isnan() & ~best.isnan())
        ids = torch.where(takes, n * BLOCK + tail.argmax(dim=-1), ids)
    return ids


def draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``probs`` [B, V] (non-negative rows; may be overwritten) → [B] int64 token ids."""
    if probs.device.type != "cpu":
        return _race(probs, generators)
    return _inverse_cdf(probs, generators)


def _race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div_(q).argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    rows, vocab = probs.shape
    blocks = -(-vocab // BLOCK)
    padded = probs if blocks * BLOCK == vocab else F.pad(probs, (0, blocks * BLOCK - vocab))
    padded = padded.view(rows, blocks, BLOCK)
    u = torch.rand(rows, 2, dtype=torch.float64)
    for row, gen in generators.items():
        u[row] = torch.rand(2, generator=gen, dtype=torch.float64)
    block = _search(padded.sum(dim=-1).double().cumsum_(dim=-1), u[:, 0])
    inside = padded[torch.arange(rows), block]  # [B, BLOCK]
    token = _search(inside.cumsum(dim=-1, dtype=torch.float64), u[:, 1])
    return (block * BLOCK + token).clamp_(max=vocab - 1)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose ``cdf`` exceeds ``u * cdf[-1]`` (kept below ``cdf[-1]``)."""
    last = cdf[:, -1:]
    point = (u[:, None] * last).minimum(torch.nextafter(last, torch.zeros_like(last)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
