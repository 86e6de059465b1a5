"""A one-shot all-reduce over symmetric memory in Triton, for the larger decode messages.

torch's one-shot and two-shot kernels (``torch.ops.symm_mem``) move ~100-150 GB/s over NVLink at
1-8 MiB on two H200s (README, "Tensor parallelism"), a fraction of the links. This kernel spreads a
message over up to two programs per SM (8 warps, almost no shared memory: all resident at once, so a
program never waits on a peer's program that cannot start), so many more bytes are in flight. Program ``p``
owns one contiguous chunk of the message on every rank:

1. copies its chunk of ``x`` into this rank's buffer;
2. meets program ``p`` of every other rank at a barrier (a flag in each peer's flag area, set
   with release semantics after a CTA barrier; its own flags awaited with acquire semantics);
3. sums the chunk over the ranks in rank order (float32; the local term read from ``x``, the peers'
   past L1) and stores it;
4. meets the same programs again, so that no rank overwrites its buffer (the next call's step 1)
   while a peer still reads it.

Only chunk ``p`` crosses between programs ``p``, so the barriers are per program, not global.
Every flag is set from 0 to 1 by its writer and back to 0 by its reader (compare-and-swap loops
both ways), so the area is zero again after every launch, and CUDA graph replays reuse it.
"""
from __future__ import annotations

import triton
import triton.language as tl


def launch_shape(n: int, max_programs: int, block: int) -> tuple[int, int]:
    """(programs, chunk) for ``n`` elements: chunks of whole ``block``s, at most ``max_programs`` of them,
    none empty (a program past the message would still meet its peers, for nothing)."""
    programs = min(max_programs, -(-n // block))
    chunk = -(-n // (programs * block)) * block
    return -(-n // chunk), chunk


@triton.jit
def _meet_peers(flags, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Barrier of this program with the programs of the same index on the other ranks. ``flags``:
    per rank, the int64 address of its flag area; ``slot``: this barrier's row of WORLD flags."""
    tl.debug_barrier()  # every thread's memory operations come before the release below
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = tl.load(flags + r).to(tl.pointer_type(tl.int32)) + slot * WORLD + RANK
            while tl.atomic_cas(peer, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.load(flags + RANK).to(tl.pointer_type(tl.int32)) + slot * WORLD
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_cas(mine + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, bufs, flags, n, chunk,
                               RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """``bufs`` / ``flags``: int64 arrays of every rank's buffer / flag-area address; ``chunk``: elements
    per program (a multiple of BLOCK)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * chunk
    dtype = x_ptr.dtype.element_ty
    mine = tl.multiple_of(tl.load(bufs + RANK).to(tl.pointer_type(dtype)), 16)  # symmetric buffers: 16-aligned
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    _meet_peers(flags, 2 * pid, RANK, WORLD)
    for start in range(0, chunk, BLOCK):
        offs = tl.multiple_of(lo + start, BLOCK) + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + offs, mask=ok).to(tl.float32)
            else:
                peer = tl.multiple_of(tl.load(bufs + r).to(tl.pointer_type(dtype)), 16)
                acc += tl.load(peer + offs, mask=ok, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=ok)
    _meet_peers(flags, 2 * pid + 1, RANK, WORLD)
