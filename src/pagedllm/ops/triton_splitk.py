"""Split-K for the small-row decode kernels (W4A16, FP8): a projection of few output features
(a 4096-wide o_proj is 64 tiles of 64) gives too few programs to keep every SM streaming its
weight, so K is split too. Each program writes its fp32 partial to a workspace; the last of a
column tile's programs to finish (a counter per tile, which it resets to 0 for the next launch)
sums the partials in split order, adds the bias and writes the output. One launch, graph-safe,
and the result does not depend on which program finished last (deterministic)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(cnt_ptr, parts):
    """After a program has stored its partial: count it in at ``cnt_ptr``; whether it is the last of
    ``parts``. The count releases this program's stores and acquires the others' (read them past L1,
    ``.cg``: a line cached in L1 before the count would not be ordered by it). The last resets the
    counter (``tl.atomic_xchg(cnt_ptr, 0)``) once it has read them, for the next launch and replay."""
    tl.debug_barrier()  # every thread's partial is stored before the (release) count below
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == parts - 1


@triton.jit
def tile_counter():
    """The index of this program's (row tile, column tile) counter, for the split-K GEMMs' grid of
    (column tiles, K splits, row tiles)."""
    return tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def finish_split(acc, ws_ptrs, split_stride, y_ptrs, b_ptrs, mask, cnt_ptr, tile, pid_k, SPLIT_K,
                 HAS_BIAS: tl.constexpr):
    """``acc``: this program's partial (scales applied); ``ws_ptrs`` / ``y_ptrs`` / ``b_ptrs``:
    ``acc``-shaped pointers into the workspace's first split, the output and the bias (broadcast);
    ``split_stride``: elements between two splits' partials; ``tile``: the column tile's counter."""
    tl.store(ws_ptrs + pid_k.to(tl.int64) * split_stride, acc, mask=mask)
    if last_to_arrive(cnt_ptr + tile, SPLIT_K):  # the last program of this column tile: sum in split order
        total = tl.zeros_like(acc)
        for sk in range(SPLIT_K):
            total += tl.load(ws_ptrs + sk * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (and the next graph replay)


_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers a larger one replaced: CUDA graphs may still hold their address


def counters(device: torch.device, size: int, owner: str = "gemm") -> torch.Tensor:
    """The per-column-tile counters: zeros, and zeros again after every launch (the last program of
    a tile resets its counter), so one buffer made outside any graph serves every launch and
    replay. Made during a capture (no buffer yet), a fresh one is captured with the graph. One
    buffer per device and ``owner`` (the split-K GEMMs; the split attention, ``triton_kernels``):
    launches of one owner on one device must not run concurrently (the engine runs its forward,
    eager or graph replay, on one stream; a mixed step's decodes on a second stream run beside the
    prefill kernel, which counts nothing). A buffer outgrown by a larger launch is kept, never freed:
    graphs captured before hold its address, and their replays count (and reset) in it."""
    buf = _COUNTERS.get((device, owner))
    if buf is None or buf.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(size, dtype=torch.int32, device=device)
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[device, owner] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return buf


def split_for(k_tiles: int, split: int) -> tuple[int, int]:
    """(K tiles per split, splits): ``split`` rounded so every split has the same tile count but the
    last (which may have fewer)."""
    per_split = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    return per_split, triton.cdiv(k_tiles, per_split)


def splitk_setup(y: torch.Tensor, k_tiles: int, split: int, tiles: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """A split-K launch's (K tiles per split, splits, fp32 workspace [splits, *y.shape], counters for
    ``tiles`` output tiles); without a split, ``y`` stands in for the two buffers the kernel then
    never touches."""
    per_split, split = split_for(k_tiles, split)
    if split == 1:
        return per_split, split, y, y
    return per_split, split, torch.empty(split, *y.shape, dtype=torch.float32, device=y.device), \
        counters(y.device, tiles)
