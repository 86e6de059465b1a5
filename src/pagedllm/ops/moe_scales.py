"""The scales of quantized MoE expert weights (W8A16 fp8, W4A16 int4), which both fused-MoE paths
read: the Triton kernels (``ops/triton_fused_moe.py``) and the torch path (``ops/fused_moe.py``,
through ``dequantize_expert``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.ops.int4_layout import unpack_rows


@dataclass(frozen=True)
class ExpertScales:
    """The float scales of quantized expert weights, which stay quantized in memory (W8A16 /
    W4A16: the activations stay in the model dtype; a decode step's experts read fewer bytes).

    - fp8 (e4m3) weights in the usual [E, N, K] layout: one scale per output channel, ``w13``
      [E, 2I] and ``w2`` [E, H]; or with ``block`` (bn, bk) one per bn x bk weight tile, ``w13``
      [E, ceil(2I / bn), ceil(H / bk)] and ``w2`` [E, ceil(H / bn), ceil(I / bk)].
    - int4 (``group`` G): each expert's weight in the canonical int4 layout (``ops/int4_layout``:
      int32 words [K / 8, N]), so w13 [E, H / 8, 2I] and w2 [E, I / 8, H]; ``w13`` / ``w2`` the
      group scales per output row, [E, 2I, H / G] and [E, H, I / G]; ``w13_zeros`` / ``w2_zeros``
      the zero points unpacked (uint8, same shapes), or None (symmetric: 8)."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None = None
    group: int | None = None
    w13_zeros: torch.Tensor | None = None
    w2_zeros: torch.Tensor | None = None


def expert_dims(w13: torch.Tensor, scales: ExpertScales | None) -> tuple[int, int, int]:
    """(experts, hidden size, 2 x intermediate size) of the fused gate/up weight (int4: words [E, H / 8, 2I])."""
    if scales is not None and scales.group is not None:
        return w13.shape[0], w13.shape[1] * 8, w13.shape[2]
    return w13.shape[0], w13.shape[2], w13.shape[1]


WEIGHT_FORMATS = ("", "fp8", "fp8-block", "int4")  # as the fused-MoE tile table keys them ("": 16/32-bit)


def weight_format(scales: ExpertScales | None) -> str:
    """The experts' weight format (one of WEIGHT_FORMATS), as the fused-MoE tile table keys it."""
    if scales is None:
        return ""
    return "int4" if scales.group is not None else "fp8-block" if scales.block is not None else "fp8"


def dequantize_expert(w: torch.Tensor, scales: ExpertScales, which: str, expert: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s quantized ``which`` ("w13" or "w2") weight ``w`` as [N, K] in ``dtype``,
    from float32 products rounded once."""
    scale = getattr(scales, which)[expert]
    if scales.group is not None:
        zeros = getattr(scales, f"{which}_zeros")
        q = unpack_rows(w)  # [K, N]
        z = 8 if zeros is None else zeros[expert].t().to(torch.int32).repeat_interleave(scales.group, 0)[:q.shape[0]]
        s = scale.t().float().repeat_interleave(scales.group, 0)[:q.shape[0]]
        return ((q - z).float() * s).to(dtype).t()
    if scales.block is None:
        return (w.float() * scale[:, None]).to(dtype)
    n, k = w.shape
    elements = scale.repeat_interleave(scales.block[0], 0)[:n].repeat_interleave(scales.block[1], 1)[:, :k]
    return (w.float() * elements).to(dtype)
