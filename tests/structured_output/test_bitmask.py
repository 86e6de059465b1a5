"""The logits bitmask: torch path against a per-token reference, the Triton kernel (interpreter
on CPU) against the torch path; untouched rows stay bit-identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.structured_output.bitmask import apply_grammar, apply_token_bitmask, expand_bitmask
from pagedllm.structured_output.manager import GrammarBitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_case(seed: int, batch: int, vocab: int, rows: list[int], extra_words: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    words = -(-vocab // 32) + extra_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # all 32 allowed (the sign bit too)
    if len(rows) > 1:
        bitmask[1, :] = 0  # a row that allows nothing
    return logits, bitmask, rows


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.numpy().astype(np.int64) & 0xFFFFFFFF
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[i, t // 32] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,extra_words", [(97, 0), (128, 0), (70, 2)])  # ragged last word; a wider mask
def test_torch_path_matches_the_per_token_reference(vocab, extra_words):
    logits, bitmask, rows = _random_case(0, 5, vocab, [3, 0, 4], extra_words)
    expected = _reference(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask.numpy(), rows)
    assert torch.equal(logits, expected)
    assert torch.equal(logits[[1, 2]], expected[[1, 2]])  # unconstrained rows untouched
    assert torch.isinf(logits[0]).all()  # bitmask row 1 allowed nothing


def test_expand_bitmask_bit_order():
    bm = torch.tensor([[1 - 2**31, 2]], dtype=torch.int32)  # bits 0 and 31 of word 0, bit 1 of word 1
    allowed = expand_bitmask(bm, 40)[0].nonzero().flatten().tolist()
    assert allowed == [0, 31, 33]


def test_apply_grammar_maps_request_ids_to_sampled_rows():
    logits = torch.zeros(3, 64)
    bm = np.zeros((2, 2), dtype=np.int32)
    bm[0, 0] = 1 << 5  # "b" may only say token 5
    bm[1, 1] = 1 << 2  # "gone" (not sampling this step): ignored
    apply_grammar(logits, GrammarBitmask(["b", "gone"], bm), ["a", "b", "c"])
    assert torch.isfinite(logits[[0, 2]]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_torch(triton_bitmask, dtype):
    block = 1024 if DEVICE == "cuda" else 64
    for vocab, extra in ((97, 0), (300, 1)):
        logits, bitmask, rows = _random_case(1, 6, vocab, [5, 2, 0, 3], extra)
        logits = logits.to(dtype)
        expected = logits.clone()
        apply_token_bitmask(expected, bitmask, rows)  # the torch path (CPU tensors)
        got = logits.to(DEVICE)
        triton_bitmask.apply_bitmask_triton(got, bitmask.to(DEVICE), torch.tensor(rows, device=DEVICE), block=block)
        assert torch.equal(got.cpu(), expected)
    # A row stride wider than the vocabulary (a slice of a larger buffer).
    base = torch.randn(4, 80, dtype=dtype)
    view = base[:, :70]
    bm = torch.zeros(1, 3, dtype=torch.int32)
    bm[0, 1] = 1 << 4  # only token 36
    ref = view.clone()
    apply_token_bitmask(ref, bm, [2])
    got = base.to(DEVICE)
    triton_bitmask.apply_bitmask_triton(got[:, :70], bm.to(DEVICE), torch.tensor([2], device=DEVICE), block=block)
    assert torch.equal(got[:, :70].cpu(), ref) and torch.equal(got[:, 70:].cpu(), base[:, 70:])
