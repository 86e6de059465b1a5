"""The W4A16 split-K decode GEMM with the product transposed: ``y^T = W^T x^T``.

``triton_int4._w4a16_splitk_kernel`` (the dot variant) puts the activations on the dot's left:
``acc[BLOCK_M, BLOCK_N] += x @ w``, so a batch of 1-32 rows is padded to the 16/32/64-row
operand that ``mma.sync`` needs, and on Hopper Triton cannot use ``wgmma`` (its left operand is at
least 64 rows). Here the dequantized weight tile is the left operand, ``acc[BLOCK_N, BLOCK_M] +=
w^T @ x^T``: the output features fill wgmma's 64-row side and the batch rows its narrow side
(``wgmma.m64n16``/``n32``), with the weight dequantized in registers (wgmma's A operand may come
from registers) and x^T read from shared memory. Same packed layout, same numbers: per K tile
the raw sum over the tile, then the group's scale and zero point once per feature (as in the
kernel it mirrors: symmetric weights take ``BASE + 8`` off the operands, zero points come off
after the dot through ``sum_k x``). Selected by the tuning table (``"SWAP": true``); Q4_1's mins
stay on the other kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.triton_pdl import enter_args, pdl_enter
from pagedllm.ops.triton_splitk import finish_split, splitk_setup, tile_counter


def swap_eligible(group: int, config: dict) -> bool:
    """The transposed kernel's tiles: 128-deep K tiles inside one group, at least 64 features (wgmma's
    rows) and 16 batch rows per program, and no mins (the caller routes Q4_1 to the other kernel)."""
    return (config["BLOCK_K"] == 128 and group % 128 == 0 and config["BLOCK_N"] >= 64
            and config["BLOCK_M"] >= 16 and config.get("USE_DOT", True))


@triton.jit
def nibble_activations(xk, BKW: tl.constexpr):
    """A [rows, 8 BKW] tile of x split in registers into the four operands of the nibble-pair dots:
    operand i ([rows, BKW, 2]) holds x at k = 8 j + i + 4 h (the activations of nibbles i and i + 4 of
    word j). Shared by both split-K kernels."""
    x_c0, x_c1 = tl.split(tl.reshape(xk, (xk.shape[0], BKW, 2, 2, 2)))  # k = 8 j + 4 h + 2 b + c
    x_b0c0, x_b1c0 = tl.split(x_c0)  # i = 2 b + c
    x_b0c1, x_b1c1 = tl.split(x_c1)
    return x_b0c0, x_b0c1, x_b1c0, x_b1c1


@triton.jit
def _pair_dot(words, xh, i: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, part):
    """``part`` plus the dot of nibbles i and i + 4 of each word ([BLOCK_N, BKW]) with their activations
    (``xh`` [BLOCK_M, BKW, 2]: x at k = 8 j + i + 4 h). Both nibbles sit in one 32-bit register, each
    16-bit half ``BASE + q`` (bits OR'd into BASE's mantissa, exact), which is the [.., 2] pair of the
    operand as it is: column 2 j + h of the [BLOCK_N, 2 BKW] tile is k = 8 j + i + 4 h."""
    dtype: tl.constexpr = xh.dtype
    pair = ((words >> (4 * i)) & 0x000F000F) | MAGIC
    lo = pair.to(tl.int16).to(dtype, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(dtype, bitcast=True)
    if OFF != 0:
        lo = lo - OFF
        hi = hi - OFF
    w = tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))
    xt = tl.trans(tl.reshape(xh, (xh.shape[0], 2 * xh.shape[1])))
    return tl.dot(w, xt, part)


@triton.jit(do_not_specialize=["M", "K_TILES_PER_SPLIT", "SPLIT_K"])
def _w4a16_swap_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                       K_TILES_PER_SPLIT, SPLIT_K, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT: tl.constexpr,
                       ENTER: tl.constexpr):
    """Program (pid_n, pid_k, pid_m): ``BLOCK_N`` output features of ``BLOCK_M`` rows over the ``pid_k``-th
    slice of K (``K_TILES_PER_SPLIT`` tiles of ``BLOCK_K``, each inside one group); split-K as
    ``triton_splitk.finish_split`` does it. ENTER: launched early (``triton_pdl``), it waits first."""
    pdl_enter(ENTER)
    BKW: tl.constexpr = BLOCK_K // 8
    MAGIC: tl.constexpr = 0x43004300 if x_ptr.dtype.element_ty == tl.bfloat16 else 0x64006400  # 128 | 1024
    BASE: tl.constexpr = 128.0 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024.0
    ONE: tl.constexpr = 0x3F80 if x_ptr.dtype.element_ty == tl.bfloat16 else 0x3C00  # 1.0's bits
    SYMMETRIC: tl.constexpr = not HAS_ZP
    OFF: tl.constexpr = BASE + 8.0 if SYMMETRIC else 0.0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    kt_lo = pid_k * K_TILES_PER_SPLIT
    kt_hi = tl.minimum(kt_lo + K_TILES_PER_SPLIT, K // BLOCK_K)
    q_ptrs = qw_ptr + (kt_lo * BKW + tl.arange(0, BKW)).to(tl.int64)[None, :] * N + n[:, None]  # [BLOCK_N, BKW]
    xk_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + (kt_lo * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    if HAS_ZP:
        z_shift = (n % 8) * 4
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    s_next = tl.load(s_ptr + (kt_lo * BLOCK_K // GROUP) * N + n, mask=n_ok, other=0.0)  # a tile ahead
    for kt in range(kt_lo, kt_hi):
        words = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
        s = s_next.to(tl.float32)
        s_next = tl.load(s_ptr + (tl.minimum(kt + 1, kt_hi - 1) * BLOCK_K // GROUP) * N + n, mask=n_ok, other=0.0)
        xk = tl.load(xk_ptrs, mask=m_ok[:, None], other=0.0)
        x0, x1, x2, x3 = nibble_activations(xk, BKW)
        part = _pair_dot(words, x0, 0, MAGIC, OFF, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
        part = _pair_dot(words, x1, 1, MAGIC, OFF, part)
        part = _pair_dot(words, x2, 2, MAGIC, OFF, part)
        part = _pair_dot(words, x3, 3, MAGIC, OFF, part)
        if SYMMETRIC:  # the operands were q - 8
            acc += s[:, None] * part
        else:  # BASE + q: sum_k x (a dot with a tile of ones) times BASE + z comes off
            ones = tl.full((BLOCK_N, BLOCK_K), ONE, tl.int16).to(x_ptr.dtype.element_ty, bitcast=True)
            xsum = tl.dot(ones, tl.trans(xk))
            g = (kt * BLOCK_K) // GROUP
            z = ((tl.load(z_ptr + g * (N // 8) + n // 8, mask=n_ok, other=0) >> z_shift) & 0xF).to(tl.float32)
            acc += s[:, None] * (part - xsum * (z + BASE)[:, None])
        q_ptrs += BKW * N
        xk_ptrs += BLOCK_K
    y_ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    y_mask = n_ok[:, None] & m_ok[None, :]
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        finish_split(acc, ws_ptr + m.to(tl.int64)[None, :] * N + n[:, None], M * N, y_ptrs,
                     b_ptr + n[:, None] + 0 * m[None, :], y_mask, cnt_ptr, tile_counter(), pid_k, SPLIT_K, HAS_BIAS)


def w4a16_swap_splitk(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                      group_size: int, bias: torch.Tensor | None, config: dict, y: torch.Tensor) -> torch.Tensor:
    """``y`` = x @ W (+ b) by the transposed kernel (``triton_int4.w4a16_splitk`` checked the shapes and
    made ``y``); ``config`` as the tuning table's entries (``SPLIT_K``, tiles, warps, stages)."""
    cfg = {key: value for key, value in config.items() if key not in ("USE_DOT", "SWAP")}
    if not swap_eligible(group_size, config):
        raise ValueError(f"w4a16_swap_splitk: config {config} does not fit group {group_size}")
    m, k = x.shape
    n = qweight.shape[1]
    n_tiles, m_tiles = triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"])
    per_split, split, ws, cnt = splitk_setup(y, k // cfg["BLOCK_K"], cfg.pop("SPLIT_K"), n_tiles * m_tiles)
    _w4a16_swap_kernel[(n_tiles, split, m_tiles)](
        x, qweight, scales, qzeros if qzeros is not None else qweight, bias if bias is not None else y, y, ws, cnt,
        m, n, k, x.stride(0), y.stride(0), per_split, split, GROUP=group_size, HAS_ZP=qzeros is not None,
        HAS_BIAS=bias is not None, USE_SPLIT=split > 1, **cfg, **enter_args(x.device, m))
    return y
