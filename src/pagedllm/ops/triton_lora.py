"""Triton multi-LoRA: one shrink and one expand launch per projection, for any mix of adapters.

The step's tokens that run an adapter are sorted by adapter slot once (``sort_by_slot``, on the
host) and padded into tiles of ``BLOCK_M`` tokens of one slot each (the segmented GEMM of
Punica / S-LoRA, the token alignment of fused MoE). ``shrink``: t[m] = x[m] @ A[s]^T (rank
outputs, float32); ``expand``: y[m] += t[m] @ B[s]^T, tile by tile on the tensor cores. Tokens
of the base model are in no tile: their rows are not touched.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 32


def sort_by_slot(token_slots: np.ndarray, block_m: int = BLOCK_M) -> tuple[np.ndarray, np.ndarray]:
    """(token ids sorted by slot, each slot's run padded with -1 to a multiple of ``block_m``;
    the slot of each tile of ``block_m``). Tokens with slot -1 are left out."""
    ids, tiles = [], []
    for slot in np.unique(token_slots[token_slots >= 0]):
        rows = np.flatnonzero(token_slots == slot)
        n_tiles = -(-len(rows) // block_m)
        padded = np.full(n_tiles * block_m, -1, dtype=np.int64)
        padded[:len(rows)] = rows
        ids.append(padded)
        tiles.append(np.full(n_tiles, slot, dtype=np.int64))
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(ids), np.concatenate(tiles)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ids_ptr, tile_slot_ptr, t_ptr, K, R, stride_xm, stride_as, stride_ar, stride_tm,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    ids = tl.load(ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ids = tl.where(slot >= 0, ids, -1)  # a tile of slot -1: padding of a CUDA graph's fixed grid
    m_ok = ids >= 0
    slot = tl.maximum(slot, 0)
    rows = tl.where(m_ok, ids, 0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(a.dtype), a, acc)
    tl.store(t_ptr + rows[:, None] * stride_tm + r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, ids_ptr, tile_slot_ptr, y_ptr, N, R, stride_tm, stride_bs, stride_bn, stride_ym,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    ids = tl.load(ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ids = tl.where(slot >= 0, ids, -1)
    m_ok = ids >= 0
    slot = tl.maximum(slot, 0)
    rows = tl.where(m_ok, ids, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        t = tl.load(t_ptr + rows[:, None] * stride_tm + r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n.to(tl.int64)[None, :] * stride_bn + r[:, None],
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(t.to(b.dtype), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(t.to(b.dtype), b, acc)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def max_tiles(num_tokens: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """The tiles ``num_tokens`` tokens over ``num_slots`` adapters can need (a CUDA graph's grid)."""
    return -(-num_tokens // block_m) + num_slots


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
               tile_slots: torch.Tensor) -> torch.Tensor:
    """``y[m] += (x[m] @ A[s]^T) @ B[s]^T`` for every token m in ``sorted_ids`` (``sort_by_slot``),
    s its tile's slot; in place. ``x`` [M, K], ``y`` [M, N], ``a`` [slots, R, K], ``b`` [slots, N, R]."""
    m, k = x.shape
    r, n = a.shape[1], y.shape[1]
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_apply needs rows with unit stride")
    num_tiles = tile_slots.shape[0]
    if num_tiles == 0:
        return y
    ieee = a.dtype == torch.float32
    t = torch.empty(m, r, dtype=torch.float32, device=x.device)
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    _shrink_kernel[(num_tiles, triton.cdiv(r, block_r))](
        x, a, sorted_ids, tile_slots, t, k, r, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64)
    _expand_kernel[(num_tiles, triton.cdiv(n, 64))](
        t, b, sorted_ids, tile_slots, y, n, r, t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_R=block_r)
    return y
