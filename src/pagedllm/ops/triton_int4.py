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

import functools

import torch
import triton
import triton.language as tl

from pagedllm.ops.tile_tables import ROW_BUCKETS, TileTable
from pagedllm.ops.triton_pdl import enter_args, pdl_enter
from pagedllm.ops.triton_int4_swap import nibble_activations, swap_eligible, w4a16_swap_splitk
from pagedllm.ops.triton_splitk import finish_split, splitk_setup, tile_counter

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
def _nibble_f32(words, i: tl.constexpr):
    """Nibble ``i`` of each word as float32 without an int -> float conversion: the value's bits OR'd
    into the mantissa of 2**23 (0x4B000000), then 2**23 subtracted (exact)."""
    return (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # words: uint32


@triton.jit
def _dot_nibble_pair(xh, words, i: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, part):
    """``part`` plus the dots of nibbles i and i + 4 of each word with their activations (``xh``
    [BLOCK_M, BKW, 2]: x at k = 8 j + i and 8 j + i + 4). Both nibbles land in one register, each
    in a 16-bit half OR'd into the bits of BASE (128 in bf16, 1024 in fp16: one unit per mantissa
    step), by one shift and one and-or: BASE + q, exact; less OFF (one 16-bit pair subtraction,
    exact) unless OFF is 0."""
    xa, xb = tl.split(xh)
    pair = ((words >> (4 * i)) & 0x000F000F) | MAGIC
    lo = pair.to(tl.int16).to(xa.dtype, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(xa.dtype, bitcast=True)
    if OFF != 0:
        lo = lo - OFF
        hi = hi - OFF
    return tl.dot(xb, hi, tl.dot(xa, lo, part))


@triton.jit(do_not_specialize=["M", "K_TILES_PER_SPLIT", "SPLIT_K"])
def _w4a16_splitk_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                         K_TILES_PER_SPLIT, SPLIT_K, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                         ENTER: tl.constexpr):
    """Decode batches (the FMA variant: M <= BLOCK_M; the dot variant: row tiles, up to 512 rows):
    program (pid_n, pid_k, pid_m) owns ``BLOCK_N`` output features of ``BLOCK_M`` rows and the
    ``pid_k``-th slice of K (``K_TILES_PER_SPLIT`` tiles of ``BLOCK_K``, each inside one group), and
    reads each packed word of that slice once: one [BLOCK_K / 8, BLOCK_N] int32 load per tile, its
    eight nibbles unpacked by shifts in registers. Per tile the raw sum ``sum_k x q`` (q 0..15
    exact in any float type) is accumulated in fp32, by a tensor-core dot per nibble (USE_DOT: the
    rows padded to 16/32/64; ``sum_k x`` by a dot too) or by FMAs (a few rows), and the group's scale
    and zero point are applied once per tile and feature: ``acc += s * (sum_k x q - z * sum_k x)``
    (Q4_1: ``s * sum x q + m * sum x``).

    USE_SPLIT (SPLIT_K > 1; the count itself is a run-time argument, so one compiled variant serves
    every split): each program writes its fp32 partial to ``ws`` [SPLIT_K, M, N]; the last of a
    column tile's programs to finish (a counter per output tile, ``cnt``, which it resets to 0 for
    the next launch) sums the SPLIT_K partials in split order, adds the bias and writes y. One
    launch, and the result does not depend on which program finished last (deterministic).
    ENTER: launched while the kernel before it runs (``triton_pdl``), it waits for it first."""
    pdl_enter(ENTER)
    BKW: tl.constexpr = BLOCK_K // 8
    MAGIC: tl.constexpr = 0x43004300 if x_ptr.dtype.element_ty == tl.bfloat16 else 0x64006400  # 128 | 1024
    BASE: tl.constexpr = 128.0 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024.0
    ONE: tl.constexpr = 0x3F80 if x_ptr.dtype.element_ty == tl.bfloat16 else 0x3C00  # 1.0's bits
    # Symmetric weights (zero point 8 everywhere) take BASE + 8 off the operands themselves (exact),
    # which spares the sum_k x dot and its accumulator; zero points and mins come off after the dot.
    SYMMETRIC: tl.constexpr = not HAS_ZP and not HAS_MIN
    OFF: tl.constexpr = BASE + 8.0 if SYMMETRIC else 0.0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)  # the dot variant's row tiles (the FMA variant has one)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    j = tl.arange(0, BKW)
    kt_lo = pid_k * K_TILES_PER_SPLIT
    kt_hi = tl.minimum(kt_lo + K_TILES_PER_SPLIT, K // BLOCK_K)
    q_ptrs = qw_ptr + (kt_lo * BKW + j).to(tl.int64)[:, None] * N + n[None, :]
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + (kt_lo * BLOCK_K + 8 * j)[None, :]  # nibble 0's k
    xk_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + (kt_lo * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    if HAS_ZP:
        z_shift = (n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not USE_DOT:  # no dot for Triton's pipeliner to stage loads for: the next tile's words load by hand
        words_next = tl.load(q_ptrs, mask=n_ok[None, :] & (kt_lo * BKW + j < kt_hi * BKW)[:, None], other=0)
    if USE_DOT:  # the scales load a tile ahead (the pipeliner stages the words and x, not them)
        s_next = tl.load(s_ptr + (kt_lo * BLOCK_K // GROUP) * N + n, mask=n_ok, other=0.0)
    for kt in range(kt_lo, kt_hi):
        if USE_DOT:
            words = tl.load(q_ptrs, mask=n_ok[None, :], other=0)
        else:
            words = words_next.to(tl.uint32, bitcast=True)  # logical shifts: no sign extension per nibble
            words_next = tl.load(q_ptrs + BKW * N, mask=n_ok[None, :] & ((kt + 1) * BKW + j < kt_hi * BKW)[:, None],
                                 other=0)
        g = (kt * BLOCK_K) // GROUP
        if USE_DOT:
            s = s_next.to(tl.float32)
            s_next = tl.load(s_ptr + (tl.minimum(kt + 1, kt_hi - 1) * BLOCK_K // GROUP) * N + n, mask=n_ok, other=0.0)
        else:
            s = tl.load(s_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
        if USE_DOT:
            # x is loaded as it lies (a contiguous tile, staged by cp.async like the words) and
            # split in registers into the eight nibbles' operands; sum_k x, for BASE and the zero
            # point below, comes from one more dot, with a tile of ones (1.0's bits: the
            # interpreter keeps 16-bit floats as raw bits).
            xk = tl.load(xk_ptrs, mask=m_ok[:, None], other=0.0)
            x0, x1, x2, x3 = nibble_activations(xk, BKW)
            part = _dot_nibble_pair(x0, words, 0, MAGIC, OFF, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
            part = _dot_nibble_pair(x1, words, 1, MAGIC, OFF, part)
            part = _dot_nibble_pair(x2, words, 2, MAGIC, OFF, part)
            part = _dot_nibble_pair(x3, words, 3, MAGIC, OFF, part)
            if not SYMMETRIC:  # (symmetric: the operands were q - 8)
                xsum = tl.dot(xk, tl.full((BLOCK_K, BLOCK_N), ONE, tl.int16).to(x_ptr.dtype.element_ty, bitcast=True))
        elif BLOCK_M == 1:  # a GEMV: [BKW, BLOCK_N] products, summed over the words once per tile
            xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            part2 = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptr + kt * BLOCK_K + 8 * j + i).to(tl.float32)
                part2 += xi[:, None] * _nibble_f32(words, i)
                xsum += tl.sum(xi, axis=0)
            part = tl.sum(part2, axis=0)[None, :]
            xsum = xsum[:, None]
        else:
            xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            part3 = tl.zeros((BLOCK_M, BKW, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(x_ptrs + i, mask=m_ok[:, None], other=0.0).to(tl.float32)
                part3 += xi[:, :, None] * _nibble_f32(words, i)[None, :, :]
                xsum += tl.sum(xi, axis=1)
            part = tl.sum(part3, axis=1)
            xsum = xsum[:, None]
        if HAS_MIN:
            mn = tl.load(z_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
            if USE_DOT:  # the dot's operands were BASE + q
                mn -= BASE * s
            acc += s[None, :] * part + xsum * mn[None, :]
        elif USE_DOT and SYMMETRIC:  # the dot's operands were q - 8
            acc += s[None, :] * part
        else:
            if HAS_ZP:
                z = ((tl.load(z_ptr + g * (N // 8) + n // 8, mask=n_ok, other=0) >> z_shift) & 0xF).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            if USE_DOT:  # the dot's operands were BASE + q
                z += BASE
            acc += s[None, :] * (part - xsum * z[None, :])
        q_ptrs += BKW * N
        x_ptrs += BLOCK_K
        xk_ptrs += BLOCK_K
    y_ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        finish_split(acc, ws_ptr + m.to(tl.int64)[:, None] * N + n[None, :], M * N, y_ptrs,
                     b_ptr + n[None, :] + 0 * m[:, None], y_mask, cnt_ptr, tile_counter(), pid_k, SPLIT_K, HAS_BIAS)


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
    """The tiling of the tiled kernel for an [m, K] x [K, n] product: small-row or prefill."""
    if m <= SMALL_ROWS:
        block_n = next((b for b in (64, 32) if n >= b * 264), 16)
        return dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n, BLOCK_K=min(group, 128), num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128 if n >= 128 else 64, BLOCK_K=min(group, 64), num_warps=8, num_stages=3)


# ---- the split-K decode kernel's configs ---------------------------------------------------

_config_table = TileTable("w4a16_configs.json")
CONFIG_FILE = _config_table.path
reload_config_table = _config_table.reload
# The table's row buckets (a row count takes the next bucket up): the decode graphs' buckets, then
# wider batches, which the dot variant serves in row tiles where the sweep found it faster than the
# tiled kernel (untuned shapes keep the tiled kernel beyond SMALL_ROWS).
M_BUCKETS = ROW_BUCKETS + (64, 128, 256, 512)
FMA_ROWS = 4  # up to this many rows the FMA variant serves groups under 128 (the dot needs 128-wide tiles)
TARGET_PROGRAMS_PER_SM = 3


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if b >= m)


def config_key(n: int, k: int, group: int) -> str:
    return f"N={n},K={k},G={group}"


@functools.lru_cache(maxsize=8)
def _sm_count(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 132  # an H100 SXM: the CPU tests run what the GPU would


def splitk_eligible(m: int, group: int, config: dict) -> bool:
    if config.get("SWAP") and not swap_eligible(group, config):
        return False
    block_k = config["BLOCK_K"]
    if (m > config["BLOCK_M"] and not config["USE_DOT"]) or group % block_k or block_k % 8:
        return False
    return not config["USE_DOT"] or (block_k >= 128 and config["BLOCK_M"] >= 16)


def default_splitk_config(m: int, n: int, k: int, group: int, sm_count: int = 132) -> dict:
    """Untuned: the dot variant (rows padded to 16 or 32; tiles of 128 along K, so group 128) where
    the group allows, else FMAs (up to FMA_ROWS rows, BLOCK_M the next power of two). 4 warps; the
    wider of 128 and 64 columns per program whose grid still has a program per SM; K split until
    the grid has about TARGET_PROGRAMS_PER_SM programs per SM, while the fp32 partials written and
    read back (2 * 4 * SPLIT_K * M * N bytes, mostly L2 hits) stay under a quarter of the packed
    weight. The rule follows the H100 sweep of llama3-8b's projections at 1-32 rows (the table of
    fa0f27f): every best used 4 warps and 128 columns (64 for the 4096-wide o_proj past 1 row) at
    2-7 programs per SM, and this rule gives 7 of those 16 bests exactly. The sweep times the
    alternatives (FMA at 1..4 rows included)."""
    use_dot = group >= 128 or m > FMA_ROWS
    block_m = (16 if m <= 16 else 32) if use_dot else 1 << (m - 1).bit_length()
    block_k = 128 if use_dot else min(group, 128)
    k_tiles = max(1, k // block_k)
    max_split = max(1, min(k_tiles, k // (64 * m)))  # partials 8 SPLIT_K M N bytes <= packed weight / 4
    for block_n in (128, 64):  # the wider tile whose grid still gives every SM a program
        n_tiles = triton.cdiv(n, block_n)
        split = min(max_split, triton.cdiv(TARGET_PROGRAMS_PER_SM * sm_count, n_tiles))
        split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))
        if n_tiles * split >= sm_count:
            break
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, SPLIT_K=split,
                num_warps=4, num_stages=3)


# The table is tuned on symmetric weights. With zero points (or mins) the sum_k x dot adds an
# accumulator, and the sweep (`quant_kernel --tune --zero-points`, H100) found 64-row tiles slower
# there than 32-row ones: those take row tiles of at most ZERO_POINT_ROWS.
ZERO_POINT_ROWS = 32
# decode_config's answer where the table says: dequantize the weight, then cuBLAS.
DEQUANT = {"kernel": "dequant"}


def decode_config(m: int, n: int, k: int, group: int, device: str = "cuda",
                  zero_points: bool = False) -> dict | None:
    """The split-K kernel's config for ``m`` rows: the table's entry for the smallest tuned row
    bucket that holds ``m`` rows (the tuning sweep's best; ``{"kernel": "tiled"}`` where the tiled
    kernel won), else the default up to SMALL_ROWS rows. ``DEQUANT`` where the sweep found
    dequantizing the weight and cuBLAS fastest (and past the widest bucket when it did there).
    None: the tiled kernel (too many rows, or no variant fits the group size)."""
    tuned = _config_table().get(config_key(n, k, group), {})
    if m > M_BUCKETS[-1]:  # past the widest bucket: dequantize where the widest one does
        return DEQUANT if tuned.get(str(M_BUCKETS[-1]), {}).get("kernel") == "dequant" else None
    entry = next((tuned[str(b)] for b in M_BUCKETS if b >= m and str(b) in tuned), None)
    if entry is not None:
        if entry.get("kernel") == "tiled":
            return None
        if entry.get("kernel") == "dequant":
            return DEQUANT
        config = {key: value for key, value in entry.items() if key not in ("kernel", "ms")}
        if zero_points and config.get("USE_DOT") and config["BLOCK_M"] > ZERO_POINT_ROWS:
            config["BLOCK_M"] = ZERO_POINT_ROWS
        if splitk_eligible(m, group, config):
            return config
    if m > SMALL_ROWS:
        return None
    config = default_splitk_config(m, n, k, group, _sm_count(device))
    return config if splitk_eligible(m, group, config) else None


def w4a16_splitk(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, mins: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """The split-K decode kernel (checked shapes, contiguous ``x`` rows; ``w4a16_linear`` calls it)."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = dict(config) if config is not None else \
        decode_config(m, n, k, group_size, str(x.device), qzeros is not None or mins is not None)
    if cfg is None or not splitk_eligible(m, group_size, cfg):
        raise ValueError(f"w4a16_splitk: no split-K config for {m} rows, group {group_size}: {cfg}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if cfg.pop("SWAP", False) and mins is None:  # (Q4_1's mins: the kernel below)
        return w4a16_swap_splitk(x, qweight, scales, qzeros, group_size, bias, cfg, y)
    n_tiles, m_tiles = triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"])
    per_split, split, ws, cnt = splitk_setup(y, k // cfg["BLOCK_K"], cfg.pop("SPLIT_K"), n_tiles * m_tiles)
    second = mins if mins is not None else qzeros if qzeros is not None else qweight
    _w4a16_splitk_kernel[(n_tiles, split, m_tiles)](
        x, qweight, scales, second, bias if bias is not None else y, y, ws, cnt, m, n, k, x.stride(0), y.stride(0),
        per_split, split, GROUP=group_size, HAS_ZP=qzeros is not None, HAS_BIAS=bias is not None,
        HAS_MIN=mins is not None, USE_SPLIT=split > 1, **cfg, **enter_args(x.device, m))
    return y


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, mins: torch.Tensor | None = None,
                 decode: dict | bool | None = None, **tiles) -> torch.Tensor:
    """``x`` [M, K] (half precision) times the canonical int4 weight: [M, N] in x's dtype.

    Up to 32 rows (decode), the split-K kernel with the tuning table's config for the row bucket
    (``decode``: a config of its own; False: the tiled kernel), unless the table says the tiled
    kernel won there or no split-K variant fits the group size; ``tiles`` (the tiled kernel's
    config) select the tiled kernel. From ``DEQUANT_ROWS`` rows on, and where the table says so
    (``{"kernel": "dequant"}``), the weight is dequantized once and multiplied by cuBLAS: a large
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
    dequant = m >= DEQUANT_ROWS
    if not tiles and decode is not False and m > 0:
        config = decode if isinstance(decode, dict) else \
            decode_config(m, n, k, group_size, str(x.device), qzeros is not None or mins is not None)
        if config is not None and config.get("kernel") != "dequant":
            return w4a16_splitk(x, qweight, scales, qzeros, group_size, bias, mins, config)
        dequant = dequant or config is not None
    if dequant and not tiles:
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
