"""The fused-MoE Triton kernel: (token, slot) pairs sorted by expert and padded to the tile
height, one grouped GEMM for gate/up with SiLU-and-mul in its epilogue, one grouped GEMM for
down scaled by the routing weight, then the top-k sum.

``align_pairs`` (torch, no host sync: CUDA graphs capture it) lays the pairs out so that every
``BLOCK_M`` rows of the sorted order belong to one expert; each program of a GEMM takes one such
block and one ``BLOCK_N`` column tile, reading that expert's weights. Tile sizes come from
``fused_moe_configs.json`` by (experts, hidden, intermediate, batch bucket), which
``pagedllm.benchmarks.moe_kernel --tune`` rewrites; shapes it lacks take ``default_config``.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.ops.fused_moe import ExpertScales
from pagedllm.ops.precompile import in_dry_run
from pagedllm.ops.triton_pdl import launch_args, pdl_enabled, pdl_enter
from pagedllm.ops.tile_tables import read_table

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "fused_moe_configs.json")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Larger batches run in chunks of this many tokens: the intermediate buffers stay bounded.
CHUNK_TOKENS = 8192
ALIGN_ONE_LAUNCH_MAX_PAIRS = 4096  # (token, slot) pairs up to which align_pairs_triton lays them out


def _pdl(device: torch.device) -> dict:
    """The launch arguments of a fused-MoE kernel: launched early (``triton_pdl``) where the
    device can and ``PAGEDLLM_MOE_PDL`` is not 0 (a decode step's MoE is a chain of five short
    launches, each waiting for the one before it in ``pdl_enter``)."""
    return launch_args(pdl_enabled(device, "PAGEDLLM_MOE_PDL"))


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
def _valid_expert(expert, num_experts):
    """An id outside [0, num_experts) as -1 (a pair no expert here takes): never an address past the counts."""
    return tl.where(expert < num_experts, expert, -1)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, cursor_ptr, num_pairs, num_experts, max_blocks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
                      PDL: tl.constexpr):
    """align_pairs in one program: count each expert's pairs (atomics), pad the counts to BLOCK_M
    and prefix-sum them into each expert's first row, give every block its expert, then place each
    pair at its expert's next free row. The order of pairs within an expert's rows is whatever the
    atomics give: each row is computed on its own, so results do not depend on it."""
    pdl_enter(PDL)
    e_offs = tl.arange(0, E_PAD)
    e_ok = e_offs < num_experts
    tl.store(cursor_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32))
    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                 mask=rows < max_blocks * BLOCK_M)
    tl.debug_barrier()
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        expert = _valid_expert(tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32), num_experts)
        tl.atomic_add(cursor_ptr + expert, 1, mask=expert >= 0)
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + e_offs, mask=e_ok, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    tl.debug_barrier()  # every count is read before the cursors overwrite them
    tl.store(cursor_ptr + e_offs, (block_end - blocks) * BLOCK_M, mask=e_ok)
    for b0 in range(0, max_blocks, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        before = (block_end[None, :] <= b[:, None]) & e_ok[None, :]
        owner = tl.sum(before.to(tl.int32), axis=1)  # experts whose blocks all end before b
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < max_blocks)
    tl.debug_barrier()
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        expert = _valid_expert(tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32), num_experts)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=expert >= 0)
        tl.store(sorted_pairs_ptr + row, pairs, mask=expert >= 0)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
                  ROUND_FP16: tl.constexpr, PDL: tl.constexpr):
    """One token's routing: scores (softmax or sigmoid, float32), its TOP_K best experts (the
    lowest id first among equal scores), the weights renormalised and rounded as asked."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    ok = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    # Below any score: never picked. NaN scores too (a NaN in the hidden states, or the garbage of
    # a launch the compile dry run skipped): every id stays a valid expert, whatever the input.
    scores = tl.where(ok & (scores == scores), scores, -1.0)
    k_offs = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, offs, E_PAD), axis=0)
        vals = tl.where(k_offs == j, best, vals)
        ids = tl.where(k_offs == j, pick.to(tl.int64), ids)
        scores = tl.where(offs == pick, -2.0, scores)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(k_offs < TOP_K, vals, 0.0), axis=0)
    if ROUND_BF16:
        vals = vals.to(tl.bfloat16).to(tl.float32)
    if ROUND_FP16:
        vals = vals.to(tl.float16).to(tl.float32)
    tl.store(weights_ptr + row * TOP_K + k_offs, vals, mask=k_offs < TOP_K)
    tl.store(ids_ptr + row * TOP_K + k_offs, ids, mask=k_offs < TOP_K)


def route_triton(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                 round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_moe.route`` in one launch (torch's softmax, top-k, sum and division take five small
    kernels a layer, which a decode step feels): float32 weights (rounded to ``round_to`` if
    given) and int64 expert ids, [T, top_k]."""
    num_tokens, num_experts = router_logits.shape
    # While compiles are collected this launch may be skipped: the align kernel must then read valid ids.
    alloc = torch.zeros if in_dry_run() else torch.empty
    weights = alloc(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = alloc(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        e_pad = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, SIGMOID=scoring == "sigmoid",
                                     RENORMALIZE=renormalize, ROUND_BF16=round_to == torch.bfloat16,
                                     ROUND_FP16=round_to == torch.float16, num_warps=1 if e_pad <= 256 else 4,
                                     **_pdl(logits.device))
    return weights, ids


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
                                                                num_warps=4, **_pdl(per_pair.device))
    return out


def align_pairs_triton(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_pairs``' layout from one Triton launch (the torch version takes a dozen small
    kernels per layer, which a decode step feels); the same blocks, pairs in any order within an expert."""
    num_pairs = local_ids.numel()
    max_blocks = min(num_experts, num_pairs) + triton.cdiv(num_pairs, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    if in_dry_run():  # the align launch may be skipped while the GEMMs (compiled before) run: no garbage ids
        sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=local_ids.device)
        block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=local_ids.device)
    else:
        sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=local_ids.device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=local_ids.device)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=local_ids.device)
    _moe_align_kernel[(1,)](local_ids.reshape(-1), sorted_pairs, block_expert, cursor, num_pairs, num_experts,
                            max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=1024,
                            CHUNK_B=max(16, min(64, 8192 // e_pad)), num_warps=4, **_pdl(local_ids.device))
    return sorted_pairs, block_expert


def align_pairs(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32): the flat
    (token, slot) pair indices grouped by expert, each expert's run padded to a multiple of
    ``block_m`` with ``num_pairs`` (a row the kernels skip), and each block's expert (-1 past the
    last used block). Pairs whose expert is -1 (another rank's) are left out. Shapes depend on the
    pair count only, and nothing is read back to the host: a CUDA graph can hold it."""
    flat = local_ids.reshape(-1).long()
    num_pairs = flat.numel()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # bucket E: not on this rank
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    row_begin = torch.cat([(block_end - blocks) * block_m, block_end[-1:] * 0 - 1])  # bucket E: dropped
    count_begin = torch.cumsum(counts, 0) - counts
    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - count_begin[sorted_bucket]
    max_blocks = min(num_experts, num_pairs) + triton.cdiv(num_pairs, block_m)
    max_rows = max_blocks * block_m
    dest = torch.where(sorted_bucket < num_experts, row_begin[sorted_bucket] + rank_in_expert, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:max_rows], block_expert


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


def config_key(num_experts: int, hidden: int, inter: int) -> str:
    return f"E={num_experts},H={hidden},I={inter}"


@functools.lru_cache(maxsize=1)
def _config_table() -> dict:
    return read_table(CONFIG_FILE)


def reload_config_table() -> None:
    _config_table.cache_clear()


def get_config(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int) -> dict:
    """Tile config for this rank's expert shape and batch: the table's entry, else the default."""
    entry = _config_table().get(config_key(num_experts, hidden, inter), {})
    return dict(entry.get(str(batch_bucket(num_tokens))) or default_config(num_tokens, top_k, num_experts))


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, expert_map: torch.Tensor | None,
            max_tokens: int, dtype: torch.dtype | None = None, scales: ExpertScales | None = None) -> None:
    """Run the kernels once for each distinct tile config of the batch buckets that forwards of
    up to ``max_tokens`` reach (with the alignment each size takes), so that start-up compiles
    them (the precompile pool, in parallel) and none compiles in the middle of a run, where the
    first prefill of a size stalls the host for a second or more (workload 1 on qwen3-30b-a3b:
    15 compiles in the timed run)."""
    num_experts, two_inter, hidden = w13.shape
    if scales is not None and scales.group is not None:  # int4 words [E, H / 8, 2I]
        two_inter, hidden = w13.shape[2], w13.shape[1] * 8
    num_global = num_experts if expert_map is None else expert_map.numel()
    largest = batch_bucket(min(max_tokens, CHUNK_TOKENS))
    seen = set()
    for bucket in (b for b in BATCH_BUCKETS if b <= largest):
        tokens = min(bucket, max_tokens)
        cfg = get_config(num_experts, hidden, two_inter // 2, tokens, top_k)
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
    overrides the table's tiles (the benchmark's tuning); ``scales``: fp8 weights (W8A16)."""
    num_tokens = x.shape[0]
    if num_tokens > CHUNK_TOKENS:
        return torch.cat([fused_experts_triton(x[i:i + CHUNK_TOKENS], w13, w2, weights[i:i + CHUNK_TOKENS],
                                               ids[i:i + CHUNK_TOKENS], expert_map, config, scales)
                          for i in range(0, num_tokens, CHUNK_TOKENS)])
    int4 = scales is not None and scales.group is not None
    if int4:  # canonical words [E, K / 8, N]
        num_experts, hidden, two_inter = w13.shape[0], w13.shape[1] * 8, w13.shape[2]
        want_w2 = (num_experts, two_inter // 16, hidden)
    else:
        num_experts, two_inter, hidden = w13.shape
        want_w2 = (num_experts, hidden, two_inter // 2)
    inter, top_k = two_inter // 2, ids.shape[1]
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1 or w2.shape != want_w2:
        raise ValueError(f"fused_experts_triton: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    cfg = config or get_config(num_experts, hidden, inter, num_tokens, top_k)
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
    pdl = _pdl(x.device)
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
