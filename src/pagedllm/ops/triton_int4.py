"""Triton W4A16 GEMM: ``y = x @ W (+ b)`` with W int4 in pagedllm's canonical layout
(pagedllm.model.quantization.int4): ``qweight`` int32 [K / 8, N] (8 values along K per word),
``scales`` [K / G, N], optional ``qzeros`` int32 [K / G, N / 8] (zero point 8 without).

Each K tile is dequantized in registers, ``(q - z) * s`` rounded to the activation dtype (what
the torch path computes), and fed to a tensor-core dot with fp32 accumulation: the weight is
read from memory packed, 4.5 bits per value with its group's scale. A K tile never straddles
two groups (BLOCK_K divides G), so each tile reads one row of scales and zeros.

Two tilings of the one kernel: prefill (many rows: 64 x 128 output tiles), and small-row decode
(1 to 32 rows: the rows ride in a 16/32-row dot, the grid spreads over N in narrow tiles so a
batch-1 projection still occupies every SM while it streams the packed weight once). Large
prefills dequantize the weight once (a second kernel) and hand the product to cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_ROWS = 32  # at most this many rows take the decode tiling
DEQUANT_ROWS = 1024  # from this many rows on: dequantize once, then cuBLAS


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PACKED_LOAD: tl.constexpr = False, HAS_MIN: tl.constexpr = False):
    """PACKED_LOAD: each int32 word is loaded once ([BLOCK_K / 8, BLOCK_N]) and its eight values
    spread by a reshape; otherwise every value's lane loads its word (eight lanes, one address:
    cache hits, more load instructions). Which is faster is the GPU's to say (the quant_kernel
    benchmark times both). HAS_MIN (GGUF Q4_1): ``z_ptr`` holds float mins [K / G, N], w = q s + m."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < N
    shifts = ((kk % 8) * 4)[:, None]
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    if PACKED_LOAD:
        q_ptrs = qw_ptr + tl.arange(0, BLOCK_K // 8).to(tl.int64)[:, None] * N + n[None, :]
        word_shifts = (tl.arange(0, 8) * 4)[None, :, None]
    else:
        q_ptrs = qw_ptr + (kk // 8).to(tl.int64)[:, None] * N + n[None, :]
    if HAS_ZP:
        z_shift = (n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (BLOCK_K divides GROUP, GROUP divides K)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if PACKED_LOAD:
            words = tl.load(q_ptrs, mask=n_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> word_shifts) & 0xF, (BLOCK_K, BLOCK_N))
        else:
            q = (tl.load(q_ptrs, mask=n_ok[None, :], other=0) >> shifts) & 0xF
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_MIN:
            mn = tl.load(z_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) * s[None, :] + mn[None, :]).to(x_ptr.dtype.element_ty)
        else:
            if HAS_ZP:
                z = (tl.load(z_ptr + g * (N // 8) + n // 8, mask=n_ok, other=0) >> z_shift) & 0xF
            else:
                z = tl.full((BLOCK_N,), 8, tl.int32)
            w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // 8) * N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MIN: tl.constexpr = False):
    """One [BLOCK_K, BLOCK_N] tile of the dequantized [K, N] weight, rounded as the GEMM rounds it."""
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (k < K)[:, None] & (n < N)[None, :]
    q = (tl.load(qw_ptr + (k // 8).to(tl.int64)[:, None] * N + n[None, :], mask=ok, other=0)
         >> ((k % 8) * 4)[:, None]) & 0xF
    g = (k // GROUP).to(tl.int64)[:, None]
    s = tl.load(s_ptr + g * N + n[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_MIN:
        w = (q.to(tl.float32) * s + tl.load(z_ptr + g * N + n[None, :], mask=ok, other=0.0).to(tl.float32))
    else:
        if HAS_ZP:
            z = (tl.load(z_ptr + g * (N // 8) + (n // 8)[None, :], mask=ok, other=0) >> ((n % 8) * 4)[None, :]) & 0xF
        else:
            z = 8
        w = (q - z).to(tl.float32) * s
    w = w.to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + k.to(tl.int64)[:, None] * N + n[None, :], w, mask=ok)


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
                     dtype: torch.dtype, mins: torch.Tensor | None = None) -> torch.Tensor:
    """The [K, N] weight in ``dtype`` (one pass over the packed weight)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(n, 128), triton.cdiv(k, 32))
    second = mins if mins is not None else qzeros if qzeros is not None else qweight
    _w4a16_dequant_kernel[grid](qweight, scales, second, w, n, k, GROUP=group_size, HAS_ZP=qzeros is not None,
                                BLOCK_N=128, BLOCK_K=32, HAS_MIN=mins is not None, num_warps=4)
    return w


def tiles_for(m: int, n: int, group: int) -> dict:
    """The tiling of an [m, K] x [K, n] product: small-row (decode) or prefill."""
    if m <= SMALL_ROWS:
        # The widest tile that still gives about two programs per SM of an H100 (132): a decode
        # projection is a stream of its packed weight, and one program per SM keeps too few loads
        # in flight. Untuned: `pagedllm bench quant --tune` times the alternatives.
        block_n = next((b for b in (64, 32) if n >= b * 264), 16)
        return dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n, BLOCK_K=min(group, 128), num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128 if n >= 128 else 64, BLOCK_K=min(group, 64), num_warps=8, num_stages=3)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, mins: torch.Tensor | None = None,
                 **tiles) -> torch.Tensor:
    """``x`` [M, K] (half precision) times the canonical int4 weight: [M, N] in x's dtype. From
    ``DEQUANT_ROWS`` rows on, the weight is dequantized once and multiplied by cuBLAS: a large
    prefill is bound by the math, and reading the packed weight once more costs a few percent."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or k % group_size or n % 8 or scales.shape != (k // group_size, n) \
            or (qzeros is not None and qzeros.shape != (k // group_size, n // 8)) \
            or (mins is not None and mins.shape != scales.shape):
        raise ValueError(f"w4a16_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, group {group_size}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m >= DEQUANT_ROWS and not tiles:
        w = w4a16_dequantize(qweight, scales, qzeros, group_size, x.dtype, mins)
        y = x @ w
        return y if bias is None else y + bias
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    config = {**tiles_for(m, n, group_size), **tiles}
    if group_size % config["BLOCK_K"]:
        raise ValueError(f"w4a16_linear: BLOCK_K {config['BLOCK_K']} does not divide group_size {group_size}")
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]))
    second = mins if mins is not None else qzeros if qzeros is not None else qweight
    _w4a16_gemm_kernel[grid](x, qweight, scales, second, bias if bias is not None else y, y, m, n, k, x.stride(0),
                             y.stride(0), GROUP=group_size, HAS_ZP=qzeros is not None, HAS_BIAS=bias is not None,
                             HAS_MIN=mins is not None, **config)
    return y
