"""Long-query paged attention (prefill chunks) on Hopper: a warp-specialized kernel written in Gluon.

``triton_prefill`` launches this kernel where it applies (``supports``: an sm_90 GPU, 16-bit caches of q's
dtype, head_dim 64 or 128, a Triton with Gluon) and its own elsewhere; the two take the same runs, map
programs the same way (``BLOCK_M`` query tokens of one sequence times one head, heads fastest, q-tiles from the
last down) and agree to bf16 rounding (``tests/attention/test_triton_prefill.py`` pins both to float64).

Why (``attention/KERNEL_NOTES.md``, stops 58-59): Nsight Compute has the Triton kernel's warps stalled at each
tile's barrier and its tensor pipe busy half the time: its two warpgroups share one ``cp.async`` pipeline, so
they run their dots and their softmax in lockstep, and Triton's own warp specialization leaves that loop
unpartitioned on sm_90. Gluon (``triton.experimental.gluon``, in the Triton wheel) states the partitions:

- a producer partition (``PWARPS`` warps) brings each key tile's K and V rows from the paged cache into stage
  ``t % STAGES`` of a ring in shared memory, after waiting on the stage's ``empty`` barrier; whole tiles by TMA
  (one bulk copy a cache block of this KV head, from one thread, through descriptors the program builds on the
  device), the diagonal tiles by masked, zero-filling ``cp.async`` (a key past the run's end is never read:
  other sequences' slots or NaN); the copies complete the stage's ``full`` barrier;
- two consumer partitions of one warpgroup each, 64 query rows each of the program's 128: wait on ``full``,
  S = Q K^T (``wgmma``, Q from registers), the online softmax (masked on the diagonal tiles), O += P V (P from
  registers), one arrival on ``empty``. Each warpgroup waits only on the data, so one's softmax runs under the
  other's dots; within a warpgroup, each tile's P V runs under the next tile's softmax (FlashAttention-3's
  intra-warpgroup pipelining: S_t and P_{t-1} V_{t-1} issued together, S_t awaited alone).

Measured on an H200 (stop 59, ``python -m pagedllm.attention.prefill_bench``): an 8k-token prompt 546 against
450 TFLOP/s for the Triton kernel (cuDNN SDPA on contiguous tensors 602), a 2k chunk after a 6k prefix 566 against
455; the in-warpgroup overlap is +3-7% from 4k tokens up, level below; FA3-style ping-pong between the two
warpgroups (turn barriers around the score dots) was 3-9% slower and is not kept (``attention/KERNEL_NOTES.md``).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as hopper_mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from pagedllm import envs

# Gluon is experimental and renames things between Triton releases: the bulk copy is async_load from 3.7 on.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# 64-key tiles in 4 stages: the fastest of the tilings tried on an H200 (stop 59, `python -m
# pagedllm.attention.prefill_bench --sweep`, 8k-token prompt, TFLOP/s): 546 against 509 in 3 stages, 355 in 2, 522
# with one producer warp; 128-key tiles (2 stages, without the overlap, whose two score tiles spill there) 495.
# Head_dim 256 would not fit the stages in shared memory (triton_prefill keeps it).
CONFIG = dict(BLOCK_M=128, BLOCK_N=64, STAGES=4, PWARPS=2, PREGS=96, CREGS=232, num_warps=4)


@gluon.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: gl.constexpr):
    """The last sequence whose first program is at or before ``pid`` (``triton_paging.find_seq`` in Gluon)."""
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if gl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@gluon.jit
def _gather_masked(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, t, kv_stop, n, d, slot,
                   stride_block, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """Diagonal key tile ``t``'s K and V rows into its stage once the consumers freed it; zeros past ``kv_stop``."""
    s = t % STAGES
    mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
    k_pos = t * BLOCK_N + n
    ok = k_pos < kv_stop
    phys = gl.load(bt_row + k_pos // BLOCK_SIZE, mask=ok, other=0)
    offs = (phys.to(gl.int64) * stride_block + slot)[:, None] + d[None, :]
    mask = ok[:, None] & (d[None, :] >= 0)
    cp_async(k_smem.index(s), k_cache_ptr + offs, mask=mask)
    cp_async(v_smem.index(s), v_cache_ptr + offs, mask=mask)
    async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _producer(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, kv_stop, full_tiles, n_tiles,
              stride_block, stride_slot, head_off, cache_rows, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, PWARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [PWARPS, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    slot = ((n % BLOCK_SIZE) * stride_slot + head_off).to(gl.int64)
    # whole tiles: one bulk copy a cache block ([BLOCK_SIZE, HEAD_DIM] of this KV head), from one thread
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_desc = tma.make_tensor_descriptor(k_cache_ptr + head_off, [cache_rows, HEAD_DIM], [stride_slot, 1],
                                        [BLOCK_SIZE, HEAD_DIM], smem)
    v_desc = tma.make_tensor_descriptor(v_cache_ptr + head_off, [cache_rows, HEAD_DIM], [stride_slot, 1],
                                        [BLOCK_SIZE, HEAD_DIM], smem)
    for t in range(0, full_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        hopper_mbarrier.expect(full.index(s), 2 * BLOCK_N * HEAD_DIM * k_smem.dtype.primitive_bitwidth // 8)
        for j in gl.static_range(BLOCK_N // BLOCK_SIZE):
            row = gl.load(bt_row + t * (BLOCK_N // BLOCK_SIZE) + j) * BLOCK_SIZE
            tma_load(k_desc, [row, 0], full.index(s), k_smem.index(s).slice(j * BLOCK_SIZE, BLOCK_SIZE))
            tma_load(v_desc, [row, 0], full.index(s), v_smem.index(s).slice(j * BLOCK_SIZE, BLOCK_SIZE))
        hopper_mbarrier.arrive(full.index(s), count=32 * PWARPS - 1)  # the count the cp.async tiles' threads make
    for t in range(full_tiles, n_tiles):
        _gather_masked(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, t, kv_stop, n, d, slot,
                       stride_block, BLOCK_N, BLOCK_SIZE, STAGES)


@gluon.jit
def _softmax(sc, m_i, l_i, t, q_pos, kv_stop, scale_log2, mma: gl.constexpr, BLOCK_N: gl.constexpr,
             MASKED: gl.constexpr):
    """Key tile ``t``'s probabilities (unnormalized, against the new running max), the running sum and max, and
    the factor that rescales what came before."""
    if MASKED:
        k_pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        sc = gl.where((k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_stop), sc * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))  # key 0 is every row's: finite from the first tile on
        p = gl.exp2(sc - m_new[:, None])
    else:  # scale_log2 > 0: the row max of the raw scores, scaled; then one FMA a score
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * scale_log2)
        p = gl.exp2(sc * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, l_i * alpha + gl.sum(p, axis=1), m_new, alpha


@gluon.jit
def _scores(q, k_smem, s, mma: gl.constexpr, BLOCK_N: gl.constexpr):
    """Issues S = Q K^T over stage ``s`` (an async wgmma group; the caller waits for it)."""
    return warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([q.shape[0], BLOCK_N], gl.float32, layout=mma),
                         use_acc=False, is_async=True)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, mma_o: gl.constexpr):
    """P in the cache's dtype, laid out as the P V dot's register operand."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))


@gluon.jit
def _step(q, k_smem, v_smem, full, empty, t, acc, p_prev, l_i, m_i, q_pos, kv_stop, scale_log2, mma: gl.constexpr,
          mma_o: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr):
    """Key tile ``t`` with the tile before's O += P V under its softmax (FlashAttention-3's
    intra-warpgroup pipelining): issue S_t, then P_{t-1} V_{t-1}; wait for S_t alone, softmax; wait for the other,
    release tile t-1's stage, rescale O. ``acc`` holds the tiles before t-1, ``p_prev`` tile t-1's P."""
    s = t % STAGES
    sp = (t - 1) % STAGES
    mbarrier.wait(full.index(s), (t // STAGES) & 1)
    sc = _scores(q, k_smem, s, mma, BLOCK_N)
    acc = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
    sc, _ = warpgroup_mma_wait(1, deps=[sc, k_smem.index(s)])  # wgmma groups complete in order
    p, l_i, m_new, alpha = _softmax(sc, m_i, l_i, t, q_pos, kv_stop, scale_log2, mma, BLOCK_N, MASKED)
    acc, _, _ = warpgroup_mma_wait(0, deps=[acc, p_prev, v_smem.index(sp)])
    mbarrier.arrive(empty.index(sp))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
    return acc, _p_operand(p, k_smem.dtype, mma_o), l_i, m_new


@gluon.jit
def _overlapped(q, k_smem, v_smem, full, empty, acc, l_i, m_i, q_pos, kv_stop, n_tiles, full_tiles, scale_log2,
                mma: gl.constexpr, mma_o: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The key tiles with each tile's P V under the next one's softmax (``_step``): tile 0 alone (masked: harmless
    on a whole tile), the whole tiles, the diagonal ones, the last P V."""
    mbarrier.wait(full.index(0), 0)
    sc, _ = warpgroup_mma_wait(0, deps=[_scores(q, k_smem, 0, mma, BLOCK_N), k_smem.index(0)])
    p, l_i, m_i, alpha = _softmax(sc, m_i, l_i, 0, q_pos, kv_stop, scale_log2, mma, BLOCK_N, True)
    p = _p_operand(p, k_smem.dtype, mma_o)
    for t in range(1, full_tiles):
        acc, p, l_i, m_i = _step(q, k_smem, v_smem, full, empty, t, acc, p, l_i, m_i, q_pos, kv_stop, scale_log2,
                                 mma, mma_o, BLOCK_N, STAGES, False)
    for t in range(gl.maximum(full_tiles, 1), n_tiles):
        acc, p, l_i, m_i = _step(q, k_smem, v_smem, full, empty, t, acc, p, l_i, m_i, q_pos, kv_stop, scale_log2,
                                 mma, mma_o, BLOCK_N, STAGES, True)
    s = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(p, v_smem.index(s), acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=[acc, p, v_smem.index(s)])
    mbarrier.arrive(empty.index(s))
    return acc, l_i


@gluon.jit
def _consumer(q_ptr, out_ptr, k_smem, v_smem, full, empty, row0, tok0, q_rows, pos0, kv_stop, n_tiles, full_tiles,
              scale_log2, stride_qt, stride_ot, q_off, o_off, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Query rows ``row0 .. row0 + BLOCK_R`` of the program's tile (one warpgroup)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    io_mask = ((row0 + r) < q_rows)[:, None] & (d[None, :] < HEAD_DIM)
    tok = (tok0 + row0 + r).to(gl.int64)
    q = gl.load(q_ptr + tok[:, None] * stride_qt + q_off + d[None, :], mask=io_mask, other=0.0)
    q = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    q_pos = pos0 + row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, mma))
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.full([BLOCK_R], 0.0, gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([BLOCK_R, HEAD_DIM], gl.float32, layout=mma_o)
    acc, l_i = _overlapped(q, k_smem, v_smem, full, empty, acc, l_i, m_i, q_pos, kv_stop, n_tiles, full_tiles,
                           scale_log2, mma, mma_o, BLOCK_N, STAGES)
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))[:, None]  # every row saw key 0: l >= 1
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), ld)
    gl.store(out_ptr + tok[:, None] * stride_ot + o_off + d[None, :], out, mask=io_mask)


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def prefill_ws_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale_log2,
                      num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_c_block, stride_c_slot,
                      stride_c_head, stride_bt, cache_rows, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
                      Q_LEN_THRESHOLD: gl.constexpr, STAGES: gl.constexpr, PWARPS: gl.constexpr,
                      PREGS: gl.constexpr, CREGS: gl.constexpr):
    """Causal attention of ``BLOCK_M`` query rows of one head (two consumer warpgroups) over a paged cache."""
    pid = gl.num_programs(0) // NUM_HEADS - 1 - gl.program_id(0) // NUM_HEADS
    head = gl.program_id(0) % NUM_HEADS
    s = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_M)
    q_begin = gl.load(qsl_ptr + s)
    q_len = gl.load(qsl_ptr + s + 1) - q_begin
    q_start = (pid - (q_begin // BLOCK_M + s)) * BLOCK_M
    if q_start >= q_len:
        return
    if q_len <= Q_LEN_THRESHOLD:  # a short run: the unified kernel's
        return
    context_len = gl.load(seq_lens_ptr + s) - q_len
    first_pos = context_len + q_start
    kv_stop = context_len + gl.minimum(q_start + BLOCK_M, q_len)
    n_tiles = (kv_stop + BLOCK_N - 1) // BLOCK_N
    full_tiles = (first_pos + 1) // BLOCK_N  # tiles every row of the program sees whole
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(k_cache_ptr.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_smem = gl.allocate_shared_memory(v_cache_ptr.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], smem)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=32 * PWARPS)  # every producer thread's copies
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups
    rows: gl.constexpr = BLOCK_M // 2
    tok0 = q_begin + q_start
    q_rows = q_len - q_start
    q_off = head * stride_qh
    o_off = head * stride_oh
    gl.warp_specialize([
        (_consumer, (q_ptr, out_ptr, k_smem, v_smem, full, empty, 0, tok0, q_rows, first_pos, kv_stop, n_tiles,
                     full_tiles, scale_log2, stride_qt, stride_ot, q_off, o_off, rows, BLOCK_N, HEAD_DIM, STAGES)),
        (_consumer, (q_ptr, out_ptr, k_smem, v_smem, full, empty, rows, tok0, q_rows, first_pos, kv_stop, n_tiles,
                     full_tiles, scale_log2, stride_qt, stride_ot, q_off, o_off, rows, BLOCK_N, HEAD_DIM, STAGES)),
        (_producer, (k_cache_ptr, v_cache_ptr, block_tables_ptr + s.to(gl.int64) * stride_bt, k_smem, v_smem, full,
                     empty, kv_stop, full_tiles, n_tiles, stride_c_block, stride_c_slot,
                     (head // GROUP) * stride_c_head, cache_rows, BLOCK_N, HEAD_DIM, BLOCK_SIZE, STAGES, PWARPS)),
    ], [4, PWARPS], [CREGS, PREGS])


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def supports(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this kernel takes ``triton_prefill``'s runs: ``PAGEDLLM_GLUON_PREFILL`` on, an sm_90 GPU (wgmma and
    TMA as Hopper has them), a bf16/fp16 cache of q's dtype (no fp8 scales here), head_dim 64 or 128 (four stages
    of 64-key K and V tiles in shared memory), cache blocks of 8 slots up to a key tile's (TMA copies whole
    blocks), and rows laid out as the engine's cache and activations are (head_dim contiguous, then heads)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    return (envs.PAGEDLLM_GLUON_PREFILL and q.is_cuda and _sm90(q.device.index or 0)
            and q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype == out.dtype
            and head_dim in (64, 128) and 8 <= block_size <= CONFIG["BLOCK_N"] and block_size & (block_size - 1) == 0
            and kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim
            and kv_cache.stride(2) == num_kv_heads * head_dim and q.stride(2) == 1 and out.stride(2) == 1)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the programs build (Triton asks at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Sets ``_scratch`` as Triton's allocator where the launching thread has none (it is a context variable,
    so each thread's own); one the user set stays."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def prefill_attention_ws(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale_log2: float, out: torch.Tensor,
                         q_len_threshold: int) -> None:
    """``triton_prefill.prefill_attention``'s launch with this kernel (``supports`` checked by the caller). The grid
    depends only on shapes (CUDA-graph safe; the descriptor scratch is allocated in stream order)."""
    num_tokens, num_heads, head_dim = q.shape
    _ensure_allocator()
    cfg = CONFIG  # read at each launch (prefill_bench --sweep changes it)
    grid = ((num_tokens // cfg["BLOCK_M"] + seq_lens.shape[0]) * num_heads,)
    prefill_ws_kernel[grid](
        q, out, *kv_cache.unbind(), block_tables, seq_lens, query_start_loc, scale_log2, seq_lens.shape[0],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0), kv_cache.shape[1] * kv_cache.shape[2], NUM_HEADS=num_heads,
        GROUP=num_heads // kv_cache.shape[3], BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim,
        Q_LEN_THRESHOLD=q_len_threshold, **cfg)
