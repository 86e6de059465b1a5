"""The fused-MoE Triton kernel: (token, slot) pairs sorted by expert and padded to the tile
height, one grouped GEMM for gate/up with SiLU-and-mul in its epilogue, one grouped GEMM for
down scaled by the routing weight, then the top-k sum.

Routing and the pair alignment are ``ops/triton_moe_routing.py``. ``align_pairs`` (torch, no host
sync: CUDA graphs capture it) or ``align_pairs_triton`` (one program) lays the pairs out so that every
``BLOCK_M`` rows of the sorted order belong to one expert; each program of a GEMM takes one such
block and one ``BLOCK_N`` column tile, reading that expert's weights. Tile sizes come from
``fused_moe_configs.json`` by (experts, hidden, intermediate, batch bucket), which
``pagedllm.benchmarks.moe_kernel --tune`` rewrites; shapes it lacks take ``default_config``.
Quantized experts (``ops.moe_scales.ExpertScales``): fp8 weights widened in registers, int4 words
split in registers, their scales in the epilogue or per K tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.moe_scales import ExpertScales, expert_dims, weight_format
from pagedllm.ops.triton_moe_routing import align_pairs, align_pairs_triton, moe_pdl
from pagedllm.ops.triton_pdl import pdl_enter
from pagedllm.ops.tile_tables import TileTable

_config_table = TileTable("fused_moe_configs.json")
CONFIG_FILE = _config_table.path
reload_config_table = _config_table.reload
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Larger batches run in chunks of this many tokens: the intermediate buffers stay bounded.
CHUNK_TOKENS = 8192
ALIGN_ONE_LAUNCH_MAX_PAIRS = 4096  # (token, slot) pairs up to which align_pairs_triton lays them out


@triton.jit
def _mma(a, w, acc, s_cols, kb, n_ok, SCALE: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ w`` for one K tile. fp8 weights (SCALE > 0) are widened to a's dtype (exact);
    with block scales (SCALE 2) the tile's product is scaled per column by the scales of k-block
    ``kb`` (``s_cols``: each column's scale row), since the scale changes along K."""
    if SCALE > 0:
        w = w.to(a.dtype)
    if SCALE == 2:
        scale = tl.load(s_cols + kb, mask=n_ok, other=0.0).to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        else:
            acc += tl.dot(a, w) * scale[None, :]
    else:
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _int4_tile(w_e, k0, K, cols, n_ok, stride_wk, z_cols, kb, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """An int4 expert's [BLOCK_K, BLOCK_N] tile (K tile ``k0``) as the small integers ``q - z``
    (float32; exact in any dtype): ``w_e`` one expert's canonical words [K / 8, N] (value k at bits
    4 (k % 8) of word k // 8), each word loaded once and split in registers; zero points unpacked
    per column and group (``z_cols``: each column's row; 8 without them). The group's scale is
    applied as a block scale (SCALE 2, one group per K tile); rows past K meet zero activations."""
    rows = k0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_e + rows[:, None].to(tl.int64) * stride_wk + cols[None, :],
                    mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0)
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    q = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BLOCK_K, cols.shape[0]))
    if HAS_ZEROS:
        q = q - tl.load(z_cols + kb, mask=n_ok, other=8).to(tl.int32)[None, :]
    else:
        q = q - 8
    return q.to(tl.float32)


@triton.jit
def _channel_scaled(acc, s_cols, n_ok, SCALE: tl.constexpr):
    """Per-output-channel scales (SCALE 1) factor out of the K sum: applied once at the end."""
    if SCALE == 1:
        acc = acc * tl.load(s_cols, mask=n_ok, other=0.0)[None, :]
    return acc


# The pair count only bounds masks: one compiled variant for every count (Triton would otherwise
# compile again for counts that are, or are not, multiples of 16).
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, s_ptr, z_ptr, num_pairs, top_k, N,
                        K, stride_xm, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_ze, stride_zn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                        PDL: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                        INT4: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """out[row] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T) for the BLOCK_M sorted rows of
    this program's block (expert e), over its BLOCK_N columns of the intermediate size N. SCALE:
    0 weights in x's dtype; fp8 weights with scales ``s`` per output channel (1) or per
    SCALE_BN x SCALE_BK tile (2; BLOCK_K divides SCALE_BK). INT4 (with SCALE 2, SCALE_BK the group):
    canonical int4 words [E, K / 8, 2N] (``stride_wn`` their row stride), zero points ``z`` [E, 2N,
    K / G] unpacked (HAS_ZEROS) and scales [E, 2N, K / G]."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    sg_cols = s_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn
    su_cols = s_ptr + expert * stride_se + ((N + offs_n) // SCALE_BN) * stride_sn
    zg_cols = z_ptr + expert * stride_ze + offs_n * stride_zn
    zu_cols = z_ptr + expert * stride_ze + (N + offs_n) * stride_zn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        kb = (k0 * BLOCK_K) // SCALE_BK
        if INT4:
            w_e = w_ptr + expert * stride_we
            g = _int4_tile(w_e, k0, K, offs_n, n_ok, stride_wn, zg_cols, kb, BLOCK_K, HAS_ZEROS)
            u = _int4_tile(w_e, k0, K, N + offs_n, n_ok, stride_wn, zu_cols, kb, BLOCK_K, HAS_ZEROS)
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = _mma(a, g, acc_g, sg_cols, kb, n_ok, SCALE, IEEE)
        acc_u = _mma(a, u, acc_u, su_cols, kb, n_ok, SCALE, IEEE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    acc_g = _channel_scaled(acc_g, sg_cols, n_ok, SCALE)
    acc_u = _channel_scaled(acc_u, su_cols, n_ok, SCALE)
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # rounded where F.linear rounds
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # and F.silu
    out = act * acc_u.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr, s_ptr, z_ptr, num_pairs,
                     N, K, stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_ze, stride_zn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     INT4: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """out[pair] = weight[pair] * (a[row] @ down_e^T) for this block's sorted rows, over BLOCK_N
    of the hidden size N; a holds the gate/up kernel's rows in sorted order. SCALE as there."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_cols = s_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn
    z_cols = z_ptr + expert * stride_ze + offs_n * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        kb = (k0 * BLOCK_K) // SCALE_BK
        if INT4:
            w = _int4_tile(w_ptr + expert * stride_we, k0, K, offs_n, n_ok, stride_wn, z_cols, kb, BLOCK_K, HAS_ZEROS)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, w, acc, s_cols, kb, n_ok, SCALE, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = _channel_scaled(acc, s_cols, n_ok, SCALE)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_pairs_kernel(per_pair_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over the token's TOP_K rows of per_pair, in float32, rounded once."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(per_pair_ptr + (t * TOP_K + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_pairs(per_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``per_pair.view(T, top_k, H).sum(dim=1)`` (float32 sum, one rounding) in one small launch."""
    hidden = per_pair.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, block))](per_pair, out, hidden, TOP_K=top_k, BLOCK=block,
                                                                num_warps=4, **moe_pdl(per_pair.device))
    return out


def default_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Tiles when the table has no entry: short blocks when each expert sees few tokens, and then
    narrow, deep column tiles (the step streams expert weights: more programs, longer loads)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def batch_bucket(num_tokens: int) -> int:
    """The table's batch bucket for a batch: the smallest bucket that holds it (the largest past them)."""
    return next((b for b in BATCH_BUCKETS if b >= num_tokens), BATCH_BUCKETS[-1])


def config_key(num_experts: int, hidden: int, inter: int, fmt: str = "") -> str:
    return f"E={num_experts},H={hidden},I={inter}" + (f",W={fmt}" if fmt else "")


def get_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int, fmt: str = "") -> dict:
    """Tile config for this rank's expert shape, weight format and batch: the table's entry for the
    format, else the 16-bit experts' entry of the shape (quantized experts untuned), else the default."""
    bucket, table = str(batch_bucket(num_tokens)), _config_table()
    for key in dict.fromkeys([config_key(num_experts, hidden, inter, fmt), config_key(num_experts, hidden, inter)]):
        if bucket in table.get(key, {}):
            return dict(table[key][bucket])
    return default_config(num_tokens, top_k, num_experts)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, expert_map: torch.Tensor | None,
            max_tokens: int, dtype: torch.dtype | None = None, scales: ExpertScales | None = None) -> None:
    """Run the kernels once for each distinct tile config of the batch buckets that forwards of
    up to ``max_tokens`` reach (with the alignment each size takes), so that start-up compiles
    them (the precompile pool, in parallel) and none compiles in the middle of a run, where the
    first prefill of a size stalls the host for a second or more (workload 1 on qwen3-30b-a3b:
    15 compiles in the timed run)."""
    num_experts, hidden, two_inter = expert_dims(w13, scales)
    num_global = num_experts if expert_map is None else expert_map.numel()
    largest = batch_bucket(min(max_tokens, CHUNK_TOKENS))
    seen = set()
    for bucket in (b for b in BATCH_BUCKETS if b <= largest):
        tokens = min(bucket, max_tokens)
        cfg = get_config(num_experts, hidden, two_inter // 2, tokens, top_k, weight_format(scales))
        key = (tuple(sorted(cfg.items())), tokens * top_k <= ALIGN_ONE_LAUNCH_MAX_PAIRS)
        if key in seen:
            continue
        seen.add(key)
        ids = torch.arange(tokens * top_k, device=w13.device).view(tokens, top_k) % num_global
        weights = torch.zeros(tokens, top_k, dtype=torch.float32, device=w13.device)
        x = torch.zeros(tokens, hidden, dtype=dtype or w13.dtype, device=w13.device)
        fused_experts_triton(x, w13, w2, weights, ids, expert_map, scales=scales)


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                         config: dict | None = None, scales: ExpertScales | None = None) -> torch.Tensor:
    """``fused_experts_torch``'s result [T, H] from the two grouped-GEMM kernels; ``config``
    overrides the table's tiles (the benchmark's tuning); ``scales``: quantized experts (fp8 or int4)."""
    num_tokens = x.shape[0]
    if num_tokens > CHUNK_TOKENS:
        return torch.cat([fused_experts_triton(x[i:i + CHUNK_TOKENS], w13, w2, weights[i:i + CHUNK_TOKENS],
                                               ids[i:i + CHUNK_TOKENS], expert_map, config, scales)
                          for i in range(0, num_tokens, CHUNK_TOKENS)])
    int4 = scales is not None and scales.group is not None
    num_experts, hidden, two_inter = expert_dims(w13, scales)
    inter, top_k = two_inter // 2, ids.shape[1]
    want_w2 = (num_experts, inter // 8, hidden) if int4 else (num_experts, hidden, inter)  # int4: words [E, I / 8, H]
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1 or w2.shape != want_w2:
        raise ValueError(f"fused_experts_triton: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    cfg = config or get_config(num_experts, hidden, inter, num_tokens, top_k, weight_format(scales))
    block_m, launch = cfg["BLOCK_M"], {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    block_k = cfg["BLOCK_K"]
    if scales is not None and (scales.block is not None or int4):  # a K tile within one scale block or group
        span = scales.group if int4 else scales.block[1]
        block_k = min(block_k, span & -span)
    scale13, scale2 = _scale_args(w13, scales, "w13"), _scale_args(w2, scales, "w2")
    local_ids = ids if expert_map is None else expert_map[ids]
    # One program counts every pair: right for decode-sized batches (where launches dominate), while
    # large prefills, whose pairs would queue on a few atomics, take the torch sort.
    align = align_pairs_triton if local_ids.numel() <= ALIGN_ONE_LAUNCH_MAX_PAIRS else align_pairs
    sorted_pairs, block_expert = align(local_ids, num_experts, block_m)
    pdl = moe_pdl(x.device)
    num_pairs = ids.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(inter, cfg["BLOCK_N"]))
    _moe_gate_up_kernel[grid](x, w13, act, sorted_pairs, block_expert, *scale13[:2], num_pairs, top_k, inter, hidden,
                              x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *scale13[2:6],
                              BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, IEEE=ieee, **scale13[6],
                              **launch, **pdl)
    # Pairs routed to another rank's experts are never written: they must read as zero.
    alloc = torch.empty if expert_map is None else torch.zeros
    per_pair = alloc(num_pairs, hidden, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(hidden, cfg["BLOCK_N"]))
    _moe_down_kernel[grid](act, w2, per_pair, sorted_pairs, block_expert, weights.reshape(-1).float().contiguous(),
                           *scale2[:2], num_pairs, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
                           per_pair.stride(0), *scale2[2:6], BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
                           IEEE=ieee, **scale2[6], **launch, **pdl)
    return sum_pairs(per_pair, num_tokens, top_k)  # accumulated in float32, rounded once


def _scale_args(w: torch.Tensor, scales: ExpertScales | None, which: str) -> tuple:
    """(scales, zero points, their expert and row strides, constexprs) of one expert GEMM's weights."""
    plain = {"INT4": False, "HAS_ZEROS": False}
    if scales is None:
        if w.dtype.itemsize == 1 or w.dtype == torch.int32:
            raise ValueError("quantized expert weights need their scales")
        return w, w, 0, 0, 0, 0, {"SCALE": 0, "SCALE_BN": 1, "SCALE_BK": 1, **plain}
    scale = getattr(scales, which)
    if scales.group is not None:  # int4: per row and group, [E, N, K / G]; zero points alike
        zeros = getattr(scales, f"{which}_zeros")
        n, k = w.shape[2], w.shape[1] * 8
        want = (w.shape[0], n, -(-k // scales.group))
        if tuple(scale.shape) != want or scale.stride(2) != 1 or (zeros is not None and zeros.shape != scale.shape):
            raise ValueError(f"int4 expert scales {tuple(scale.shape)} do not fit words {tuple(w.shape)} (want {want})")
        z = zeros if zeros is not None else scale
        return (scale, z, scale.stride(0), scale.stride(1), z.stride(0), z.stride(1),
                {"SCALE": 2, "SCALE_BN": 1, "SCALE_BK": scales.group, "INT4": True, "HAS_ZEROS": zeros is not None})
    if scales.block is None:
        if scale.shape != w.shape[:2] or scale.stride(1) != 1:
            raise ValueError(f"per-channel expert scales {tuple(scale.shape)} do not fit weights {tuple(w.shape)}")
        return scale, scale, scale.stride(0), 1, 0, 0, {"SCALE": 1, "SCALE_BN": 1, "SCALE_BK": 1, **plain}
    block_n, block_k = scales.block
    if which == "w13" and (w.shape[1] // 2) % block_n:
        raise ValueError(f"block expert scales: the intermediate size {w.shape[1] // 2} is not a multiple of {block_n}")
    want = (w.shape[0], triton.cdiv(w.shape[1], block_n), triton.cdiv(w.shape[2], block_k))
    if tuple(scale.shape) != want or not scale.is_contiguous():
        raise ValueError(f"block expert scales {tuple(scale.shape)} do not fit weights {tuple(w.shape)} in "
                         f"{block_n}x{block_k} blocks (want {want})")
    return scale, scale, scale.stride(0), scale.stride(1), 0, 0, \
        {"SCALE": 2, "SCALE_BN": block_n, "SCALE_BK": block_k, **plain}
