"""The one-pass Gumbel-max sampler (CUDA fast path) against torch: greedy rows identical to
argmax (ties to the first index), random rows distributed as softmax(logits / T). Runs in
Triton's interpreter without a GPU."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 2048 if DEVICE == "cuda" else 16  # the interpreter runs every lane in numpy: small tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_rows_are_argmax_with_first_index_on_ties(gumbel_sample, dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 301, dtype=torch.float32).to(dtype)
    logits[2, 17] = logits[2, 290] = 50.0  # a tie: the first index wins, as torch.argmax
    logits = logits.to(DEVICE)
    temp = torch.zeros(6, device=DEVICE)
    for chunks in (None, 1, 4):  # the tie spans chunks when there are several
        got = gumbel_sample(logits, temp, block=BLOCK, num_chunks=chunks)
        assert got.tolist() == logits.float().argmax(-1).tolist()
        assert got[2].item() == 17


def test_random_rows_follow_softmax_of_logits_over_temperature(gumbel_sample):
    torch.manual_seed(1)
    vocab, t = 6, 0.7
    rows = 20000 if DEVICE == "cuda" else 400  # the interpreter runs ~100 programs/s
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    logits = base.expand(rows, vocab).contiguous().to(DEVICE)
    temp = torch.full((rows,), t, device=DEVICE)
    temp[::10] = 0.0  # every 10th row greedy
    got = gumbel_sample(logits, temp, block=BLOCK).cpu()
    assert (got[::10] == 3).all()
    sampled = got[torch.arange(rows) % 10 != 0]
    freq = torch.bincount(sampled, minlength=vocab).float() / len(sampled)
    expect = torch.softmax(base / t, -1)
    assert (freq - expect).abs().max() < (0.015 if DEVICE == "cuda" else 0.1), (freq, expect)  # ~4 sigma
    # A fresh draw differs (the per-step seed comes from torch's generator).
    assert not torch.equal(gumbel_sample(logits, temp, block=BLOCK).cpu(), got)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocabulary_slices_pick_the_token_of_the_gathered_logits(monkeypatch, tp):
    """sample/sharded.py: each tensor-parallel rank scans its slice of the vocabulary (the last one padded
    with zero logits, as the LM head pads it) with the noise the whole row draws at those ids; the best of
    the gathered chunk winners is the token the one-pass sampler gives over the gathered logits, greedy
    ties across slices included (the lowest id)."""
    from pagedllm.sample import sharded
    from tests.triton_env import kernel_module

    tm = kernel_module("pagedllm.sample.triton_sampler", "_gumbel_argmax_kernel", monkeypatch)
    torch.manual_seed(2)
    rows, vocab = 5, 301
    logits = (torch.randn(rows, vocab) - 3.0).to(DEVICE)  # below the padding's zeros: they must not win
    logits[1, 17] = logits[1, 290] = 50.0
    temp = torch.tensor([0.8, 0.0, 1.0, 0.3, 0.0], device=DEVICE)
    want = tm.pick(*tm.gumbel_partials(logits, temp, 1234, block=BLOCK))
    per_rank = -(-vocab // tp)
    packed = []
    for rank in range(tp):
        start, end = min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)
        local = torch.zeros(rows, per_rank, device=DEVICE)
        local[:, :end - start] = logits[:, start:end]
        vals, idxs = tm.gumbel_partials(local, temp, 1234, block=BLOCK, valid=end - start, col_offset=start,
                                        noise_vocab=vocab)
        packed.append(sharded.pack(vals, idxs))
    got = sharded.pick_gathered(torch.cat(packed), rows)
    assert got.tolist() == want.tolist() and got[1].item() == 17
    assert (got < vocab).all() and got[[0, 2, 3]].tolist() != logits[[0, 2, 3]].argmax(-1).tolist()  # drawn
