"""Mixture-of-experts compute: top-k routing and the experts' SiLU MLPs with a weighted top-k sum.

The torch code here is the CPU path and the reference the Triton kernel
(``ops/triton_fused_moe.py``, CUDA) is tested against. Experts' weights are fused: ``w13``
``[E, 2I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]``. Under expert parallelism a
rank holds only some experts: ``expert_map`` maps a global expert id to its local index, or -1
for another rank's (those tokens contribute zero here; the all-reduce after adds the others).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.ops.cpu_linear import cpu_linear
from pagedllm.ops.moe_scales import ExpertScales, dequantize_expert, expert_dims

SCORING_FUNCS = ("softmax", "sigmoid")
CPU_ONEDNN_MIN_ROWS = 16


def route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
          round_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts, scored
    in float32 by softmax or sigmoid; ``renormalize`` makes each token's k weights sum to 1;
    ``round_to``: the weights rounded to that dtype (still float32 tensors). One Triton launch on
    CUDA (``triton_fused_moe.route_triton``), the torch code elsewhere."""
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"MoE scoring function {scoring!r} is not supported; supported: {list(SCORING_FUNCS)}")
    from pagedllm.ops import triton_ops_for

    if router_logits.dim() == 2 and triton_ops_for(router_logits) is not None:
        from pagedllm.ops.triton_moe_routing import route_triton

        return route_triton(router_logits, top_k, scoring, renormalize, round_to)
    weights, ids = route_torch(router_logits, top_k, scoring, renormalize)
    return (weights, ids) if round_to is None else (weights.to(round_to).float(), ids)


def route_torch(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``route``'s torch code: the reference of its Triton kernel."""
    if scoring == "softmax":
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(router_logits.float())
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def local_expert_ids(ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Each (token, slot)'s expert as an index into this rank's weights (-1: another rank's)."""
    return ids if expert_map is None else expert_map[ids]


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                        scales: ExpertScales | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over each token's experts
    ``e = ids[t, j]``: the (token, slot) pairs are grouped by expert, one matmul pair per active
    expert. Products are rounded to x's dtype as ``F.linear`` rounds them; the sum is float32.
    ``scales``: the weights are quantized (fp8 or int4), each active expert's dequantized per matmul."""
    num_tokens, top_k = ids.shape
    inter = expert_dims(w13, scales)[2] // 2
    flat = local_expert_ids(ids, expert_map).reshape(-1)
    pairs = torch.arange(flat.numel(), device=x.device)
    if expert_map is not None:
        mine = flat >= 0
        flat, pairs = flat[mine], pairs[mine]
    order = torch.argsort(flat, stable=True)
    pairs = pairs[order]
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    flat_weights = weights.reshape(-1).float()
    on_cpu = x.device.type == "cpu"
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        expert_pairs = pairs[start:start + n]
        start += n
        tokens = expert_pairs // top_k
        # On CPU oneDNN beats MKL's sgemm on a few dozen rows (measured 1.4-2.2x); on a handful its call costs more.
        linear = cpu_linear if on_cpu and n >= CPU_ONEDNN_MIN_ROWS else F.linear
        w_gate_up, w_down = w13[expert], w2[expert]
        if scales is not None:
            w_gate_up = dequantize_expert(w_gate_up, scales, "w13", expert, x.dtype)
            w_down = dequantize_expert(w_down, scales, "w2", expert, x.dtype)
        gate_up = linear(x[tokens], w_gate_up)
        y = linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down)
        out.index_add_(0, tokens, y.float() * flat_weights[expert_pairs, None])
    return out.to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  expert_map: torch.Tensor | None = None, scales: ExpertScales | None = None) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` for this rank's experts: the Triton kernel on CUDA
    (when the Triton ops are on), else the torch path."""
    from pagedllm.ops import triton_ops_for

    if x.numel() and triton_ops_for(x) is not None:
        from pagedllm.ops.triton_fused_moe import fused_experts_triton

        return fused_experts_triton(x, w13, w2, weights, ids, expert_map, scales=scales)
    return fused_experts_torch(x, w13, w2, weights, ids, expert_map, scales)


def fused_experts_bmm_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> torch.Tensor:
    """The kernel benchmark's naive baseline: a loop over every expert, each finding its tokens
    with a mask and running them through ``torch.bmm`` (one host sync per expert)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(ids == expert)
        if tokens.numel() == 0:
            continue
        gate_up = torch.bmm(x[tokens].unsqueeze(0), w13[expert].t().unsqueeze(0))[0]
        y = torch.bmm((F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).unsqueeze(0), w2[expert].t().unsqueeze(0))[0]
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None].float())
    return out.to(x.dtype)
