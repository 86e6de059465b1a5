"""One-pass sampling on CUDA for the common case (temperature only, nothing else per row).

Gumbel-max: ``argmax(logits / T + G)`` with ``G = -log(-log U)`` draws from
``softmax(logits / T)``, so one read of the logits (in the model's dtype) replaces the
cast, divide, softmax, noise, divide and argmax passes of the general path. Rows with
temperature 0 take the plain argmax (first index among ties, like ``torch.argmax``).
The noise is Philox (``tl.rand``) keyed by a per-step seed drawn from torch's CPU
generator, so ``torch.manual_seed`` still governs unseeded sampling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["vocab", "seed"])
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, out_ptr, vocab, seed, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    inv_t = tl.where(t < eps, 1.0, 1.0 / t)
    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        u = tl.rand(seed, row * vocab + offs)
        g = -tl.log(-tl.log(u))
        x = tl.where(t >= eps, tl.where(mask, x + g, x), x)
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, eps: float = 1e-5, block: int = 2048
                  ) -> torch.Tensor:
    """Sampled token per row of ``logits`` [B, V] at ``temperature`` [B] (0: greedy)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    assert logits.stride(1) == 1
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # CPU generator: no device sync
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperature.to(torch.float32), out, vocab, seed, eps,
                                   BLOCK=block, num_warps=8)
    return out
