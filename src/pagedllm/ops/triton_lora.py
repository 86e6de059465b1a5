"""Triton multi-LoRA for a few tokens (decode): each token gathers its own adapter's weights.

``shrink``: t[m] = A[slot[m]] @ x[m] (rank outputs, float32); ``expand``: y[m] += B[slot[m]] @ t[m].
One program per (token, block of outputs); a token whose slot is -1 (the base model) does
nothing. The slots are read on the device, so a step mixing adapters is two launches per
projection whatever the mix (Punica's BGMV idea). Prefill-sized batches take the grouped
torch path (a GEMM per adapter), where per-token programs would re-read the weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 64  # above this the grouped torch path is faster


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, t_ptr, K, R, stride_xm, stride_as, stride_ar, stride_tm,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    slot = tl.load(slot_ptr + m)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        a_row = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(a_row + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(t_ptr + m * stride_tm + r, acc, mask=r_ok)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, slot_ptr, y_ptr, N, R, stride_tm, stride_bs, stride_bn, stride_ym,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    m = tl.program_id(0)
    slot = tl.load(slot_ptr + m)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + n.to(tl.int64)[:, None] * stride_bn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < R
            b = tl.load(b_rows + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            t = tl.load(t_ptr + m * stride_tm + r, mask=r_ok, other=0.0)
            acc += tl.sum(b.to(tl.float32) * t[None, :], axis=1)
        y_ptrs = y_ptr + m * stride_ym + n
        y = tl.load(y_ptrs, mask=n_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
               ) -> torch.Tensor:
    """``y[m] += B[s] @ (A[s] @ x[m])`` with s = ``token_slots[m]`` (-1: nothing), in place.
    ``x`` [M, K], ``y`` [M, N] (rows contiguous), ``a`` [slots, R, K], ``b`` [slots, N, R]."""
    m, k = x.shape
    r, n = a.shape[1], y.shape[1]
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_apply needs rows with unit stride")
    t = torch.empty(m, r, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r))
    _shrink_kernel[(m, triton.cdiv(r, block_r))](x, a, token_slots, t, k, r, x.stride(0), a.stride(0), a.stride(1),
                                                  t.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    _expand_kernel[(m, triton.cdiv(n, 128))](t, b, token_slots, y, n, r, t.stride(0), b.stride(0), b.stride(1),
                                            y.stride(0), BLOCK_N=128, BLOCK_R=block_r)
    return y
