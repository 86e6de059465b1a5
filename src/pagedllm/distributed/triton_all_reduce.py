"""A one-shot all-reduce over symmetric memory in Triton, for the decode steps' messages.

torch's one-shot and two-shot kernels (``torch.ops.symm_mem``) run on a few dozen thread blocks,
which bounds how many bytes are in flight over NVLink (on two H200s ~100-150 GB/s at 1-8 MiB,
README "Tensor parallelism"), and meet the peers twice per call. This kernel spreads a message
over up to two programs per SM and meets the peers once. Program ``p`` owns one contiguous chunk
of the message on every rank:

1. copies its chunk of ``x`` into this rank's buffer, in the half of the buffer of this call's parity;
2. meets program ``p`` of every other rank: adds 1 to its flag in each peer's flag area (release,
   after a CTA barrier), then waits until each peer's flag in its own area has reached the call
   count (acquire);
3. sums the chunk over the ranks in rank order (float32; the local term read from ``x``, the
   peers' past L1) and stores it;
4. counts itself done; the last program of the call advances the call count (``state[0]``).

Only chunk ``p`` crosses between programs ``p``, so the barrier is per program. No second barrier
guards the buffer: consecutive calls write alternate halves, and a rank writes a half again only
two calls later, after program ``p`` of every peer has signalled the call in between, which it does
only once its previous call (the reader of that half) has finished. The flags only grow (one per
call; compared by wrapping difference), so nothing resets them, and CUDA graph replays go on
counting where the last call left off.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, bufs, flags, state, n, chunk, half,
                               RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """``bufs`` / ``flags``: int64 arrays of every rank's buffer / flag-area address; ``state``: this
    rank's [calls so far, programs done in this call] (int32); ``chunk``: elements per program (a
    multiple of BLOCK); ``half``: elements in one half of a buffer."""
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
            tl.atomic_add(tl.load(flags + r).to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK, 1, sem="release",
                          scope="sys")
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
