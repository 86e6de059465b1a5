"""Triton kernels of the GPU attention path: the paged KV write and unified paged attention.

Every launch has a grid that depends only on tensor shapes and Python constants, never on
per-request host data or on values read back from the device, so the launches can be
captured in CUDA graphs and replayed with new metadata in the same buffers.

Unified attention: one launch for a flat batch of prefill chunks (with cached prefixes) and
decodes. A program takes ``BLOCK_Q`` query tokens of one sequence times all the query heads
of one KV head (GQA: each K/V tile is loaded once for the whole group), a tile of
``BLOCK_M >= BLOCK_Q * GROUP_PAD`` rows (at least 16, what a tensor-core dot needs, so a
decode's head group is padded up to 16 rows). Programs are numbered as in vLLM's Triton
backend: sequence ``s`` owns q-tiles ``qsl[s] // BLOCK_Q + s`` onwards, so
``num_tokens // BLOCK_Q + num_seqs`` q-tiles cover any batch (with ``BLOCK_Q == 1`` q-tile
``t`` is simply token ``t``); the grid is that times ``num_kv_heads``, KV head fastest. A
program finds its sequence by binary search over ``query_start_loc`` and returns at once when
it owns no query rows. Short query runs (decodes) and long ones (prefill chunks) go to two
launches with small and large tiles, each skipping the other's sequences. Keys are walked in
tiles of ``BLOCK_N`` tokens gathered through the block table (the tile may be smaller or
larger than the cache's block), with an online softmax in fp32 (exp2, log2(e) folded into the
scale). KERNEL_NOTES.md beside this has the roofline and what was checked for sm_90.

Split-KV (flash decoding): with few (sequence, KV head) pairs, each program's key range is
cut into parts run by separate programs (grid axis 1), which write unnormalised partial
outputs with their running max and sum, merged by a second small kernel, or, in launches of
enough program rows (``_self_merges``), by the last of a (query tile, KV head)'s programs to
finish (``_merge_own_splits``: a counter per program row, reset by that program, so one zeroed buffer
serves every launch and graph replay). The split count
is a runtime value (the grid's second extent), so one compiled variant serves every count up
to ``MAX_SPLITS``: a fresh machine compiles two kernels for split decodes, not two per count.
A step with prefill chunks splits its decodes too, from host facts the backend reads off the step
(``short_runs``: a decode beside the chunks often has a context of thousands of keys that one
program would walk alone): one program per (sequence, KV head, split) there, partials indexed by
sequence (``Q_LEN_FILTER`` 3), and that launch runs on a second stream beside the chunks' (``_fork``).

FP8 KV cache (``kv_cache`` in float8 e4m3fn / e5m2, ``kv_scale`` = float32 ``[k_scale, v_scale]``
on the device, read through a pointer so CUDA graphs see later values): the KV write stores
``saturate(x / scale)`` (IEEE division and round-to-nearest-even, bit for bit torch's); the
attention loop widens each K/V tile to q's dtype (exact) before the dots, or to float16 for
bfloat16 queries (``F16_DOTS``: one conversion per pair instead of three; q is converted once),
and folds the scales in once, k_scale into the score multiplier and v_scale into the
accumulator. Wide decode launches (``FP8_WORDS``) read V as 32-bit words widened in registers, so
that P @ V meets a 16-bit tile (``triton_paging.fp8_rows_widened``; KERNEL_NOTES.md, stop 48). A
model-dtype cache compiles the same code as before (``KV_FP8`` / ``FP8_MAX`` are constexpr switches).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.attention.kv_quant import FP8_MAX, is_fp8
from pagedllm.attention.triton_prefill import prefill_attention
from pagedllm.attention.triton_paging import (add_fp8_values_as_words, add_values, find_seq, key_scores,
                                              load_block_ids, words_dims)
from pagedllm.ops.triton_pdl import enter_args, pdl_enter
from pagedllm.ops.triton_splitk import counters, last_to_arrive

LOG2_E = math.log2(math.e)
MAX_SPLITS = 16  # split-KV parts per (token, head) at most
MAX_SPLITS_C = tl.constexpr(MAX_SPLITS)


# ---- KV write ----------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_block, stride_c_slot, stride_c_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, FP8_MAX: tl.constexpr, ENTER: tl.constexpr = False,
):
    pdl_enter(ENTER)  # launched early (ops/triton_pdl.py): wait for the kernel before first
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = h < NUM_KV_HEADS
    if DIM_PAD != HEAD_DIM:
        mask = mask & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_c_block + off * stride_c_slot + h * stride_c_head + d
    store_kv(k_cache_ptr + dst, k, kv_scale_ptr, FP8_MAX, mask)
    store_kv(v_cache_ptr + dst, v, kv_scale_ptr + 1, FP8_MAX, mask)


@triton.jit
def store_kv(dst, x, scale_ptr, FP8_MAX: tl.constexpr, mask):
    """Store K or V values ``x`` (model dtype) into the cache at ``dst``: as they are, or in an fp8
    cache ``saturate(x / scale)`` (IEEE division, as torch), rounded to nearest even."""
    if FP8_MAX > 0:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -FP8_MAX, FP8_MAX)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Store token ``t``'s K/V (``[num_tokens, num_kv_heads, head_dim]``, rows may be strided
    views of a fused projection) at flat slot ``slot_mapping[t]`` of ``kv_cache``
    (``[2, num_blocks, block_size, num_kv_heads, head_dim]``); slot -1 is skipped. An fp8 cache
    stores ``saturate(x / scale)`` with ``kv_scale`` = float32 ``[k_scale, v_scale]``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    bound = check_kv_write(key, value, kv_cache, slot_mapping, kv_scale)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping, slot_mapping if kv_scale is None else kv_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim), FP8_MAX=bound,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1, **enter_args(key.device, num_tokens),
    )


def check_kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scale: torch.Tensor | None) -> float:
    """Raise unless ``key`` and ``value`` [T, Hk, D] (last dim contiguous) can be written into
    ``kv_cache`` [2, blocks, block_size, Hk, D] at ``slot_mapping``; the cache's ``fp8_max``."""
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if value.shape != key.shape or tuple(kv_cache.shape[3:]) != tuple(key.shape[1:]) or kv_cache.shape[0] != 2:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and kv_cache "
                         f"{tuple(kv_cache.shape)} disagree on [num_kv_heads, head_dim]")
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.is_contiguous()
    return fp8_max(kv_cache, kv_scale)


def fp8_max(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> float:
    """The saturation bound of an fp8 cache (its kernels' switch), 0.0 for a cache in the model dtype."""
    if not is_fp8(kv_cache.dtype):
        return 0.0
    if kv_scale is None or kv_scale.dtype != torch.float32 or kv_scale.numel() != 2:
        raise ValueError(f"a {kv_cache.dtype} KV cache needs kv_scale, float32 [k_scale, v_scale]; got "
                         f"{None if kv_scale is None else (kv_scale.dtype, tuple(kv_scale.shape))}")
    return FP8_MAX[kv_cache.dtype]


# ---- unified attention -------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh from exp2 (exact at +-inf, no overflow): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    e = tl.math.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# num_seqs, window and the block-table width (stride_bt) vary from step to step: specialising
# on them (== 1, % 16 == 0) would compile new variants in the middle of a run.
@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt", "min_split_tiles"])
def _attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, kv_scale_ptr,
    part_out_ptr, part_m_ptr, part_l_ptr, cnt_ptr,  # split-KV partials and counters; unused unless SPLIT
    min_split_tiles,  # SELF_MERGE: key tiles a part holds at least (an argument: it varies with the batch)
    scale_log2, num_seqs, window, num_heads, softcap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    Q_LEN_FILTER: tl.constexpr, Q_LEN_THRESHOLD: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
    CAUSAL: tl.constexpr = True, ENTER: tl.constexpr = False, F16_DOTS: tl.constexpr = False,
    FP8_WORDS: tl.constexpr = False, SELF_MERGE: tl.constexpr = False,
):
    # Launched early (ops/triton_pdl.py): the step's metadata (query_start_loc, seq_lens) was copied
    # before the forward's first kernel started, so it is read before the wait; the programs that
    # have nothing to do (past the query run, the other launch's runs, parts past the row's count)
    # return while the kernel before still runs. pdl_enter comes before the first read of q.
    # One flat grid axis, KV head fastest: the programs of one sequence run side by side and
    # read the same cache blocks (each slot holds all KV heads) at about the same time.
    pid = tl.program_id(0) // NUM_KV_HEADS
    kvh = tl.program_id(0) % NUM_KV_HEADS
    if Q_LEN_FILTER == 3:  # a mixed step's split short runs: program = sequence (one q-tile each)
        s = pid
    else:
        s = find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_begin
    if Q_LEN_FILTER == 3:
        q_start = 0
    elif BLOCK_Q == 1:
        q_start = pid - q_begin
    else:
        q_start = (pid - (q_begin // BLOCK_Q + s)) * BLOCK_Q
    if q_start >= q_len:
        return
    # Two launches can share a batch: short query runs (decodes) in small tiles, long ones
    # (prefill chunks) in large tiles; each launch skips the other's sequences.
    if Q_LEN_FILTER % 2 == 1:
        if q_len > Q_LEN_THRESHOLD:
            return
    if Q_LEN_FILTER == 2:
        if q_len <= Q_LEN_THRESHOLD:
            return
    seq_len = tl.load(seq_lens_ptr + s)
    context_len = seq_len - q_len  # the sequence's tokens before this step's

    # Row m of the tile: query token q_start + m // GROUP_PAD, head m % GROUP_PAD of the group.
    m = tl.arange(0, BLOCK_M)
    q_tok = q_start + m // GROUP_PAD
    head = kvh * GROUP + m % GROUP_PAD
    row_ok = (m // GROUP_PAD < BLOCK_Q) & (q_tok < q_len) & (m % GROUP_PAD < GROUP)
    q_pos = context_len + q_tok  # absolute position of each row's query token

    # Keys this tile can see: up to its last query token (causal; else all), from the window's start.
    if CAUSAL:
        kv_stop = context_len + tl.minimum(q_start + BLOCK_Q, q_len)
    else:
        kv_stop = seq_len
    kv_first = 0
    if USE_WINDOW:
        kv_first = tl.maximum(context_len + q_start - window + 1, 0)
    tile_lo = kv_first // BLOCK_N
    tile_hi = tl.cdiv(kv_stop, BLOCK_N)
    num_splits = 1
    if SPLIT:
        split = tl.program_id(1)
        num_splits = tl.num_programs(1)
        if SELF_MERGE:  # parts of min_split_tiles tiles or more: short contexts take fewer (or one)
            num_splits = tl.maximum(tl.minimum(num_splits, (tile_hi - tile_lo) // min_split_tiles), 1)
            if split >= num_splits:
                return
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    pdl_enter(ENTER)  # q, the K/V cache and the outputs are the kernels' before: wait for them
    d = tl.arange(0, DIM_PAD)
    tok = (q_begin + q_tok).to(tl.int64)
    q_mask = row_ok[:, None]
    if DIM_PAD != HEAD_DIM:
        q_mask = q_mask & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if F16_DOTS:
        # bf16 queries over an fp8 cache: the dots run in float16, which fp8 K/V widen to in one
        # instruction per pair (to bfloat16 it takes two more, through float16). q is exact in
        # float16 between 2**-14 and 65504 (bfloat16 has 8 significant bits, float16 11); beyond
        # the range it saturates, smaller entries lose bits in float16's subnormals.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    if KV_FP8:
        # fp8 K/V tiles are widened to q's dtype (exact) for the dots; the per-tensor scales are
        # folded in once: k_scale into the score multiplier, v_scale into the output.
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
    head_off = kvh * stride_c_head
    # The block-table entries of each tile are loaded one iteration ahead: a K/V address that
    # hangs on a load of the same iteration keeps Triton's pipeliner to a single K/V buffer
    # (seen in the TTGIR for sm_90), while this way K/V arrive num_stages - 1 tiles ahead.
    phys_next = load_block_ids(bt_row, tile_lo, tile_hi, kv_stop, n, BLOCK_N, BLOCK_SIZE)
    for t in range(tile_lo, tile_hi):
        k_pos = t * BLOCK_N + n
        k_ok = k_pos < kv_stop
        phys = phys_next.to(tl.int64)
        phys_next = load_block_ids(bt_row, t + 1, tile_hi, kv_stop, n, BLOCK_N, BLOCK_SIZE)
        kv_off = phys * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot + head_off
        kv_mask = k_ok[:, None]
        if DIM_PAD != HEAD_DIM:
            kv_mask = kv_mask & (d[None, :] < HEAD_DIM)
        sc = key_scores(q, k_cache_ptr + kv_off[:, None] + d[None, :], kv_mask, KV_FP8, IEEE) * scale_log2
        if SOFTCAP:  # Gemma 2: cap * tanh(s / cap); scale_log2 is scale / cap, softcap_log2 cap * log2(e)
            sc = _tanh(sc) * softcap_log2
        if CAUSAL:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        else:  # encoders: every row sees the whole sequence
            visible = (q_pos[:, None] >= 0) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.math.exp2(sc - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8_WORDS:  # an fp8 cache (_tile_config decides where)
            acc = add_fp8_values_as_words(acc, alpha, p, v_cache_ptr + kv_off[:, None], k_ok[:, None], q.dtype, IEEE,
                                          HEAD_DIM, DIM_PAD)
        else:
            acc = add_values(acc, alpha, p, v_cache_ptr + kv_off[:, None] + d[None, :], kv_mask, q.dtype, KV_FP8, IEEE)
        m_i = m_new

    if FP8_WORDS:  # acc's columns in fp8_rows_widened's order
        d = words_dims(d, DIM_PAD)
    d_mask = d[None, :] < HEAD_DIM
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if num_splits == 1:  # unsplit, or a self-merging split launch's row whose keys fill one part
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0: padding row, writes 0
        o_ptr = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask)
    else:
        # A mixed step's short runs (Q_LEN_FILTER 3) fit one q-tile each (q_start 0): their partials are
        # rows s * BLOCK_Q + q_tok, a buffer sized by the sequences, not by the step's tokens.
        prow = s.to(tl.int64) * BLOCK_Q + q_tok if Q_LEN_FILTER == 3 else tok
        first = (prow * num_heads + head) * tl.num_programs(1)  # the row's partial of split 0
        part = first + tl.program_id(1)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=row_ok[:, None] & d_mask)
        if SELF_MERGE:
            _merge_own_splits(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, cnt_ptr + tl.program_id(0), num_splits,
                              first, row_ok, tok, head, d, d_mask, stride_ot, stride_oh, DIM_PAD)


@triton.jit
def _split_weights(m, l, AXIS: tl.constexpr):
    """The splits' weights ``exp2(m - max m)`` along ``AXIS`` (splits that saw no key, or do not exist, have
    m = -inf: weight 0; a row no split saw a key of has max 0) and the weighted sum of their ``l``."""
    m_max = tl.max(m, axis=AXIS, keep_dims=True)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    return w, tl.sum(w * l, axis=AXIS)


@triton.jit
def _merge_own_splits(out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, cnt_ptr, splits, first, row_ok, tok, head, d,
                      d_mask, stride_ot, stride_oh, DIM_PAD: tl.constexpr):
    """After a split program has stored its partials: count it in (``cnt_ptr``, this program row's
    counter); the last of the row's splits to arrive merges every split's partials, in split order
    (so the result does not depend on which finished last), writes the output rows and resets the
    counter for the next launch. Every split's max and sum come in one load, so the weights are known
    before the partial outputs are read, and those loads (predicated past the split count) do not wait
    on each other. The count and its ordering: ``triton_splitk.last_to_arrive``. ``splits``: the row's
    parts (those that ran)."""
    if last_to_arrive(cnt_ptr, splits):
        sp = tl.arange(0, MAX_SPLITS_C)
        ok = row_ok[:, None] & (sp[None, :] < splits)
        m = tl.load(part_m_ptr + first[:, None] + sp[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_l_ptr + first[:, None] + sp[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        w, total = _split_weights(m, l, 1)
        acc = tl.zeros([first.shape[0], DIM_PAD], dtype=tl.float32)
        for split in tl.static_range(MAX_SPLITS_C):
            w_s = tl.sum(tl.where(sp[None, :] == split, w, 0.0), axis=1)
            acc += w_s[:, None] * tl.load(part_out_ptr + (first + split)[:, None] * DIM_PAD + d[None, :],
                                          mask=row_ok[:, None] & d_mask & (d[None, :] * 0 + split < splits), other=0.0,
                                          cache_modifier=".cg")
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # total == 0: padding row, writes 0
        o_ptr = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask)
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch (and the next graph replay)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, qsl_ptr, num_seqs, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, ENTER: tl.constexpr = False,
    BY_SEQ: tl.constexpr = 0,
):
    """One program a (partial row, head). ``BY_SEQ`` 0: row = token. ``BY_SEQ`` = BLOCK_Q > 0: a mixed
    step's short runs, row = s * BLOCK_Q + i for token i of sequence s; rows of runs longer than
    BLOCK_Q (the prefill chunks, written by their own launch) or past a run's end are skipped."""
    pdl_enter(ENTER)
    prow = tl.program_id(0)
    head = tl.program_id(1)
    if BY_SEQ > 0:
        s = prow // BY_SEQ
        q_begin = tl.load(qsl_ptr + s)
        q_len = tl.load(qsl_ptr + s + 1) - q_begin
        if (q_len > BY_SEQ) | (prow % BY_SEQ >= q_len):
            return
        tok = q_begin + prow % BY_SEQ
    else:
        tok = prow
        if tok >= tl.load(qsl_ptr + num_seqs):  # a padding row of no sequence
            return
    split = tl.arange(0, MAX_SPLITS)
    ok = split < num_splits
    part = (prow.to(tl.int64) * num_heads + head) * num_splits + split
    m = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    w, total = _split_weights(m, l, 0)
    d = tl.arange(0, DIM_PAD)
    acc = tl.load(part_out_ptr + part[:, None] * DIM_PAD + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU: behave as on an H100


WIDE_DECODE_ROWS = 128  # decode launches of at least this many tokens take 64-key, 2-stage tiles (16-bit caches)


def _tile_config(long_queries: bool, block_q_1: bool, group_pad: int, head_dim: int, ieee: bool,
                 fp8_unsplit: bool = False, wide_decode: bool = False) -> dict:
    """Tile shapes and launch settings. Not yet tuned on the device; the reasoning, checked
    against ptxas's report for sm_90 (no spills in any of these):

    - Short query runs (decodes): ``BLOCK_M`` 16 rows, one token's head group padded up to a
      tensor-core dot (``mma.sync``), or ``16 // group`` tokens when the hint allows longer
      runs. Memory-bound, so small key tiles (32) and 3 pipeline stages: K/V arrive through
      16-byte ``cp.async`` two tiles ahead, ~22 KB of shared memory and ~94 registers for
      hd 128, so several programs share an SM and short contexts still take a few iterations.
    - Long runs (prefill chunks): ``BLOCK_M`` 128 rows, 8 warps, ``wgmma``; every K/V tile is
      used by 128 query rows, so a long prompt re-reads its context few times; 64-key tiles,
      2 stages (~96 KB of shared memory, ~180 registers: one program per SM).
    - Short runs over an fp8 cache without split-KV (``fp8_unsplit``): 128-key tiles, 2 stages.
      An fp8 tile holds half the bytes, and the widening to q's dtype costs issue slots; on the
      H100 (``kernel_bench --kv-cache-dtype fp8``) 32-key tiles reached 0.60-0.64 of copy
      bandwidth at 64-256 sequences x 1-2k tokens, 128-key tiles 0.65-0.76. Split decodes
      (few sequences, short parts) keep 32-key tiles. Those of ``WIDE_DECODE_ROWS`` tokens and more
      read V as words (``FP8_WORDS``): 0.90-0.92x the time at 128-256 sequences on the H200,
      1.04-1.13x below (the extra pass of the 16-bit tile through shared memory; KERNEL_NOTES.md).
    - Decode launches of ``WIDE_DECODE_ROWS`` tokens and more over a 16-bit cache without split-KV
      (``wide_decode``): 64-key tiles, 2 stages. With that many programs in flight per SM the third
      stage only costs occupancy: on the H100 (``kernel_bench``) 256 sequences x 1,024 tokens went
      from 0.94 to 0.99 of copy bandwidth (382 -> 363 µs a layer), while 32 x 384 was 5% slower
      with them (the default stays below the threshold).
    - head_dim 256 halves the tiles to keep the fp32 accumulator in registers.
    - fp32 (IEEE dots on CUDA cores; exact checks only, never the fast path): 16-key tiles and
      at most 32 rows, where larger tiles spill kilobytes.
    """
    big = head_dim > 128
    if long_queries:
        if ieee:
            block_m, block_n, warps = 32, 16, 8 if big else 4
        elif big:
            block_m, block_n, warps = 64, 32, 8
        else:
            block_m, block_n, warps = 128, 64, 8
        block_m = max(block_m, group_pad)
        return dict(BLOCK_Q=block_m // group_pad, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=2)
    block_q = 1 if block_q_1 else max(1, 16 // group_pad)
    block_m = max(16, block_q * group_pad)
    block_n, stages = (16 if (big or ieee) else 32), (2 if big else 3)
    words = False
    if fp8_unsplit and not (big or ieee):
        # V as words (fp8_rows_widened): 4-byte words of a row; mma.sync tiles (wgmma needs 64 rows)
        block_n, stages, words = 128, 2, wide_decode and block_q_1 and head_dim % 4 == 0 and block_m < 64
    elif wide_decode and block_q_1 and not (big or ieee):
        block_n, stages = 64, 2
    return dict(BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if (big and ieee) else 4,
                num_stages=stages, FP8_WORDS=words)


def _check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                            sliding_window: int | None, logits_soft_cap: float | None = None,
                            kv_scale: torch.Tensor | None = None) -> None:
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None)")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be > 0 (or None)")
    if fp8_max(kv_cache, kv_scale) > 0:  # fp8 K/V are widened for the dots (to q's dtype, or float16)
        if out.dtype != q.dtype:
            raise ValueError(f"q {q.dtype} and out {out.dtype} must share a dtype")
    elif q.dtype != kv_cache.dtype or out.dtype != q.dtype:
        raise ValueError(f"q {q.dtype}, kv_cache {kv_cache.dtype} and out {out.dtype} must share a dtype")
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.is_contiguous()


SELF_MERGE_MIN_ROWS = 16  # split launches of at least this many program rows (tokens x KV heads) merge themselves
# ... and split each row by its own context into parts of at least this many keys (fewer parts, or one
# written directly, over short contexts; the programs of parts past a row's count exit at once)
SPLIT_MIN_KEYS = 128


def _self_merges(program_rows: int) -> bool:
    """Whether a split launch merges its partials in its own last programs (``_merge_own_splits``)
    rather than in a second launch (``_merge_splits``). H200, one layer's KV write and attention in
    a CUDA graph (KERNEL_NOTES.md, stop 50): the second launch was most of a short context's cost
    (32 sequences x 4 KV heads over 128 keys, 3 splits: 16.1 -> 11.0 µs; 2 x 8 over 128, 16 splits:
    9.9 -> 7.9), and level or better over long ones (32 x 4 over 16k keys: 268.5 -> 262.9), but for one
    sequence (8 rows, 16 splits) the merge in the last programs made the tail of long contexts longer
    (16k keys: 34.2 -> 37.1 µs) for little at short ones (128 keys: 8.2 -> 7.7)."""
    return program_rows >= SELF_MERGE_MIN_ROWS


MIXED_SPLIT_KEYS = 1024  # a mixed step's short runs are split into parts of about this many keys or more
MIXED_SPLIT_WAVES = 4  # ... until their programs fill the SMs this many times over


def short_run_tokens(num_heads: int, num_kv_heads: int) -> int:
    """The longest query run a batch's short-run (decode) tiles take: runs up to it are short."""
    return _tile_config(False, False, triton.next_power_of_2(num_heads // num_kv_heads), 128, False)["BLOCK_Q"]


def count_short_runs(query_start_loc_cpu: list[int], seq_lens_cpu: list[int], max_tokens: int,
                     sliding_window: int | None = None) -> tuple[int, int]:
    """(count, keys attended) of the runs of 1..``max_tokens`` query tokens (host lists of a step); a
    run attends its context, or about the window's last keys."""
    count = keys = 0
    for i, seq_len in enumerate(seq_lens_cpu):
        q_len = query_start_loc_cpu[i + 1] - query_start_loc_cpu[i]
        if 0 < q_len <= max_tokens:
            count += 1
            keys += seq_len if sliding_window is None else min(seq_len, sliding_window + q_len)
    return count, keys


def _mixed_splits(short_runs: tuple[int, int] | None, num_kv_heads: int, device: torch.device) -> int:
    """Split count of a mixed step's short-run launch: 0 (no launch) without short runs, 1 when
    unknown. A decode beside prefill chunks often has a long context (workload 7: 4-8k tokens)
    that one program walks alone, ~0.4 ms a layer on an H200 for 6k keys whatever the batch; parts of
    ``MIXED_SPLIT_KEYS`` or more, as many as fill the SMs ``MIXED_SPLIT_WAVES`` times."""
    if short_runs is None:
        return 1
    count, keys = short_runs
    if count == 0:
        return 0
    by_keys = keys // (count * MIXED_SPLIT_KEYS)
    by_sms = -(-MIXED_SPLIT_WAVES * _num_sms(device) // (count * num_kv_heads))
    return max(1, min(MAX_SPLITS, by_keys, by_sms))


def _min_split_tiles(program_rows: int, block_n: int, device: torch.device) -> int:
    """Key tiles a part of a self-merging split launch holds at least: ``SPLIT_MIN_KEYS`` while the
    program rows fit the SMs once, twice that while they fill them twice (each row's program shares its
    SM with others already: a split pays only over longer contexts; 32 x 8 rows over 256 keys took 16.7
    µs in two parts of 128 against 15.6 in one, 44.1 against 47.8 over 1,024)."""
    return max(1, SPLIT_MIN_KEYS * -(-program_rows // _num_sms(device)) // block_n)


def _self_merge_args(program_rows: int, splits: int, block_n: int, out: torch.Tensor) -> tuple:
    """(whether a launch merges itself, its counters (one a program row; else any tensor), the key tiles
    a part holds at least)."""
    if splits > 1 and _self_merges(program_rows):
        return True, counters(out.device, program_rows, owner="attention"), _min_split_tiles(program_rows, block_n,
                                                                                            out.device)
    return False, out, 1


def _default_num_splits(decode_only: bool, programs: int, device: torch.device, fp8: bool = False) -> int:
    """Split each program's keys for decode batches with fewer programs than twice the SMs (once the
    SMs over an fp8 cache, whose unsplit launches take wider key tiles), into as many parts as make
    twice the SMs' programs. A graph cannot see the contexts: launches that merge themselves split
    each row by its own (``_min_split_tiles``). H200, one layer's KV write and attention in a CUDA
    graph (``kernel_bench --split-sweep``, stop 51): 32 sequences x 8 KV heads (256 programs) in two
    parts over 1,024 / 4,096 / 16,384 keys 47.8 / 165.2 / 637.8 -> 44.1 / 136.7 / 504.8 µs (the last at
    copy bandwidth); 64 x 8 (512 programs) were slower in two (272.0 -> 280.9 at 4,096)."""
    num_sms = _num_sms(device)
    if decode_only and programs < (1 if fp8 else 2) * num_sms:
        return min(MAX_SPLITS, -(-2 * num_sms // programs))
    return 1


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context incl. this step's tokens
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    num_kv_splits: int | None = None,
    logits_soft_cap: float | None = None,
    causal: bool = True,
    kv_scale: torch.Tensor | None = None,
    prefill_kernel: bool | None = None,
    short_runs: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal paged attention for a flat batch (``causal=False``: bidirectional, for encoders,
    whose whole sequence is in the step); writes ``out`` rows of every token that belongs to a
    sequence (rows past ``query_start_loc[-1]`` are left as they are). ``max_query_len`` is only
    a hint that picks the launch shape (1: decode tiles, one program per token; else short and
    long query runs in separate launches, long ones in ``triton_prefill`` where it applies); any
    value gives correct results. ``num_kv_splits`` forces the split count of the decodes (a launch that
    merges itself splits each row into at most that many parts of ``SPLIT_MIN_KEYS`` or more; None: split
    those too few to fill the GPU twice over, or per ``short_runs``: (count, total context) of the short runs beside
    long ones, host facts, ``count_short_runs``; None there is one unsplit launch, as in graph captures).
    ``logits_soft_cap``: ``cap * tanh(s / cap)`` (None: no cap). ``prefill_kernel``: False keeps long
    runs on this kernel (None: ``PAGEDLLM_PREFILL_KERNEL``)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], kv_cache.shape[3]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _check_attention_inputs(q, kv_cache, out, sliding_window, logits_soft_cap, kv_scale)
    common = _constexprs(q, kv_cache, sliding_window, logits_soft_cap, causal)
    group_pad, ieee, dim_pad = common["GROUP_PAD"], common["IEEE"], common["DIM_PAD"]
    # K and V halves as two pointers: their distance (num_blocks x block bytes, past 2**31 elements for large
    # caches) would be an argument Triton types i32 or i64 by its value, one compiled variant per cache size.
    args = [q, out, *kv_cache.unbind(), block_tables, seq_lens, query_start_loc, q if kv_scale is None else kv_scale]
    scalars = _scalar_args(q, out, kv_cache, block_tables, scale, num_seqs, sliding_window, logits_soft_cap)

    decode_only = max_query_len == 1
    # Without split-KV, fp8 keys and wide decode launches take larger key tiles.
    short_cfg, unsplit_cfg = (_tile_config(False, decode_only, group_pad, head_dim, ieee, fp8, wide)
                              for fp8, wide in ((False, False), (common["KV_FP8"], num_tokens >= WIDE_DECODE_ROWS)))
    threshold = short_cfg["BLOCK_Q"]  # a run that fits one short tile is short
    # Shape-only facts: no sequence can have more query tokens than the batch has.
    has_long = num_tokens > threshold and (max_query_len is None or max_query_len > threshold)

    def launch(cfg, q_len_filter, splits, parts):  # split: merged by its last programs or _merge_splits
        bq = cfg["BLOCK_Q"]
        grid_q = num_seqs if q_len_filter == 3 else num_tokens if bq == 1 else num_tokens // bq + num_seqs
        grid = (grid_q * num_kv_heads,) if splits == 1 else (grid_q * num_kv_heads, splits)
        self_merge, cnt, min_tiles = _self_merge_args(grid[0], splits, cfg["BLOCK_N"], out)
        _attention_kernel[grid](*args, *parts, cnt, min_tiles, *scalars, **common, **cfg, SPLIT=splits > 1,
                                Q_LEN_FILTER=q_len_filter, Q_LEN_THRESHOLD=threshold, SELF_MERGE=self_merge)
        if splits > 1 and not self_merge:
            _merge_splits(out, parts, query_start_loc, num_seqs, dim_pad, by_seq=bq if q_len_filter == 3 else 0)

    if has_long:  # short runs in short tiles; long ones in the prefill kernel where it applies
        splits = num_kv_splits if num_kv_splits is not None else _mixed_splits(short_runs, num_kv_heads, q.device)
        side = _short_runs_beside(launch, splits, short_cfg, unsplit_cfg, out, query_start_loc, num_seqs, dim_pad)
        if _takes_prefill_kernel(causal, sliding_window, logits_soft_cap, prefill_kernel):
            prefill_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, scalars[0], out, kv_scale,
                              threshold, common["KV_FP8"])
        else:
            launch(_tile_config(True, False, group_pad, head_dim, ieee), 2, 1, (out, out, out))
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
        return out

    splits = num_kv_splits if num_kv_splits is not None else \
        _default_num_splits(decode_only, num_tokens * num_kv_heads, q.device, common["KV_FP8"])
    if splits <= 1:
        # Every query run here fits a short tile, so the short-run filter skips nothing; a
        # mixed batch without long runs reuses the variant compiled for mixed batches with them.
        launch(unsplit_cfg, 0 if decode_only else 1, 1, (out, out, out))
        return out
    launch(short_cfg, 0, splits, _split_buffers(num_tokens, num_heads, splits, dim_pad, q.device))
    return out


def _constexprs(q: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None, logits_soft_cap: float | None,
                causal: bool) -> dict:
    """The attention kernel's constexpr arguments that every launch of a call shares."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    return dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        USE_WINDOW=sliding_window is not None, IEEE=q.dtype == torch.float32, SOFTCAP=logits_soft_cap is not None,
        CAUSAL=causal, KV_FP8=is_fp8(kv_cache.dtype), F16_DOTS=_f16_dots(q, kv_cache),
        **enter_args(q.device, q.shape[0]))


def _short_runs_beside(launch, splits: int, short_cfg: dict, unsplit_cfg: dict, out: torch.Tensor,
                       query_start_loc: torch.Tensor, num_seqs: int, dim_pad: int) -> torch.cuda.Stream | None:
    """A mixed step's short runs: none (``splits`` 0), one unsplit launch, or split over their keys with
    partials by sequence (``num_seqs * BLOCK_Q`` rows) and merged; on a side stream (``_fork``), returned
    for the caller to join, else on the current one (None)."""
    side = _fork(out.device) if splits else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if splits == 1:
            launch(unsplit_cfg, 1, 1, (out, out, out))
        elif splits > 1:
            launch(short_cfg, 3, splits, _split_buffers(num_seqs * short_cfg["BLOCK_Q"], out.shape[1], splits, dim_pad,
                                                        out.device))
    return side


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _fork(device: torch.device) -> torch.cuda.Stream | None:
    """A second CUDA stream for a mixed step's decodes, beside its prefill chunks, that starts once
    the current stream's work so far (the KV write) is done; None on the CPU (the interpreter) or with
    ``PAGEDLLM_ATTENTION_SIDE_STREAM=0``. The decodes' programs are few (one a decode and KV head) and
    bound by K/V bytes, the chunks' many and bound by their dots: beside each other the GPU fills the
    SMs the decodes leave idle with chunk tiles. The caller joins the current stream back to it
    (``wait_stream``) before anything reads ``out``; the tensors the side stream reads (q, the cache,
    the step's metadata) outlive that join, so the allocator cannot give their memory to other work
    while it runs. Under a CUDA graph capture the fork and join become graph dependencies."""
    if device.type != "cuda" or not envs.PAGEDLLM_ATTENTION_SIDE_STREAM:
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _f16_dots(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether bfloat16 queries over an fp8 cache meet K/V in float16 (``PAGEDLLM_FP8_KV_F16_DOTS``)."""
    return is_fp8(kv_cache.dtype) and q.dtype == torch.bfloat16 and envs.PAGEDLLM_FP8_KV_F16_DOTS


def _takes_prefill_kernel(causal: bool, sliding_window: int | None, logits_soft_cap: float | None,
                          forced: bool | None) -> bool:
    """Whether long query runs go to ``triton_prefill`` (causal, no window, no cap; ``forced`` or
    ``PAGEDLLM_PREFILL_KERNEL`` says whether it is on)."""
    on = envs.PAGEDLLM_PREFILL_KERNEL if forced is None else forced
    return on and causal and sliding_window is None and logits_soft_cap is None


def _scalar_args(q, out, kv_cache, block_tables, scale: float, num_seqs: int, sliding_window: int | None,
                 logits_soft_cap: float | None) -> list:
    """The attention kernel's scalar arguments. The score multipliers are in log2 units for exp2:
    without a cap ``scale * log2(e)`` (the second unused); with one ``scale / cap`` before the
    tanh and ``cap * log2(e)`` after it."""
    if logits_soft_cap is None:
        scale_log2, softcap_log2 = scale * LOG2_E, 0.0
    else:
        scale_log2, softcap_log2 = scale / logits_soft_cap, logits_soft_cap * LOG2_E
    return [scale_log2, num_seqs, sliding_window or 0, q.shape[1], softcap_log2,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0)]


def _split_buffers(num_rows: int, num_heads: int, splits: int, dim_pad: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each split's partial output, running max and sum (float32) for ``num_rows`` partial rows."""
    if splits > MAX_SPLITS:
        raise ValueError(f"num_kv_splits={splits} must be at most {MAX_SPLITS}")
    part_out = torch.empty(num_rows, num_heads, splits, dim_pad, dtype=torch.float32, device=device)
    part_m = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=device)
    return part_out, part_m, torch.empty_like(part_m)


def _merge_splits(out: torch.Tensor, parts: tuple, query_start_loc: torch.Tensor, num_seqs: int,
                  dim_pad: int, by_seq: int = 0) -> None:
    part_out, part_m, part_l = parts
    rows, num_heads, splits = part_m.shape
    head_dim = out.shape[-1]
    _merge_splits_kernel[(rows, num_heads)](
        out, part_out, part_m, part_l, query_start_loc, num_seqs, num_heads, splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, MAX_SPLITS=MAX_SPLITS, num_warps=4 if head_dim >= 128 else 2,
        BY_SEQ=by_seq, **enter_args(out.device, out.shape[0]),
    )
