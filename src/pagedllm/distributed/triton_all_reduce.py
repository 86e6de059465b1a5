"""A one-shot all-reduce over symmetric memory in Triton, for the larger decode messages.

torch's one-shot and two-shot kernels (``torch.ops.symm_mem``) move ~100-150 GB/s over NVLink at
1-8 MiB on two H200s (README, "Tensor parallelism"), a fraction of the links. This kernel spreads a
message over up to two programs per SM (8 warps, almost no shared memory: all resident at once, so a
program never waits on a peer's program that cannot start), so many more bytes are in flight. Program ``p``
owns one contiguous chunk of the message on every rank:

1. copies its chunk of ``x`` into this rank's buffer, into the half of the data area of this
   call's parity;
2. meets program ``p`` of every other rank: writes the call's number into its flag in each peer's
   flag area (release, after a CTA barrier), then waits until each peer's flag in its own area has
   reached it (acquire);
3. sums the chunk over the ranks in rank order (float32; the local term read from ``x``, the peers'
   past L1) and stores it;
4. counts itself done; the call's last program advances the call number (``state[0]``).

Only chunk ``p`` crosses between programs ``p``, so the barrier is per program, not global. No
second barrier guards the buffer: consecutive calls write alternate halves, and a rank writes a
half again only two calls later, once it has met a peer's program in the call between, which the
peer starts only after its own call before (the reader of that half) has ended. The flags hold
call numbers, compared by wrapping difference (a peer is at most one call ahead), so nothing
resets them: a program slot that calls with fewer programs leave unused keeps an older number
(flags that counted calls instead hung there), and CUDA graph replays go on from the last call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.ops.triton_pdl import pdl_enter


def launch_shape(n: int, max_programs: int, block: int) -> tuple[int, int]:
    """(programs, chunk) for ``n`` elements: chunks of whole ``block``s, at most ``max_programs`` of them,
    none empty (a program past the message would still meet its peers, for nothing)."""
    programs = min(max_programs, -(-n // block))
    chunk = -(-n // (programs * block)) * block
    return -(-n // chunk), chunk


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, bufs, flags, state, n, chunk, half,
                               RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                               ENTER: tl.constexpr = False):
    """``bufs`` / ``flags``: int64 arrays of every rank's buffer / flag-area address; ``state``: this
    rank's [calls so far, programs done in this call] (int32); ``chunk``: elements per program (a
    multiple of BLOCK); ``half``: elements in one half of the data area. ENTER (launched early, in a
    layer's chain): wait for the kernel before (the projection that wrote ``x``; each kernel of the
    chain waits for its own, so the previous call has ended too), then let the next one launch: once
    every program of this call has started, so a program that waits for its peers never waits for
    a slot the next kernel took."""
    pdl_enter(ENTER)
    pid = tl.program_id(0)
    call = tl.load(state, volatile=True)  # the same for every program: advanced once all are done
    lo = pid.to(tl.int64) * chunk
    side = (call & 1).to(tl.int64) * half  # this call's half of every buffer
    dtype = x_ptr.dtype.element_ty
    mine = tl.multiple_of(tl.load(bufs + RANK).to(tl.pointer_type(dtype)), 16) + side  # symmetric: 16-aligned
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    tl.debug_barrier()  # every thread's copy comes before the release below
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.atomic_xchg(tl.load(flags + r).to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK, call + 1,
                           sem="release", scope="sys")
    own = tl.load(flags + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_add(own + r, 0, sem="acquire", scope="sys") - (call + 1) < 0:
                pass
    tl.debug_barrier()
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + offs, mask=ok).to(tl.float32)
            else:
                peer = tl.multiple_of(tl.load(bufs + r).to(tl.pointer_type(dtype)), 16) + side
                acc += tl.load(peer + offs, mask=ok, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=ok)
    if tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(state + 1, 0)
        tl.atomic_xchg(state, call + 1)


NEG_ZERO_BITS = -32768  # a 16-bit float's -0.0 (0x8000) as int16: the "not arrived yet" mark
NEG_ZERO = tl.constexpr(NEG_ZERO_BITS)


@triton.jit
def _unmarked(v):
    """16-bit words with -0.0 made +0.0: never the "not arrived" mark."""
    return tl.where(v == NEG_ZERO, tl.zeros_like(v), v)


@triton.jit
def _arrived(src, ok):
    """The 16-bit words at ``src`` (where ``ok``) once none is the "not arrived" mark: reread until then."""
    v = tl.load(src, mask=ok, other=0, volatile=True)
    while tl.max(((v == NEG_ZERO) & ok).to(tl.int32), axis=0) > 0:
        v = tl.load(src, mask=ok, other=0, volatile=True)
    return v


@triton.jit
def lamport_all_reduce_kernel(x_ptr, out_ptr, bufs, state, n, chunk, slot,
                              RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                              ENTER: tl.constexpr = False):
    """One-shot all-reduce of 16-bit floats whose data is its own flag (the Lamport scheme of
    TensorRT-LLM's small all-reduces), no fence and no barrier: every rank's buffer (``bufs``: their
    addresses) has three regions of WORLD slots of ``slot`` elements, every element of a region
    -0.0 (``NEG_ZERO``) while unwritten. A call in region c (``state[0]``):

    1. stores this rank's chunk, each -0.0 made +0.0, into its slot of region c of every peer;
    2. reads its own buffer's region c slots until none of the chunk's elements is -0.0 (the
       peers' stores have landed; a 16-bit element lands whole), sums the ranks in rank order in
       float32, the local term made +0.0 too (so every rank adds the same values: the same bits);
    3. sets the region of the call before (its data read by then; ``state[2 + region]``: its size)
       back to -0.0 for the call after next, the next writer of that region: a peer gets there only
       after taking this rank's data of the call between, which this rank sends after this call
       ended;
    4. counts itself done; the last program records the call's size and moves to the next region.

    ENTER: as ``one_shot_all_reduce_kernel``'s. Signed zeros of the sum may differ from NCCL's
    (0.0 where NCCL gives -0.0); every other bit is the same."""
    pdl_enter(ENTER)
    pid = tl.program_id(0)
    region = tl.load(state, volatile=True)
    stale = (region + 2) % 3
    stale_n = tl.load(state + 2 + stale).to(tl.int64)
    lo = pid.to(tl.int64) * chunk
    mine = tl.multiple_of(tl.load(bufs + RANK).to(tl.pointer_type(tl.int16)), 16)
    put = (region * WORLD + RANK).to(tl.int64) * slot
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(x_ptr + offs, mask=ok).to(tl.int16, bitcast=True)
        v = _unmarked(v)
        for r in tl.static_range(WORLD):
            if r != RANK:
                peer = tl.multiple_of(tl.load(bufs + r).to(tl.pointer_type(tl.int16)), 16)
                tl.store(peer + put + offs, v, mask=ok)
    dtype = x_ptr.dtype.element_ty
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                v = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.int16, bitcast=True)
                v = _unmarked(v)
            else:
                v = _arrived(mine + (region * WORLD + r).to(tl.int64) * slot + offs, ok)
            acc += v.to(dtype, bitcast=True).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=ok)
    # The call before's slots back to -0.0, spread over this call's programs.
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    marks = tl.full([BLOCK], NEG_ZERO, dtype=tl.int16)
    for start in range(pid.to(tl.int64) * BLOCK, stale_n, step):
        offs = start + tl.arange(0, BLOCK)
        for r in tl.static_range(WORLD):
            if r != RANK:
                tl.store(mine + (stale * WORLD + r).to(tl.int64) * slot + offs, marks, mask=offs < stale_n)
    if tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(state + 2 + region, n)
        tl.atomic_xchg(state + 1, 0)
        tl.atomic_xchg(state, (region + 1) % 3)
