"""A warp-specialized paged prefill attention written in Gluon, for Hopper: issue 19's next prefill kernel, as a
probe (not wired into the engine; ``attention/triton_prefill.py`` is the engine's).

Why (``attention/KERNEL_NOTES.md``, stop 58): Nsight Compute has the Triton prefill kernel's warps stalled at each
tile's barrier and its tensor pipe busy half the time: its two warpgroups share one ``cp.async`` pipeline and
so run their dots and their softmax in lockstep. Triton's own warp specialization leaves that loop unpartitioned
on sm_90; Gluon (``triton.experimental.gluon``, in the Triton wheel) states the partitions itself:

- a producer partition (PWARPS warps) reads each key tile's block ids and brings its K and V rows from the paged
  cache into stage ``t % STAGES`` of a ring in shared memory, after waiting on the stage's ``empty`` barrier; the
  copies complete its ``full`` barrier;
- two consumer partitions of one warpgroup each (the default partition and a worker), 64 query rows each of the
  program's 128: wait on ``full``, S = Q K^T (async ``wgmma``, Q from registers), the online softmax (masked on
  the diagonal tiles), O += P V (P from registers), then one arrival each on ``empty`` (two per stage). Each
  warpgroup waits only on the data, not on the other warpgroup, so the hardware can run one's softmax under the
  other's dots; PINGPONG orders it (the two warpgroups' score dots take turns through a pair of mbarriers, each
  one's softmax under the other's dots, as FlashAttention-3 schedules them).

Programs map to (q-tile, head) exactly as the Triton kernel's (heads fastest, q-tiles from the last down), and the
launch takes the same arguments, so the two can be swapped and compared on one paged batch.

    python scripts/gluon_prefill_probe.py --compile   # no GPU needed: compile for sm_90, print the loops' SASS
    python scripts/gluon_prefill_probe.py             # a Hopper GPU: check against the Triton kernel, time both

The whole tiles' K/V come by TMA (one bulk copy a 16-key cache block, issued by one thread: the producer's loop
is ~136 instructions a tile); the diagonal tiles by masked, zero-filling ``cp.async`` (a key past the run's end
is never read). Status (stop 58): compiles for sm_90 with Triton 3.6 (the lent machines') and 3.9 (offline SASS:
468 instructions a tile in a consumer warpgroup's unmasked loop against the Triton kernel's 652, and no barrier
shared by the two warpgroups); not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as hopper_mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

# Gluon is experimental and renames things between Triton releases: the bulk copy is async_load from 3.7 on.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: gl.constexpr):
    """The last sequence whose first program is at or before ``pid`` (as ``triton_paging.find_seq``)."""
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
def _gather(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, t, kv_stop, n, d, slot, stride_block,
            BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr):
    """Key tile ``t``'s K and V rows into its stage, once the consumers freed it."""
    s = t % STAGES
    mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
    k_pos = t * BLOCK_N + n
    if MASKED:  # keys past the run's last one: never read (other sequences' slots, or NaN); zeros instead
        ok = k_pos < kv_stop
        phys = gl.load(bt_row + k_pos // BLOCK_SIZE, mask=ok, other=0)
        offs = (phys.to(gl.int64) * stride_block + slot)[:, None] + d[None, :]
        mask = ok[:, None] & (d[None, :] >= 0)
        cp_async(k_smem.index(s), k_cache_ptr + offs, mask=mask)
        cp_async(v_smem.index(s), v_cache_ptr + offs, mask=mask)
    else:
        phys = gl.load(bt_row + k_pos // BLOCK_SIZE)
        offs = (phys.to(gl.int64) * stride_block + slot)[:, None] + d[None, :]
        cp_async(k_smem.index(s), k_cache_ptr + offs)
        cp_async(v_smem.index(s), v_cache_ptr + offs)
    async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _producer(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, kv_stop, full_tiles, n_tiles,
              stride_block, stride_slot, head_off, cache_rows, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, PWARPS: gl.constexpr, TMA: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [PWARPS, 1], [1, 0])
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    slot = ((n % BLOCK_SIZE) * stride_slot + head_off).to(gl.int64)
    if TMA:  # whole tiles: one bulk copy a cache block ([BLOCK_SIZE, HEAD_DIM] of this KV head), from one thread
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
                tma_load(k_desc, [row, 0], full.index(s),
                                                k_smem.index(s).slice(j * BLOCK_SIZE, BLOCK_SIZE))
                tma_load(v_desc, [row, 0], full.index(s),
                                                v_smem.index(s).slice(j * BLOCK_SIZE, BLOCK_SIZE))
            hopper_mbarrier.arrive(full.index(s), count=32 * PWARPS - 1)  # the count the cp.async tiles' threads make
    else:
        for t in range(0, full_tiles):
            _gather(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, t, kv_stop, n, d, slot,
                    stride_block, BLOCK_N, BLOCK_SIZE, STAGES, False)
    for t in range(full_tiles, n_tiles):
        _gather(k_cache_ptr, v_cache_ptr, bt_row, k_smem, v_smem, full, empty, t, kv_stop, n, d, slot, stride_block,
                BLOCK_N, BLOCK_SIZE, STAGES, True)


@gluon.jit
def _tile(q, k_smem, v_smem, full, empty, mine, other, t, acc, l_i, m_i, q_pos, kv_stop, scale_log2,
          mma: gl.constexpr, mma_o: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
          PINGPONG: gl.constexpr):
    """One key tile of the online softmax: wait for its stage, the two dots, release the stage. PINGPONG: the
    score dots of the two warpgroups take turns (``mine`` passed, then ``other`` signalled once this one's scores
    are in), so each one's softmax runs while the other's scores are computed."""
    s = t % STAGES
    mbarrier.wait(full.index(s), (t // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(mine, t & 1)
    sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([q.shape[0], BLOCK_N], gl.float32, layout=mma),
                       use_acc=False, is_async=True)
    sc, _ = warpgroup_mma_wait(0, deps=[sc, k_smem.index(s)])
    if PINGPONG:
        mbarrier.arrive(other)
    if MASKED:
        k_pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        sc = gl.where((k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_stop), sc * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))  # key 0 is every row's: finite from the first tile on
        p = gl.exp2(sc - m_new[:, None])
    else:  # scale_log2 > 0: the row max of the raw scores, scaled; then one FMA a score
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * scale_log2)
        p = gl.exp2(sc * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
    pb = gl.convert_layout(p.to(k_smem.dtype), gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))
    acc = warpgroup_mma(pb, v_smem.index(s), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(0, deps=[acc, v_smem.index(s)])
    mbarrier.arrive(empty.index(s))  # (one elected arrival, after the warpgroup's own barrier)
    return acc, l_i, m_new


@gluon.jit
def _consumer(q_ptr, out_ptr, k_smem, v_smem, full, empty, mine, other, row0, tok0, q_rows, pos0, kv_stop, n_tiles,
              full_tiles, scale_log2, stride_qt, stride_ot, q_off, o_off, BLOCK_R: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
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
    for t in range(0, full_tiles):  # tiles every row sees whole: no mask
        acc, l_i, m_i = _tile(q, k_smem, v_smem, full, empty, mine, other, t, acc, l_i, m_i, q_pos, kv_stop,
                              scale_log2, mma, mma_o, BLOCK_N, STAGES, False, PINGPONG)
    for t in range(full_tiles, n_tiles):  # the diagonal: causal, and nothing past the run's last key
        acc, l_i, m_i = _tile(q, k_smem, v_smem, full, empty, mine, other, t, acc, l_i, m_i, q_pos, kv_stop,
                              scale_log2, mma, mma_o, BLOCK_N, STAGES, True, PINGPONG)
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))[:, None]
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), ld)
    gl.store(out_ptr + tok[:, None] * stride_ot + o_off + d[None, :], out, mask=io_mask)


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def prefill_ws_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale_log2,
                      num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_c_block, stride_c_slot,
                      stride_c_head, stride_bt, cache_rows, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                      BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
                      Q_LEN_THRESHOLD: gl.constexpr, STAGES: gl.constexpr, PWARPS: gl.constexpr,
                      PREGS: gl.constexpr, CREGS: gl.constexpr, TMA: gl.constexpr, PINGPONG: gl.constexpr):
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
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: whose scores next
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    if PINGPONG:
        mbarrier.arrive(turn.index(0))  # the first warpgroup goes first
    rows: gl.constexpr = BLOCK_M // 2
    tok0 = q_begin + q_start
    q_rows = q_len - q_start
    q_off = head * stride_qh
    o_off = head * stride_oh
    gl.warp_specialize([
        (_consumer, (q_ptr, out_ptr, k_smem, v_smem, full, empty, turn.index(0), turn.index(1), 0, tok0, q_rows,
                     first_pos, kv_stop, n_tiles, full_tiles, scale_log2, stride_qt, stride_ot, q_off, o_off, rows,
                     BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
        (_consumer, (q_ptr, out_ptr, k_smem, v_smem, full, empty, turn.index(1), turn.index(0), rows, tok0, q_rows,
                     first_pos, kv_stop, n_tiles, full_tiles, scale_log2, stride_qt, stride_ot, q_off, o_off, rows,
                     BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
        (_producer, (k_cache_ptr, v_cache_ptr, block_tables_ptr + s.to(gl.int64) * stride_bt, k_smem, v_smem, full,
                     empty, kv_stop, full_tiles, n_tiles, stride_c_block, stride_c_slot,
                     (head // GROUP) * stride_c_head,
                     cache_rows, BLOCK_N, HEAD_DIM, BLOCK_SIZE, STAGES, PWARPS, TMA)),
    ], [4, PWARPS], [CREGS, PREGS])


CONFIG = dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, PWARPS=2, PREGS=96, CREGS=232, TMA=True, PINGPONG=False,
              num_warps=4)


def prefill_ws(q, kv_cache, block_tables, query_start_loc, seq_lens, scale_log2, out, q_len_threshold=0, **over):
    """``triton_prefill.prefill_attention``'s launch (bf16/fp16 caches, head_dim 128) with the Gluon kernel."""
    cfg = {**CONFIG, **over}
    num_tokens, num_heads, head_dim = q.shape
    grid = ((num_tokens // cfg["BLOCK_M"] + seq_lens.shape[0]) * num_heads,)
    prefill_ws_kernel[grid](
        q, out, *kv_cache.unbind(), block_tables, seq_lens, query_start_loc, scale_log2, seq_lens.shape[0],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0), kv_cache.shape[1] * kv_cache.shape[2], NUM_HEADS=num_heads,
        GROUP=num_heads // kv_cache.shape[3],
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, Q_LEN_THRESHOLD=q_len_threshold, **cfg)


def compile_sm90() -> None:
    """Compiles the kernel (without and with PINGPONG) for an H100 / H200 without a GPU and prints each innermost
    loop's SASS instruction mix."""
    for pingpong in (False, True):
        _compile_one(pingpong)


def _compile_one(pingpong: bool) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ptrs = ("q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "qsl_ptr")
    sig = {p: "*i32" if p in ("block_tables_ptr", "seq_lens_ptr", "qsl_ptr") else "*bf16" for p in ptrs}
    sig |= {"scale_log2": "fp32", **{a: "i32" for a in ("num_seqs", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                                          "stride_c_block", "stride_c_slot", "stride_c_head",
                                                          "stride_bt", "cache_rows")}}
    cons = dict(NUM_HEADS=32, GROUP=4, BLOCK_SIZE=16, HEAD_DIM=128, Q_LEN_THRESHOLD=0,
                **{k: v for k, v in CONFIG.items() if k not in ("num_warps", "PINGPONG")}, PINGPONG=pingpong)
    sig |= {k: "constexpr" for k in cons}
    divisible = [i for i, a in enumerate(sig) if a in ptrs or (a.startswith("stride") and a != "stride_bt")]
    kernel = triton.compile(GluonASTSource(fn=prefill_ws_kernel, signature=sig, constexprs=cons,
                                           attrs={(i,): [["tt.divisibility", 16]] for i in divisible}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": CONFIG["num_warps"]})
    ptx = kernel.asm["ptx"]
    print(json.dumps({"triton": triton.__version__, "pingpong": pingpong, "shared_bytes": kernel.metadata.shared,
                      **{w: ptx.count(w) for w in ("wgmma.mma_async", "setmaxnreg", "cp.async.cg",
                                                   "cp.async.mbarrier.arrive.noinc", "mbarrier.try_wait")}}))
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "k.cubin"), "wb") as f:
        f.write(kernel.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in
             (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    at = {addr: i for i, (addr, _) in enumerate(lines)}
    for i, (addr, ins) in enumerate(lines):  # a loop: a branch back; its body from the target to the branch
        back = re.search(r"BRA\s+(0x[0-9a-f]+)", ins)
        if back and int(back.group(1), 16) < addr and i - at[int(back.group(1), 16)] > 40:
            body = [text for _, text in lines[at[int(back.group(1), 16)]:i + 1]]
            if any(re.search(r"BRA\s+0x", b) and int(re.search(r"0x[0-9a-f]+", b.split("BRA")[1]).group(0), 16)
                   < addr - 16 * (len(body) - 1) for b in body[:-1]):
                continue  # not innermost
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)
            print(f"loop of {len(body)} instructions:", ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))


def check_and_time() -> None:
    """On a Hopper GPU: each case's output against the Triton prefill kernel's and against float32 SDPA, and both
    kernels' TFLOP/s (attention alone, over the same paged cache)."""
    import torch

    from pagedllm.attention import prefill_bench as pb
    from pagedllm.attention import triton_kernels as tk
    from pagedllm.attention.kernel_bench import SHAPES, make_case, rel_error

    # device-side tensor descriptors (the producer's) need global scratch memory
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator().manual_seed(0)
    for shape, runs in pb.CASES:
        heads, kv_heads, head_dim = SHAPES[shape]
        case = make_case(heads, kv_heads, head_dim, runs, torch.bfloat16, gen)
        tk.reshape_and_cache(case["k"], case["v"], case["cache"], case["slots"])
        paged = (case["q"], case["cache"], case["block_tables"], case["qsl"], case["seq_lens"])
        ref = torch.empty_like(case["out"])

        def triton_run():
            tk.unified_attention(*paged, head_dim ** -0.5, ref, max_query_len=case["max_query_len"])

        def gluon_run(pingpong):
            prefill_ws(*paged, head_dim ** -0.5 * 1.4426950408889634, case["out"], PINGPONG=pingpong)

        triton_run()
        row = {"case": f"{shape} {len(runs)}x(ctx {runs[0][0]}, q {runs[0][1]})"}
        for pingpong in (False, True):
            case["out"].fill_(float("nan"))
            gluon_run(pingpong)
            torch.cuda.synchronize()
            tag = "pingpong" if pingpong else "gluon"
            row[f"{tag}_rel_diff_vs_triton"] = ((case["out"].float() - ref.float()).norm() / ref.float().norm()).item()
            row[f"{tag}_rel_err_vs_sdpa"] = rel_error(case) if runs[0][1] <= 8192 else None  # case["out"]: Gluon's
        flops = pb.causal_flops(runs, heads, head_dim)
        for name, fn in (("triton", triton_run), ("gluon", lambda: gluon_run(False)),
                         ("pingpong", lambda: gluon_run(True))):
            row[f"{name}_tflops"] = round(flops / pb.time_fn(fn) / 1e12, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="no GPU: compile for sm_90 and print the SASS loops")
    compile_sm90() if ap.parse_args().compile else check_and_time()
