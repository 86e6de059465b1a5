"""Triton helpers shared by the paged-attention kernels (``triton_kernels``, ``triton_prefill``):
which sequence a program serves, which cache blocks a tile of keys lives in, and the two dots of
a key tile (scores from K, the output from V), each widening an fp8 tile to q's dtype."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_block_ids(bt_row, tile, tile_hi, kv_stop, n, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Physical block of each key of tile ``tile`` (one id when the tile lies in one block)."""
    if BLOCK_SIZE % BLOCK_N == 0:
        ids = tl.load(bt_row + (tile * BLOCK_N) // BLOCK_SIZE, mask=tile < tile_hi, other=0)
    else:
        k_pos = tile * BLOCK_N + n
        ids = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_pos < kv_stop, other=0)
    return ids


@triton.jit
def find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first program is at or before ``pid``."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs - 1
    if BLOCK_Q == 1:  # decode batches: token t is sequence t, two loads instead of a search
        guess = tl.minimum(pid, num_seqs - 1)
        hit = (tl.load(qsl_ptr + guess) <= pid) & (pid < tl.load(qsl_ptr + guess + 1))
        lo = tl.where(hit, guess, lo)
        hi = tl.where(hit, guess, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def key_scores(q, k_ptrs, kv_mask, KV_FP8: tl.constexpr, IEEE: tl.constexpr):
    """``q @ K^T`` for one key tile (masked keys read as 0)."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    if IEEE:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    return sc


@triton.jit
def add_values(acc, alpha, p, v_ptrs, kv_mask, dtype: tl.constexpr, KV_FP8: tl.constexpr, IEEE: tl.constexpr):
    """The running output rescaled by ``alpha`` plus ``p @ V`` for one key tile."""
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        v = v.to(dtype)
    return accumulate(acc, alpha, p, v, IEEE)


@triton.jit
def add_fp8_values_as_words(acc, alpha, p, v_rows, rows_ok, dtype: tl.constexpr, IEEE: tl.constexpr,
                            HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """``add_values`` for an fp8 cache read through ``fp8_rows_widened`` (``v_rows``: each key's V row,
    [BLOCK_N, 1]; ``rows_ok`` which to read, [BLOCK_N, 1]); the output's columns come in
    ``words_dims`` order. For ``mma.sync`` dots: the prefill kernel's ``wgmma`` widens an fp8 tile
    in shared memory itself and was 6% slower this way."""
    return accumulate(acc, alpha, p, fp8_rows_widened(v_rows, rows_ok, dtype, HEAD_DIM, DIM_PAD), IEEE)


@triton.jit
def accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc


@triton.jit
def fp8_rows_widened(rows, rows_ok, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """An fp8 tile ([BLOCK_N, DIM_PAD], row starts 4-byte aligned) widened to ``dtype`` before it
    meets a dot, its columns in ``words_dims`` order. Loaded as fp8 and widened after, Triton keeps
    the tile in shared memory in fp8 and feeds a P @ V dot from it one byte per instruction (the dot
    wants pairs of consecutive keys, a row apart in the cache; sm_90 has no transposing ``ldmatrix``
    for 8-bit data). Read as 32-bit words and split into bytes in registers, the 16-bit tile goes
    through ``ldmatrix.trans``; the columns are permuted so that each thread's 16 loaded bytes land
    as two 16-byte runs of the 16-bit tile, whose stores to shared memory then hit distinct banks
    (in natural order they are one 32-byte run: 2-way conflicts)."""
    fp8: tl.constexpr = rows.dtype.element_ty
    w = tl.arange(0, DIM_PAD // 4)[None, :]
    mask = rows_ok
    if DIM_PAD != HEAD_DIM:
        mask = mask & (w < HEAD_DIM // 4)
    x = tl.load(rows.to(tl.pointer_type(tl.int32), bitcast=True) + w, mask=mask, other=0)
    b0 = x.to(tl.uint8).to(fp8, bitcast=True).to(dtype)
    b1 = (x >> 8).to(tl.uint8).to(fp8, bitcast=True).to(dtype)
    b2 = (x >> 16).to(tl.uint8).to(fp8, bitcast=True).to(dtype)
    b3 = (x >> 24).to(tl.uint8).to(fp8, bitcast=True).to(dtype)
    # [keys, j, i, k] = byte 2i + k of word j (little-endian), dim 4j + 2i + k; to [keys, i, j, k]
    tile = tl.permute(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (0, 2, 1, 3))
    return tl.reshape(tile, [x.shape[0], DIM_PAD])


@triton.jit
def words_dims(c, DIM_PAD: tl.constexpr):
    """The head dim held by column ``c`` of a ``fp8_rows_widened`` tile: c = i * DIM_PAD / 2 + 2j + k
    holds dim 4j + 2i + k."""
    half: tl.constexpr = DIM_PAD // 2
    return 4 * ((c % half) // 2) + 2 * (c // half) + c % 2
