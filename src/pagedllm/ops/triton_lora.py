"""Triton multi-LoRA: one shrink and one expand launch per projection, for any mix of adapters.

The step's tokens that run an adapter are sorted by adapter slot once (``sort_by_slot``, on the
host) and padded into tiles of ``BLOCK_M`` tokens of one slot each (the segmented GEMM of
Punica / S-LoRA, the token alignment of fused MoE). ``shrink``: t[m] = x[m] @ A[s]^T (rank
outputs, float32); ``expand``: y[m] += t[m] @ B[s]^T, tile by tile on the tensor cores. Tokens
of the base model are in no tile: their rows are not touched.

Few tiles (decode steps) would leave the shrink one program per tile walking all of K (14,336
for a llama3-8b down projection), latency-bound: the shrink then splits K over a few programs
per tile, each writing float32 partial sums, and the expand adds the partials up as it loads
them (deterministic, no atomics, no zeroing launch).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagedllm.ops.triton_pdl import launch_args, pdl_enabled, pdl_enter

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
                   stride_ts, stride_tm, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    # Launched while the kernel that wrote x runs (RMSNorm, SiLU-and-mul): x complete after this;
    # then the projection's GEMM may start streaming its weight (it waits for t in its epilogue).
    pdl_enter(PDL)
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
def partial_sums(t_ptr, rows, rows_ok, r, r_ok, stride_ts, stride_tm, SPLIT: tl.constexpr):
    """The shrink's outputs [rows, r] (float32): its ``SPLIT`` partial sums over K added, the
    loads issued together (rows or ranks not ok: 0). The expand and the small-row GEMM's LoRA
    epilogue (``triton_gemv``) read them through this."""
    mask = rows_ok[:, None] & r_ok[None, :]
    ptrs = t_ptr + rows[:, None] * stride_tm + r[None, :]
    t = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        t += tl.load(ptrs + s * stride_ts, mask=mask, other=0.0)
    return t


@triton.jit
def _expand_kernel(t_ptr, b_ptr, ids_ptr, tile_slot_ptr, y_ptr, N, R, stride_ts, stride_tm, stride_bs,
                   stride_bn, stride_ym, IEEE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
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
        t = partial_sums(t_ptr, rows, m_ok, r, r_ok, stride_ts, stride_tm, SPLIT)
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


MAX_SPLIT = 16


def default_config(num_tiles: int, r_blocks: int, m: int, n: int, k: int) -> dict[str, int]:
    """Tiles and K split for a launch, from ``benchmarks/lora_kernel.py``'s sweep (H200,
    llama3-8b projections, 1 to 2,048 tokens). A decode step's few tiles leave most SMs idle and
    each program latency-bound on its K loop: K is split over programs (each keeping at least 512
    of it) while the expand's re-reads of the partial sums, which grow with its programs per tile
    times the split, stay small. A prefill has programs enough: no split, larger tiles."""
    block_n = 256 if m <= 8 or n <= 8192 else 128
    if m == 1:  # batch-1 decode: one real tile and a GEMV epilogue reading the partials; more split
        # programs shorten the K loop the GEMV waits on (H200 sweep: gate_up 66.2 -> 60.7 us at 16)
        return {"split": max(1, min(MAX_SPLIT, k // 256)), "block_k": 64, "block_n": block_n}
    if m > 256:
        return {"split": 1, "block_k": 256, "block_n": block_n}
    rereads, min_k = 512 if m <= 128 else 256, 512 if m <= 32 else 1024
    split = 1
    while (split < MAX_SPLIT and k // (split * 2) >= min_k and -(-n // block_n) * split * 2 <= rereads
           and num_tiles * r_blocks * split * 2 <= 1024):
        split *= 2
    return {"split": split, "block_k": 256 if split <= 2 else 128, "block_n": block_n}


def split_k(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(programs per tile over K, K per program: a multiple of ``block_k``) for ``split`` asked."""
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return triton.cdiv(k, per), per


@dataclass
class LoRADelta:
    """One projection's shrink done: ``t`` [split, M, R] float32 partial sums of x @ A^T (rows of
    base-model tokens unwritten), ``b`` [slots, N, R], and the mapping. The expand is left: a
    small-row GEMM adds it in its epilogue (``triton_gemv``), or ``expand_into`` does it."""
    t: torch.Tensor
    b: torch.Tensor
    sorted_ids: torch.Tensor
    tile_slots: torch.Tensor
    token_slots: torch.Tensor | None  # each row's slot (-1: base model), for a fused epilogue
    block_n: int
    pdl: bool = False  # the shrink let its consumer launch early: a fused epilogue waits (gdc_wait)

    @property
    def split(self) -> int:
        return self.t.shape[0]

    def expand_into(self, y: torch.Tensor) -> torch.Tensor:
        """``y[m] += t[m] @ B[s]^T`` for the tiles' tokens, in place."""
        if y.stride(1) != 1 or self.b.stride(2) != 1:
            raise ValueError("lora expand needs rows with unit stride")
        n, r = y.shape[1], self.b.shape[2]
        block_r = block_r_for(r)
        _expand_kernel[(self.tile_slots.shape[0], triton.cdiv(n, self.block_n))](
            self.t, self.b, self.sorted_ids, self.tile_slots, y, n, r, self.t.stride(0), self.t.stride(1),
            self.b.stride(0), self.b.stride(1), y.stride(0), IEEE=self.b.dtype == torch.float32, SPLIT=self.split,
            BLOCK_M=BLOCK_M, BLOCK_N=self.block_n, BLOCK_R=block_r,
            # a batch-1 shrink's 16 partial sums, buffered for a pipelined rank loop, outgrow shared
            # memory (320 KB at BLOCK_N 256): the loop has a few rank blocks at most, so no pipelining
            num_stages=1 if self.split > 4 else 3)
        return y


def block_r_for(r: int) -> int:
    """The rank block of the LoRA kernels (and the small-row GEMM's LoRA epilogue) for rank ``r``."""
    return max(16, min(64, triton.next_power_of_2(r)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
                tile_slots: torch.Tensor, token_slots: torch.Tensor | None = None,
                config: dict[str, int] | None = None, pdl: bool = False) -> LoRADelta | None:
    """The shrink ``t[m] = x[m] @ A[s]^T`` of every token in ``sorted_ids`` (``sort_by_slot``), s
    its tile's slot; None for no tiles. ``x`` [M, K], ``a`` [slots, R, K], ``b`` [slots, N, R].
    ``config``: ``default_config``'s keys (split, block_k, block_n), for a sweep. ``pdl``
    (``pdl_supported``): programmatic dependent launch both sides of the shrink. It launches
    while the kernel before it runs (the RMSNorm and SiLU-and-mul kernels let dependents launch
    at once) and waits for that kernel's output; the next launch, the projection's small-row
    GEMM carrying the expand, starts as soon as the shrink has, streams its weight, and waits
    for ``t`` only in its epilogue. Both launches' latency and the shrink's run hide behind
    the GEMM's weight read (H100, llama3-8b batch-1 decode with one adapter: overhead 16%
    -> 8-9%)."""
    m, k = x.shape
    r, n = a.shape[1], b.shape[1]
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("lora shrink needs rows with unit stride")
    num_tiles = tile_slots.shape[0]
    if num_tiles == 0:
        return None
    block_r = block_r_for(r)
    r_blocks = triton.cdiv(r, block_r)
    cfg = config or default_config(num_tiles, r_blocks, m, n, k)
    split, per = split_k(k, cfg["split"], cfg["block_k"])
    t = torch.empty(split, m, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tiles, r_blocks, split)](
        x, a, sorted_ids, tile_slots, t, k, r, per, x.stride(0), a.stride(0), a.stride(1), t.stride(0), t.stride(1),
        IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=cfg["block_k"], **launch_args(pdl))
    return LoRADelta(t, b, sorted_ids, tile_slots, token_slots, cfg["block_n"], pdl)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch for the LoRA shrink and its GEMM (and the norms before it):
    ``pdl_capable`` and ``PAGEDLLM_LORA_PDL`` not 0."""
    return pdl_enabled(device, "PAGEDLLM_LORA_PDL")


def lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
               tile_slots: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """``y[m] += (x[m] @ A[s]^T) @ B[s]^T`` for every token m in ``sorted_ids``; in place."""
    delta = lora_shrink(x, a, b, sorted_ids, tile_slots, None, config)
    return y if delta is None else delta.expand_into(y)
