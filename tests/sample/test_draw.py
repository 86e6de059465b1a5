"""Drawing tokens from probabilities (sample/draw.py): both ways sample the distribution, never
a token of probability zero, and seeded rows do not depend on the batch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.sample.draw import BLOCK, _inverse_cdf, _race, draw, greedy
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

VOCAB = 2 * BLOCK + 188  # not a whole number of blocks: the last one is padded


def _distribution(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(VOCAB, generator=g) ** 4  # uneven
    p[torch.rand(VOCAB, generator=g) < 0.4] = 0
    p[:BLOCK] = 0  # a whole block without mass
    p[-1] = 0
    p[BLOCK + 7] = 1e-7  # a rare token with mass of its own
    return p / p.sum()


@pytest.mark.parametrize("fn", [_inverse_cdf, _race], ids=["inverse_cdf", "race"])
def test_samples_the_distribution(fn):
    p = _distribution()
    rows = 100_000
    torch.manual_seed(1)
    tokens = fn(p.expand(rows, VOCAB).contiguous(), {})
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[p == 0].sum() == 0
    expected = p.double() * rows
    some = expected > 5  # Pearson's test over the tokens expected often enough
    chi2 = ((counts[some] - expected[some]) ** 2 / expected[some]).sum().item()
    dof = int(some.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


def test_seeded_rows_do_not_depend_on_the_batch():
    p = _distribution(3)

    def seeded(rows: int, at: int) -> int:
        batch = p.expand(rows, VOCAB).contiguous()
        return int(draw(batch, {at: torch.Generator().manual_seed(1234)})[at])

    firsts = {seeded(rows, at) for rows, at in [(1, 0), (5, 2), (9, 8)]}
    assert len(firsts) == 1
    picks = {int(draw(p[None].clone(), {0: torch.Generator().manual_seed(s)})[0]) for s in range(40)}
    assert len(picks) > 5  # and different seeds draw different tokens


def test_point_masses_and_empty_rows():
    p = torch.zeros(3, VOCAB)
    p[0, 5] = 1.0
    p[1, VOCAB - 2] = 0.25  # mass only in the padded block
    tokens = _inverse_cdf(p, {})
    assert tokens[0] == 5 and tokens[1] == VOCAB - 2
    assert 0 <= tokens[2] < VOCAB  # a row without mass still gets an id in range


@pytest.mark.parametrize("vocab", [3 * BLOCK, 49152, 3 * BLOCK + 77, BLOCK + 1, BLOCK - 5])
def test_greedy_is_torch_argmax(vocab):
    """The blocked CPU argmax picks what torch.argmax picks: random rows, ties across and inside
    blocks (the first index wins), a maximum in the tail after the last whole block, -inf rows,
    and NaN (the first NaN wins, wherever it is)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g)
    x[1, [7, vocab - 1]] = 9.0  # a tie between the first block and the last column
    x[2, [BLOCK // 2, BLOCK // 2 + 1]] = 9.0  # a tie inside one block
    x[3, vocab - 1] = 9.0  # the last column alone (in the tail where there is one)
    x[4] = float("-inf")
    x[5, [3, vocab - 2]] = float("nan")
    x[6, vocab - 1] = float("nan")  # a NaN in the tail, a finite maximum before it
    x[7, [min(2 * BLOCK, vocab - 1), vocab - 3]] = float("inf")
    x[8, :] = 1.0  # all tied
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert torch.equal(greedy(x[:, :-1]), x[:, :-1].argmax(dim=-1))  # rows that are not contiguous
    assert greedy(x).dtype == torch.int64
    # The sampler's greedy rows skip the float32 upcast of half logits (it is exact): the same tokens.
    half = x.bfloat16()
    half[9, [11, vocab - 4]] = half[9].max() + 1  # ties that only exist after rounding to bfloat16
    md = SamplingMetadata(temperature=torch.zeros(12), all_greedy=True, all_random=False)
    assert torch.equal(Sampler()(half, md).sampled_token_ids, half.float().argmax(dim=-1))


def test_sampler_gathers_a_vocabulary_slice_where_the_batch_needs_whole_rows():
    """A tensor-parallel rank's logits slice (``VocabShard``, the last rank's padded with zeros) goes to the
    general path whole: logprobs over the real vocabulary, the padding never sampled or counted."""
    from pagedllm.sample.sharded import VocabShard

    torch.manual_seed(0)
    logits = torch.randn(3, 50) - 5.0
    shard = VocabShard(torch.cat([logits, torch.zeros(3, 2)], dim=1), 0, 50, 50)
    md = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False, max_num_logprobs=2)
    got, want = Sampler()(shard, md), Sampler()(logits, md)
    assert torch.equal(got.sampled_token_ids, logits.argmax(-1)) and torch.equal(got.logprobs, want.logprobs)
