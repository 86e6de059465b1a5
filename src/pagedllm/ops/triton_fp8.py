"""Triton FP8 kernels: activation quantization (per token, per token and K group, or by a static
scale: one launch where torch takes five), and the block-scaled FP8 GEMM (DeepSeek-V3 /
Qwen3-FP8 checkpoints): ``y = (a * a_s) @ (b * b_s)^T``
with ``a`` fp8 [M, K] quantized per row and ``block_k`` columns (scales ``a_s`` [M, K / bk]) and
``b`` fp8 [N, K] with one scale per (bn x bk) tile (``b_s`` [ceil(N / bn), K / bk]).

Each K step is one tile of both: an fp8 tensor-core dot accumulated in fp32, times the row's and
the column block's scales (the scales are constant over the step since BLOCK_K == bk).

And the small-row W8A8 kernel decode batches (1 to 32 rows; to 256 in row tiles of 64 or 128
where the table has them) take: every program streams its output features' fp8 weight once for
its rows (K split or not), tilings per (N, K, row bucket) from ``fp8_configs.json``, which
``pagedllm.benchmarks.fp8_kernel --tune`` writes on the GPU (cuBLAS's row-wise fp8 GEMM tiles
128 x 128 without splitting K, so at 64-256 rows few programs stream the weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.tile_tables import DECODE_MAX_ROWS, DECODE_ROW_BUCKETS, TileTable, default_block_m
from pagedllm.ops.triton_pdl import launch_args, pdl_enter
from pagedllm.ops.triton_splitk import finish_split, splitk_setup, tile_counter

# Kernels read globals only as constexprs: the e4m3 maximum, and the smallest dynamic scale (as
# pagedllm.model.quantization.fp8: an all-zero row divides by this).
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, static_s_ptr, K, stride_xm, n_groups, GROUP: tl.constexpr,
                      STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One (row, K group): absmax / 448 as the scale (or the static one), x / scale in fp8."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_s_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(s_ptr + row * n_groups + g, scale)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def quantize_fp8(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M, K], float32 scales): per token ([M, 1]) without ``group``, per
    token and ``group`` columns ([M, K / group]) with it; ``static_scale``: that one value
    (returned as [M, 1]). ``pdl``: launched while the kernel before it runs (``triton_pdl``)."""
    m, k = x.shape
    group = group or k
    n_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=fp8_dtype, device=x.device)
    if static_scale is not None:
        scales = static_scale.reshape(1, 1).expand(m, 1)
    else:
        scales = torch.empty(m, n_groups, dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_kernel[(m, n_groups)](x, q, scales, static_scale if static_scale is not None else scales, k,
                                         x.stride(0), n_groups, GROUP=group, STATIC=static_scale is not None,
                                         BLOCK=triton.next_power_of_2(group), num_warps=4 if group <= 1024 else 8,
                                         **launch_args(pdl))
    return q, scales


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_bn,
                           stride_bsn, stride_cm, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < N
    a_ptrs = a_ptr + m.to(tl.int64)[:, None] * stride_am + kk[None, :]
    b_ptrs = b_ptr + n.to(tl.int64)[None, :] * stride_bn + kk[:, None]
    as_ptrs = as_ptr + m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = kk < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(c_ptr + m.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in ``out_dtype``; shapes as the module docstring says."""
    m, k = a.shape
    n = b.shape[0]
    block_n, block_k = block
    if b.shape[1] != k or a_scale.shape != (m, triton.cdiv(k, block_k)) \
            or b_scale.shape != (triton.cdiv(n, block_n), triton.cdiv(k, block_k)):
        raise ValueError(f"fp8_block_matmul: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, b {tuple(b.shape)}, "
                         f"b_scale {tuple(b_scale.shape)}, block {block}")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n_tile = 64 if m <= 32 else 128
    grid = (triton.cdiv(n, block_n_tile), triton.cdiv(m, block_m))
    _fp8_block_gemm_kernel[grid](a, a_scale, b, b_scale, c, m, n, k, a.stride(0), a_scale.stride(0), b.stride(0),
                                 b_scale.stride(0), stride_cm=c.stride(0), GROUP_N=block_n, BLOCK_M=block_m,
                                 BLOCK_N=block_n_tile, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return c


@triton.jit(do_not_specialize=["M", "K_TILES_PER_SPLIT", "SPLIT_K"])
def _fp8_small_m_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm,
                        stride_wn, stride_ym, K_TILES_PER_SPLIT, SPLIT_K, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_SPLIT: tl.constexpr, PDL: tl.constexpr):
    """W8A8 for decode batches: program (pid_n, pid_k, pid_m) owns BLOCK_N output features of the
    ``pid_m``-th BLOCK_M rows and walks the ``pid_k``-th slice of K (``K_TILES_PER_SPLIT`` tiles; all
    of K without the split), the rows riding in the dot's narrow side (the weight's features fill
    the tensor cores' 64-wide one), scales applied once at the end.
    USE_SPLIT: the partials meet in ``triton_splitk.finish_split`` (one launch, deterministic).
    PDL: launched while the quantize kernel before it runs (its launch and the weight scales' load
    overlap that kernel; everything else waits for it). A first weight tile loaded before the wait
    as well needs one more tile of shared memory than the tuned tilings leave (240 KB > 227 KB)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    k_lo = pid_k * K_TILES_PER_SPLIT * BLOCK_K
    k_hi = tl.minimum(k_lo + K_TILES_PER_SPLIT * BLOCK_K, K)
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + (k_lo + kk)[None, :]
    x_ptrs = xq_ptr + m.to(tl.int64)[None, :] * stride_xm + (k_lo + kk)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_s = tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    pdl_enter(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = kk < K - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    x_s = tl.load(xs_ptr + m, mask=m_ok, other=0.0)
    acc = acc * w_s[:, None] * x_s[None, :]
    y_ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        finish_split(acc, part_ptr + m.to(tl.int64)[None, :] * N + n[:, None], M * N, y_ptrs,
                     b_ptr + n[:, None] + 0 * m[None, :], mask, cnt_ptr, tile_counter(), pid_k, SPLIT_K, HAS_BIAS)


# ---- the small-row kernel's configs (written by pagedllm.benchmarks.fp8_kernel --tune) ---------

_config_table = TileTable("fp8_configs.json")
CONFIG_FILE = _config_table.path
reload_config_table = _config_table.reload
M_BUCKETS = DECODE_ROW_BUCKETS  # the table's row buckets (a row count takes the next bucket up)
MAX_ROWS = DECODE_MAX_ROWS  # past it (prefill chunks, mixed steps): torch._scaled_mm
DEFAULT_SMALL_M_ROWS = 16  # untuned shapes: up to this many rows the small-row kernel, more _scaled_mm


def config_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


def default_config(n: int) -> dict:
    """Untuned: the widest tile giving about two programs per SM of an H100, all of K each."""
    return dict(BLOCK_N=next((b for b in (64, 32) if n >= b * 264), 16), BLOCK_K=256, SPLIT_K=1, num_warps=4,
                num_stages=4)


def decode_config(m: int, n: int, k: int) -> dict | None:
    """The small-row kernel's config for ``m`` rows of an [N, K] weight: the table's entry for the
    smallest tuned row bucket holding ``m``, else the default up to ``DEFAULT_SMALL_M_ROWS`` rows.
    None: ``torch._scaled_mm`` (more than MAX_ROWS rows, or the table found it faster there)."""
    if m > MAX_ROWS:
        return None
    tuned = _config_table().get(config_key(n, k), {})
    entry = next((tuned[str(b)] for b in M_BUCKETS if b >= m and str(b) in tuned), None)
    if entry is not None:
        if entry.get("kernel") == "scaled_mm":
            return None
        return {key: value for key, value in entry.items() if key not in ("kernel", "ms")}
    return default_config(n) if m <= DEFAULT_SMALL_M_ROWS else None


def fp8_small_m_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype, *, block_n: int | None = None,
                       block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4,
                       block_m: int | None = None, pdl: bool = False) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale)^T (+ bias)`` for at most MAX_ROWS rows: fp8 ``xq`` [M, K]
    with float32 per-row scales [M, 1], fp8 ``weight`` [N, K] with float32 per-channel scales [N];
    K split ``split_k`` ways (rounded to whole tiles). ``block_n`` by default: the widest tile
    giving about two programs per SM of an H100 (untuned). ``block_m``: rows per program (by
    default 16 or 32, all rows up to 32; more rows take tiles of 64). ``pdl``: launched while the
    kernel before it (the activations' quantize launch) runs."""
    m, k = xq.shape
    n = weight.shape[0]
    block_n = block_n or default_config(n)["BLOCK_N"]
    if m > MAX_ROWS or weight.shape[1] != k or x_scale.numel() != m or weight_scale.numel() != n or xq.stride(-1) != 1:
        raise ValueError(f"fp8_small_m_linear: xq {tuple(xq.shape)}, x_scale {tuple(x_scale.shape)}, weight "
                         f"{tuple(weight.shape)}, weight_scale {tuple(weight_scale.shape)}")
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    n_tiles = triton.cdiv(n, block_n)
    block_m = block_m or default_block_m(m)
    m_tiles = triton.cdiv(m, block_m)
    per_split, split, part, cnt = splitk_setup(y, triton.cdiv(k, block_k), split_k, n_tiles * m_tiles)
    _fp8_small_m_kernel[(n_tiles, split, m_tiles)](
        xq, x_scale.reshape(m).contiguous(), weight, weight_scale, bias if bias is not None else y, y, part, cnt,
        m, n, k, xq.stride(0), weight.stride(0), y.stride(0), per_split, split, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_SPLIT=split > 1, num_warps=num_warps,
        num_stages=num_stages, **launch_args(pdl))
    return y
