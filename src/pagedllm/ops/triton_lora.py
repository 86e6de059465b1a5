"""Triton multi-LoRA: one shrink and one expand launch per projection, for any mix of adapters.

The step's tokens that run an adapter are sorted by adapter slot once (``sort_by_slot``, on the
host) and padded into tiles of ``BLOCK_M`` tokens of one slot each (the segmented GEMM of
Punica / S-LoRA, the token alignment of fused MoE). ``shrink``: t[m] = x[m] @ A[s]^T (rank
outputs, float32); ``expand``: y[m] += t[m] @ B[s]^T, tile by tile on the tensor cores. Tokens
of the base model are in no tile: their rows are not touched.

Few tiles (decode steps) would leave the shrink one program per tile walking all of K (14,336
for a llama3-8b down projection), latency-bound: the shrink then splits K over ``split``
programs per tile, each writing float32 partial sums, and the expand adds the partials up as
it loads them (deterministic, no atomics, no zeroing launch).
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
def _shrink_kernel(x_ptr, a_ptr, ids_ptr, tile_slot_ptr, t_ptr, K, R, K_PER_SPLIT, stride_xm, stride_as, stride_ar,
                   stride_ts, stride_tm, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
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
    split = tl.program_id(2)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(a.dtype), a, acc)
    tl.store(t_ptr + split * stride_ts + rows[:, None] * stride_tm + r[None, :], acc,
             mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, ids_ptr, tile_slot_ptr, y_ptr, N, R, SPLIT, stride_ts, stride_tm, stride_bs,
                   stride_bn, stride_ym, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
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
        t_ptrs = t_ptr + rows[:, None] * stride_tm + r[None, :]
        t_mask = m_ok[:, None] & r_ok[None, :]
        t = tl.load(t_ptrs, mask=t_mask, other=0.0)
        for s in range(1, SPLIT):  # the shrink's partial sums over K
            t += tl.load(t_ptrs + s * stride_ts, mask=t_mask, other=0.0)
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


def split_k(num_tiles: int, r_blocks: int, m: int, n: int, r: int, k: int) -> tuple[int, int]:
    """(programs per tile over K, K per program, a multiple of 64). Split while the shrink has
    fewer programs than the GPU has SMs, each program keeping at least 256 of K, and while the
    expand's re-reads of the partials (each of its N / 64 programs per tile reads them all) stay
    small against the adapter's weights."""
    programs = num_tiles * r_blocks
    if programs >= 128 or k <= 256:
        return 1, k
    split = min(-(-256 // programs), -(-k // 256))
    reread_rows = max(1, m) * -(-n // 64)  # partial-sum rows the expand loads per split
    split = max(1, min(split, (4 << 20) // (reread_rows * r * 4) + 1))
    per = -(-(-(-k // split)) // 64) * 64
    return -(-k // per), per


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
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    r_blocks = triton.cdiv(r, block_r)
    split, per = split_k(num_tiles, r_blocks, m, n, r, k)
    t = torch.empty(split, m, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tiles, r_blocks, split)](
        x, a, sorted_ids, tile_slots, t, k, r, per, x.stride(0), a.stride(0), a.stride(1), t.stride(0), t.stride(1),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64)
    _expand_kernel[(num_tiles, triton.cdiv(n, 64))](
        t, b, sorted_ids, tile_slots, y, n, r, split, t.stride(0), t.stride(1), b.stride(0), b.stride(1), y.stride(0),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_R=block_r)
    return y
