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


# Runtime sizes are not specialised on: one compiled kernel for every batch size and vocabulary slice.
@triton.jit(do_not_specialize=["vocab", "seed", "chunk", "num_chunks", "col_offset", "noise_vocab"])
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, val_ptr, idx_ptr, vocab, chunk, seed, eps, num_chunks,
                          col_offset, noise_vocab, BLOCK: tl.constexpr):
    """Program (row, c) scans chunk c of the row's first ``vocab`` columns: its best perturbed value and
    index. The columns are vocabulary ids ``col_offset`` on (a tensor-parallel rank's slice), whose noise
    is keyed by the id in a vocabulary of ``noise_vocab``: a slice draws what the whole row would."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    inv_t = tl.where(t < eps, 1.0, 1.0 / t)
    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        u = tl.rand(seed, row * noise_vocab + col_offset + offs)
        g = -tl.log(-tl.log(u))
        x = tl.where(t >= eps, tl.where(mask, x + g, x), x)
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)
    tl.store(val_ptr + row * num_chunks + c, top)
    tl.store(idx_ptr + row * num_chunks + c, idx + col_offset)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, eps: float = 1e-5, block: int = 1024,
                  num_chunks: int | None = None) -> torch.Tensor:
    """Sampled token per row of ``logits`` [B, V] at ``temperature`` [B] (0: greedy).

    Each row's vocabulary is cut into chunks scanned in parallel (a few rows alone would
    leave most of the GPU idle); the chunk winners are reduced with one argmax, which keeps
    the first index among equal values, so greedy ties resolve like ``torch.argmax``."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # CPU generator: no device sync
    return pick(*gumbel_partials(logits, temperature, seed, eps=eps, block=block, num_chunks=num_chunks))


def gumbel_partials(logits: torch.Tensor, temperature: torch.Tensor, seed: int, *, eps: float = 1e-5,
                    block: int = 1024, num_chunks: int | None = None, valid: int | None = None, col_offset: int = 0,
                    noise_vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's chunk winners over the first ``valid`` columns of ``logits`` (all by default), those
    columns being vocabulary ids ``col_offset`` on of a ``noise_vocab``-token vocabulary (the row's
    own width by default): values [B, chunks] float32, ids [B, chunks] int32, chunks in id order."""
    rows, width = logits.shape
    vocab = width if valid is None else valid
    assert logits.stride(1) == 1 and 0 <= vocab <= width
    if num_chunks is None:
        # by the width, not ``valid``: every rank's slice then has as many chunks (their winners are gathered)
        num_chunks = max(1, min(32, triton.next_power_of_2(max(1, 2048 // max(rows, 1))), triton.cdiv(width, block)))
    chunk = max(1, triton.cdiv(triton.cdiv(vocab, num_chunks), block)) * block
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows, num_chunks)](logits, logits.stride(0), temperature.to(torch.float32), vals, idxs,
                                                  vocab, chunk, seed, eps, num_chunks, col_offset,
                                                  width if noise_vocab is None else noise_vocab, BLOCK=block,
                                                  num_warps=4)
    return vals, idxs


def pick(vals: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
    """The id of each row's best chunk winner (the first among equal values: the lowest id), int64."""
    best = vals.argmax(dim=1, keepdim=True)
    return idxs.gather(1, best).squeeze(1).to(torch.int64)
