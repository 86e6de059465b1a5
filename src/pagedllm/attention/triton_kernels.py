"""Triton kernels of the GPU attention path: the paged KV write and unified paged attention.

Both launch over grids that depend only on tensor shapes, never on per-request host data,
so they can be captured in CUDA graphs.

Unified attention: one launch for a flat batch of prefill chunks (with cached prefixes) and
decodes. Each program takes ``BLOCK_Q`` query tokens of one sequence times all the query
heads of one KV head (GQA: K/V are loaded once for the whole group), so a tile has
``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows. Programs are numbered as in vLLM's Triton backend:
sequence ``s`` owns programs ``qsl[s] // BLOCK_Q + s ...``, so a grid of
``num_tokens // BLOCK_Q + num_seqs`` covers any batch; a program finds its sequence by
binary search over ``query_start_loc`` and exits when it has no rows. Keys are walked in
tiles of ``BLOCK_N`` tokens gathered through the block table, with an online softmax in
fp32 (exp2, log2(e) folded into the scale).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + block.to(tl.int64) * stride_c_block + off * stride_c_slot + h * stride_c_head + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V ([T, kv_heads, head_dim]) at its slot; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _unified_attention_kernel(
    q_ptr, out_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_seqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # The sequence of this program: the last s with qsl[s] // BLOCK_Q + s <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start_mid = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start_mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    s = lo
    q_begin = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_Q + s)) * BLOCK_Q
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    context_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    q_tok = q_start + m // GROUP_PAD
    head = kvh * GROUP + m % GROUP_PAD
    row_ok = (q_tok < q_len) & (m % GROUP_PAD < GROUP)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_begin + q_tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context_len + q_tok  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)

    kv_end = context_len + tl.minimum(q_start + BLOCK_Q, q_len)  # keys this tile can see
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + q_start - window + 1, 0) // BLOCK_N * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
    for j in range(kv_start, kv_end, BLOCK_N):
        k_pos = j + n
        k_ok = k_pos < kv_end
        phys = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_off = phys * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot + kvh * stride_c_head
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = sc * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(sc - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(cache_ptr + stride_c_kv + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_begin + q_tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def unified_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [T, num_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, >= max blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decode batches: one query token per program, the head group padded to the 16 rows a
    # tensor-core dot needs. Prefill: ~64 rows of (token, head) per program.
    if max_query_len == 1:
        block_q = 1
        block_m = max(group_pad, 16)
    else:
        block_m = max(64, group_pad)
        block_q = block_m // group_pad
    block_n = 64 if head_dim <= 128 else 32
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q, out, kv_cache, block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), num_seqs, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        USE_WINDOW=sliding_window is not None, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out
