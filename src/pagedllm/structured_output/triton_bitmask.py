"""Triton kernel: -inf on the logits of tokens a row's grammar bitmask disallows, for the constrained rows only."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, vocab,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)  # the i-th constrained row: bitmask row i, logits row rows[i]
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.load(bitmask_ptr + i * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                         block: int = _BLOCK) -> None:
    """``logits`` [B, V] (row stride any, unit column stride), ``bitmask`` [R, >= V/32] int32 and
    ``rows`` [R] int64 on the same device; edits ``logits`` in place."""
    assert logits.stride(-1) == 1 and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1
    vocab = logits.shape[-1]
    grid = (rows.shape[0], triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, BLOCK=block)
