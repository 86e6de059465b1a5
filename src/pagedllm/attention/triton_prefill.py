"""Long-query paged attention (prefill chunks): a Triton kernel built for compute-bound runs.

The unified kernel (``triton_kernels``) serves every query run with one loop that masks every
key tile and packs a head group's rows into its tile (what decodes need: one K/V read for the
whole group). A long prefill run is bound by the two dots instead, and there that loop spends
its issue slots on masks and bookkeeping. This kernel takes the runs longer than one short tile:

- a program is ``BLOCK_M`` query tokens of one sequence times **one** query head (the rows of a
  tile are consecutive positions: the causal boundary is one diagonal), heads fastest so the
  programs of one KV head run side by side and read the same K/V tiles through L2;
- the keys are walked in two loops: the tiles every row of the program sees in full, with no
  mask and no bounds check, then the few tiles on the diagonal, masked (``k <= q``, and the
  loads bounded by the run's last key);
- no "row sees nothing yet" guards: key 0 is visible to every row and comes first, so the
  running maximum is finite from the first tile on (no sliding window here);
- programs are numbered from the last q-tile down: the tiles with the most keys start first and
  the short ones fill the tail.

Block ids for a tile are loaded one tile ahead (as in the unified kernel, so Triton's pipeliner
keeps ``num_stages - 1`` K/V tiles in flight). Sliding windows, soft-capping and bidirectional
attention stay on the unified kernel. FP8 caches are widened to q's dtype as there.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.attention.triton_paging import add_values, find_seq, key_scores, load_block_ids


@triton.jit
def _key_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, q_pos, kv_stop, tile_lo, tile_hi,
               scale_log2, stride_c_block, stride_c_slot,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
               MASKED: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    """Online softmax over key tiles ``[tile_lo, tile_hi)``; ``MASKED`` for the diagonal ones."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, DIM_PAD)
    phys_next = load_block_ids(bt_row, tile_lo, tile_hi, kv_stop, n, BLOCK_N, BLOCK_SIZE)
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + n
        phys = phys_next.to(tl.int64)
        phys_next = load_block_ids(bt_row, t + 1, tile_hi, kv_stop, n, BLOCK_N, BLOCK_SIZE)
        kv_ptrs = (phys * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot + head_off)[:, None] + d[None, :]
        if MASKED:  # keys past the run's last one are other sequences' or garbage (NaN): never load them
            kv_mask = (k_pos < kv_stop)[:, None] & (d[None, :] < HEAD_DIM)
        else:
            kv_mask = d[None, :] < HEAD_DIM  # all true (folded away) unless head_dim is padded
        sc = key_scores(q, k_cache_ptr + kv_ptrs, kv_mask, KV_FP8, IEEE)
        if MASKED:
            sc = tl.where(k_pos[None, :] <= q_pos[:, None], sc * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.math.exp2(sc - m_new[:, None])
        else:  # scale_log2 > 0: the row max of the raw scores, scaled; then one FMA per score
            m_new = tl.maximum(m_i, tl.max(sc, axis=1) * scale_log2)
            p = tl.math.exp2(sc * scale_log2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = add_values(acc, alpha, p, v_cache_ptr + kv_ptrs, kv_mask, q.dtype, KV_FP8, IEEE)
        m_i = m_new
    return acc, l_i, m_i


# num_seqs and the block-table width vary from step to step: no specialisation on them.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, kv_scale_ptr,
    scale_log2, num_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, Q_LEN_THRESHOLD: tl.constexpr,
    IEEE: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Heads fastest; q-tiles from the last down (the causal tiles with the most keys first).
    pid = tl.num_programs(0) // NUM_HEADS - 1 - tl.program_id(0) // NUM_HEADS
    head = tl.program_id(0) % NUM_HEADS
    s = find_seq(qsl_ptr, pid, num_seqs, BLOCK_M)
    q_begin = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_M + s)) * BLOCK_M
    if q_start >= q_len:
        return
    if q_len <= Q_LEN_THRESHOLD:  # a short run: the unified kernel's short tiles took it
        return
    context_len = tl.load(seq_lens_ptr + s) - q_len

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    row_ok = q_start + m < q_len
    tok = (q_begin + q_start + m).to(tl.int64)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q_pos = context_len + q_start + m
    first_pos = context_len + q_start
    kv_stop = context_len + tl.minimum(q_start + BLOCK_M, q_len)  # one past the program's last visible key
    full_tiles = (first_pos + 1) // BLOCK_N  # tiles whose every key the first row (so every row) sees

    if KV_FP8:  # k_scale folded into the score multiplier, v_scale into the output
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
    head_off = (head // GROUP) * stride_c_head
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, q_pos, kv_stop,
                               0, full_tiles, scale_log2, stride_c_block, stride_c_slot,
                               BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, False, IEEE, KV_FP8)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, q_pos, kv_stop,
                               full_tiles, tl.cdiv(kv_stop, BLOCK_N), scale_log2, stride_c_block, stride_c_slot,
                               BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, True, IEEE, KV_FP8)
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    out = acc / l_i[:, None]  # every row saw key 0: l >= 1
    o_ptr = out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tile_config(head_dim: int, ieee: bool) -> dict:
    """Query rows, key tile, warps and pipeline depth of the prefill kernel.

    bf16/fp16 at head_dim <= 128: 128 query rows per program on 8 warps (two warpgroups'
    ``wgmma``), 128-key tiles, 3 stages (224 KB of shared memory at head_dim 128, one program
    per SM). Measured on an H100 (``python -m pagedllm.attention.prefill_bench --sweep``, three
    calls): the fastest of the tilings tried from 4,096-token prompts up (432-476 TFLOP/s at
    8-16k tokens, against 405-445 for 64-key tiles and 274-301 for the unified kernel); level
    with the unified kernel at 1,024 (214 vs 203), behind it at 8 prompts of 512 (133 vs 144).
    head_dim 256 halves the rows to keep the fp32 accumulator in registers. fp32 (IEEE dots on
    CUDA cores, exact checks only): small tiles that do not spill.
    """
    if ieee:
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
    if head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


@functools.cache
def _gluon_prefill():
    """The Gluon kernel's module, or None where this Triton has no Gluon, one that lacks what it uses, or one
    that does not import here (Triton's interpreter: an assertion)."""
    try:
        from pagedllm.attention import gluon_prefill
    except (ImportError, AttributeError, AssertionError):
        return None
    return gluon_prefill


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale_log2: float, out: torch.Tensor,
                      kv_scale: torch.Tensor | None, q_len_threshold: int, kv_fp8: bool) -> None:
    """Causal attention of every query run longer than ``q_len_threshold`` tokens (the others are
    left to the unified kernel's short tiles); arguments as ``unified_attention``'s, checked there.
    The grid depends only on shapes (CUDA-graph safe). On Hopper the warp-specialized Gluon kernel takes them
    where it applies (``gluon_prefill.supports``)."""
    gluon = _gluon_prefill() if q.is_cuda else None  # (no Gluon import on a CPU; fp8 caches: supports says no)
    if gluon is not None and gluon.supports(q, kv_cache, out):
        gluon.prefill_attention_ws(q, kv_cache, block_tables, query_start_loc, seq_lens, scale_log2, out,
                                   q_len_threshold)
        return
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    cfg = prefill_tile_config(head_dim, q.dtype == torch.float32)
    grid = ((num_tokens // cfg["BLOCK_M"] + num_seqs) * num_heads,)
    _prefill_kernel[grid](
        q, out, *kv_cache.unbind(), block_tables, seq_lens, query_start_loc, q if kv_scale is None else kv_scale,
        scale_log2, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=num_heads // kv_cache.shape[3], BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), Q_LEN_THRESHOLD=q_len_threshold, IEEE=q.dtype == torch.float32,
        KV_FP8=kv_fp8, **cfg,
    )
