"""MoE routing and pair alignment on CUDA, the two launches before the fused-MoE GEMMs
(``ops/triton_fused_moe.py``): each token's top-k experts in one program per token, and the
(token, slot) pairs laid out by expert and padded to the GEMM's row tile (one program for
decode-sized batches, a few torch kernels for large ones). Whatever the router's scores hold
(NaN included), every id stays a valid expert and no pair is counted past the experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.precompile import in_dry_run
from pagedllm.ops.triton_pdl import launch_args, pdl_enabled, pdl_enter


def moe_pdl(device: torch.device) -> dict:
    """The launch arguments of a fused-MoE kernel: launched early (``triton_pdl``) where the
    device can and ``PAGEDLLM_MOE_PDL`` is not 0 (a decode step's MoE is a chain of five short
    launches, each waiting for the one before it in ``pdl_enter``)."""
    return launch_args(pdl_enabled(device, "PAGEDLLM_MOE_PDL"))


@triton.jit
def _valid_expert(expert, num_experts):
    """An id outside [0, num_experts) as -1 (a pair no expert here takes): never an address past the counts."""
    return tl.where(expert < num_experts, expert, -1)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, cursor_ptr, num_pairs, num_experts, max_blocks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
                      PDL: tl.constexpr):
    """align_pairs in one program: count each expert's pairs (atomics), pad the counts to BLOCK_M
    and prefix-sum them into each expert's first row, give every block its expert, then place each
    pair at its expert's next free row. The order of pairs within an expert's rows is whatever the
    atomics give: each row is computed on its own, so results do not depend on it."""
    pdl_enter(PDL)
    e_offs = tl.arange(0, E_PAD)
    e_ok = e_offs < num_experts
    tl.store(cursor_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32))
    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                 mask=rows < max_blocks * BLOCK_M)
    tl.debug_barrier()
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        expert = _valid_expert(tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32), num_experts)
        tl.atomic_add(cursor_ptr + expert, 1, mask=expert >= 0)
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + e_offs, mask=e_ok, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    tl.debug_barrier()  # every count is read before the cursors overwrite them
    tl.store(cursor_ptr + e_offs, (block_end - blocks) * BLOCK_M, mask=e_ok)
    for b0 in range(0, max_blocks, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        before = (block_end[None, :] <= b[:, None]) & e_ok[None, :]
        owner = tl.sum(before.to(tl.int32), axis=1)  # experts whose blocks all end before b
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < max_blocks)
    tl.debug_barrier()
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        expert = _valid_expert(tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32), num_experts)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=expert >= 0)
        tl.store(sorted_pairs_ptr + row, pairs, mask=expert >= 0)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
                  ROUND_FP16: tl.constexpr, PDL: tl.constexpr):
    """One token's routing: scores (softmax or sigmoid, float32), its TOP_K best experts (the
    lowest id first among equal scores), the weights renormalised and rounded as asked."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    ok = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
    # Below any score: never picked. NaN scores too (a NaN in the hidden states, or the garbage of
    # a launch the compile dry run skipped): every id stays a valid expert, whatever the input.
    scores = tl.where(ok & (scores == scores), scores, -1.0)
    k_offs = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, offs, E_PAD), axis=0)
        vals = tl.where(k_offs == j, best, vals)
        ids = tl.where(k_offs == j, pick.to(tl.int64), ids)
        scores = tl.where(offs == pick, -2.0, scores)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(k_offs < TOP_K, vals, 0.0), axis=0)
    if ROUND_BF16:
        vals = vals.to(tl.bfloat16).to(tl.float32)
    if ROUND_FP16:
        vals = vals.to(tl.float16).to(tl.float32)
    tl.store(weights_ptr + row * TOP_K + k_offs, vals, mask=k_offs < TOP_K)
    tl.store(ids_ptr + row * TOP_K + k_offs, ids, mask=k_offs < TOP_K)


def route_triton(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                 round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_moe.route`` in one launch (torch's softmax, top-k, sum and division take five small
    kernels a layer, which a decode step feels): float32 weights (rounded to ``round_to`` if
    given) and int64 expert ids, [T, top_k]."""
    num_tokens, num_experts = router_logits.shape
    # While compiles are collected this launch may be skipped: the align kernel must then read valid ids.
    alloc = torch.zeros if in_dry_run() else torch.empty
    weights = alloc(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = alloc(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        e_pad = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, SIGMOID=scoring == "sigmoid",
                                     RENORMALIZE=renormalize, ROUND_BF16=round_to == torch.bfloat16,
                                     ROUND_FP16=round_to == torch.float16, num_warps=1 if e_pad <= 256 else 4,
                                     **moe_pdl(logits.device))
    return weights, ids


def align_pairs_triton(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_pairs``' layout from one Triton launch (the torch version takes a dozen small
    kernels per layer, which a decode step feels); the same blocks, pairs in any order within an expert."""
    num_pairs = local_ids.numel()
    max_blocks = min(num_experts, num_pairs) + triton.cdiv(num_pairs, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    if in_dry_run():  # the align launch may be skipped while the GEMMs (compiled before) run: no garbage ids
        sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=local_ids.device)
        block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=local_ids.device)
    else:
        sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=local_ids.device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=local_ids.device)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=local_ids.device)
    _moe_align_kernel[(1,)](local_ids.reshape(-1), sorted_pairs, block_expert, cursor, num_pairs, num_experts,
                            max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=1024,
                            CHUNK_B=max(16, min(64, 8192 // e_pad)), num_warps=4, **moe_pdl(local_ids.device))
    return sorted_pairs, block_expert


def align_pairs(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32): the flat
    (token, slot) pair indices grouped by expert, each expert's run padded to a multiple of
    ``block_m`` with ``num_pairs`` (a row the kernels skip), and each block's expert (-1 past the
    last used block). Pairs whose expert is -1 (another rank's) are left out. Shapes depend on the
    pair count only, and nothing is read back to the host: a CUDA graph can hold it."""
    flat = local_ids.reshape(-1).long()
    num_pairs = flat.numel()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # bucket E: not on this rank
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    row_begin = torch.cat([(block_end - blocks) * block_m, block_end[-1:] * 0 - 1])  # bucket E: dropped
    count_begin = torch.cumsum(counts, 0) - counts
    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - count_begin[sorted_bucket]
    max_blocks = min(num_experts, num_pairs) + triton.cdiv(num_pairs, block_m)
    max_rows = max_blocks * block_m
    dest = torch.where(sorted_bucket < num_experts, row_begin[sorted_bucket] + rank_in_expert, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:max_rows], block_expert
