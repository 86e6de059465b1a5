"""Triton GEMM for decode batches (1 to 256 tokens): ``y = x @ W.T (+ b)``.

At batch 1 a projection reads its whole weight to make one row, so it can only be as fast as
memory; cuBLAS's heuristics tile such shapes by 64 output features, which for a 4096 x 4096
projection leaves 64 programs for 132 SMs (llama3-8b's o_proj ran at 54% of copy bandwidth
on an H100), and split the long-K ones with a separate reduction kernel. Here every program
owns ``BLOCK_N`` output features for all rows and walks K once, so a projection becomes
``N / BLOCK_N`` programs (hundreds) and one launch. The rows ride along in a tensor-core dot
padded to 16 (or 32), so 1 to 16 rows cost the same weight read. Past 32 rows they come in row
tiles of 64 or 128 (a third grid axis), where the tuned table finds that faster than cuBLAS.

With LoRA adapters in the step (``lora``: a ``triton_lora.LoRADelta``, its shrink done), each
program also adds its features' ``t[m] @ B[slot(m)]^T`` before its one store: the expand costs
no launch and no second pass over the output (a decode step's adapter overhead is launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.tile_tables import DECODE_MAX_ROWS, DECODE_ROW_BUCKETS, TileTable, default_block_m
from pagedllm.ops.triton_lora import block_r_for, partial_sums
from pagedllm.ops.triton_pdl import decode_pdl, gdc_wait, launch_early, pdl_enter
from pagedllm.ops.triton_splitk import finish_split, splitk_setup, tile_counter

MAX_ROWS = DECODE_MAX_ROWS  # rows a launch takes at most (past 32: row tiles); more go to cuBLAS


@triton.jit(do_not_specialize=["M", "K_TILES_PER_SPLIT", "SPLIT_K"])
def _small_m_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         t_ptr, lb_ptr, ls_ptr, R, NUM_SLOTS, stride_ts, stride_tm, stride_lbs, stride_lbn,
                         part_ptr, cnt_ptr, K_TILES_PER_SPLIT, SPLIT_K,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_LORA: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_R: tl.constexpr, PDL: tl.constexpr, ENTER: tl.constexpr, USE_SPLIT: tl.constexpr):
    """Program (pid_n, pid_k, pid_m) owns BLOCK_N output features of the ``pid_m``-th BLOCK_M rows
    and walks the ``pid_k``-th slice of K (``K_TILES_PER_SPLIT`` tiles; all of K without the
    split). USE_SPLIT (never with LoRA): the partials meet in ``triton_splitk.finish_split``."""
    pdl_enter(ENTER)
    pid_k = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    k_lo = pid_k * K_TILES_PER_SPLIT * BLOCK_K
    k_hi = tl.minimum(k_lo + K_TILES_PER_SPLIT * BLOCK_K, K)
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + (k_lo + kk)[None, :]
    x_ptrs = x_ptr + m.to(tl.int64)[None, :] * stride_xm + (k_lo + kk)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(k_lo, k_hi, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper checks)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_SPLIT:
        m64 = m.to(tl.int64)
        finish_split(acc, part_ptr + m64[None, :] * N + n[:, None], M * N,
                     y_ptr + m64[None, :] * stride_ym + n[:, None], b_ptr + n[:, None] + 0 * m[None, :],
                     n_ok[:, None] & m_ok[None, :], cnt_ptr, tile_counter(), pid_k, SPLIT_K, HAS_BIAS)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_LORA:  # acc[:, rows of slot s] += B[s] t[rows]^T, slot by slot (a handful of adapters)
            if PDL:  # launched while the shrink runs: its t complete and visible from here on
                gdc_wait()
            row_slot = tl.load(ls_ptr + m, mask=m_ok, other=-1)
            for r0 in range(0, R, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_ok = r < R
                t = partial_sums(t_ptr, m, row_slot >= 0, r, r_ok, stride_ts, stride_tm, SPLIT)
                t = t.to(w_ptr.dtype.element_ty)
                for slot in range(0, NUM_SLOTS):
                    sel = row_slot == slot
                    if tl.max(sel.to(tl.int32), axis=0) > 0:
                        bw = tl.load(lb_ptr + slot * stride_lbs + n.to(tl.int64)[:, None] * stride_lbn + r[None, :],
                                     mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                        acc = tl.dot(bw.to(w_ptr.dtype.element_ty), tl.trans(tl.where(sel[:, None], t, 0.0)), acc)
        tl.store(y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 t_ptr, lb_ptr, ls_ptr, R, stride_ts, stride_lbs, stride_lbn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LORA: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr, ENTER: tl.constexpr):
    """One row: products accumulated elementwise in fp32, reduced once at the end."""
    pdl_enter(ENTER)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_LORA:  # the row's adapter slot, in flight while the weight streams in
        slot = tl.load(ls_ptr).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    x_ptrs = x_ptr + kk
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_LORA:
        if PDL:
            gdc_wait()
        if slot >= 0:
            for r0 in range(0, R, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_ok = r < R
                t = tl.load(t_ptr + r, mask=r_ok, other=0.0)
                for s in tl.static_range(1, SPLIT):
                    t += tl.load(t_ptr + s * stride_ts + r, mask=r_ok, other=0.0)
                t = t.to(lb_ptr.dtype.element_ty).to(tl.float32)
                bw = tl.load(lb_ptr + slot * stride_lbs + n.to(tl.int64)[:, None] * stride_lbn + r[None, :],
                             mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                y += tl.sum(bw.to(tl.float32) * t[None, :], axis=1)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def block_k_for(k: int, largest: int = 512) -> int | None:
    """The largest power-of-two tile (64..largest) that divides K, or None."""
    b = largest
    while b >= 64:
        if k % b == 0:
            return b
        b //= 2
    return None


# ---- which kernel and tiling a decode projection takes (the table: pagedllm.benchmarks.gemv_kernel --tune) ----

_config_table = TileTable("gemv_configs.json")
CONFIG_FILE = _config_table.path
reload_config_table = _config_table.reload
M_BUCKETS = DECODE_ROW_BUCKETS  # the table's row buckets (a row count takes the next tuned bucket up)


def config_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


def default_config(m: int, n: int, k: int) -> dict | None:
    """Untuned shapes (``scripts/bench_gemv.py``, H100, graph-timed): one row always takes the
    one-row kernel (llama3-8b's projections 4-16% faster than cuBLAS, the LM head 372 -> 338 us);
    2-16 rows the dot kernel for weights of 4M elements and up (2-14% faster; smaller ones lose);
    17-32 rows for 20M and up (2-7% faster). None: cuBLAS (past 32 rows always: row tiles only
    where the table found them faster)."""
    block_k = block_k_for(k)
    if block_k is None or m > 32:
        return None
    if m == 1:
        return dict(kernel="gemv", block_n=8, block_k=block_k, split_k=1, num_warps=4, num_stages=3)
    if n * k >= (4 << 20 if m <= 16 else 20 << 20):
        return dict(kernel="dot", block_n=64, block_k=min(block_k, 256), split_k=1, num_warps=4, num_stages=4)
    return None


def decode_config(m: int, n: int, k: int) -> dict | None:
    """``small_m_linear``'s keyword arguments for ``m`` rows (1..MAX_ROWS) of an [N, K] weight: the tuned
    table's entry for the smallest tuned row bucket holding ``m``, else ``default_config``. None:
    cuBLAS (the table found it faster, or the shape does not fit the kernels)."""
    tuned = _config_table().get(config_key(n, k))  # called per projection per eager step: untuned is cheap
    entry = None if not tuned else next((tuned[str(b)] for b in M_BUCKETS if b >= m and str(b) in tuned), None)
    if entry is None:
        return default_config(m, n, k)
    if entry["kernel"] == "cublas" or k % entry["block_k"]:
        return None
    return {key: value for key, value in entry.items() if key != "us"}


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   block_n: int = 32, block_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                   kernel: str = "dot", split_k: int = 1, block_m: int | None = None, lora=None) -> torch.Tensor:
    """``F.linear`` for 2-D ``x`` of at most MAX_ROWS rows, half precision, K divisible by 64; plus the
    adapters' delta of ``lora`` (a ``triton_lora.LoRADelta`` with ``token_slots``) if given.
    ``split_k`` (the dot kernel without ``lora``): K split that many ways, rounded to whole tiles.
    ``block_m``: the dot kernel's rows per program (by default 16 or 32, all rows up to 32; more
    rows take tiles of 64)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k or x.dtype != weight.dtype or x.stride(-1) != 1 \
            or weight.stride(-1) != 1:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    block_k = block_k or block_k_for(k, 512 if kernel == "gemv" else 256)
    if block_k is None or k % block_k:
        raise ValueError(f"small_m_linear: K={k} is not a multiple of 64")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(n, block_n),)
    b = bias if bias is not None else y
    if lora is not None:
        if lora.token_slots is None or lora.b.shape[1] != n or lora.t.shape[1] != m or lora.b.stride(2) != 1:
            raise ValueError("small_m_linear: the LoRA delta does not fit this projection")
        t, lb, ls, r = lora.t, lora.b, lora.token_slots, lora.b.shape[2]
        lora_strides = (t.stride(0), t.stride(1), lb.stride(0), lb.stride(1))
        block_r = block_r_for(r)
    else:
        t = lb = ls = y
        r, lora_strides, block_r = 0, (0, 0, 0, 0), 16
    pdl = lora is not None and lora.pdl  # launched while the shrink runs: waits before reading its t
    enter = lora is None and decode_pdl(x.device, m)  # launched early: waits first
    common = dict(HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, HAS_LORA=lora is not None,
                  SPLIT=lora.split if lora is not None else 1, BLOCK_R=block_r, num_warps=num_warps,
                  num_stages=num_stages, PDL=pdl, ENTER=enter, **launch_early(pdl or enter))
    if kernel == "gemv" and m == 1:
        ts, _, lbs, lbn = lora_strides
        _gemv_kernel[grid](x, weight, b, y, n, k, weight.stride(0), t, lb, ls, r, ts, lbs, lbn, **common)
    else:
        block_m = block_m or default_block_m(m)
        m_tiles = triton.cdiv(m, block_m)
        per_split, split, part, cnt = splitk_setup(y, k // block_k, split_k if lora is None else 1, grid[0] * m_tiles)
        _small_m_gemm_kernel[(grid[0], split, m_tiles)](
            x, weight, b, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), t, lb, ls, r,
            lb.shape[0] if lora is not None else 0, *lora_strides, part, cnt, per_split, split,
            BLOCK_M=block_m, USE_SPLIT=split > 1, **common)
    return y
