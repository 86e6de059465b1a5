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


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor, scales: ExpertScales, dtype: torch.dtype,
                      zeros: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's quantized weight as [N, K] in ``dtype`` (``scale``/``zeros``: ``scales``' rows
    for it), from float32 products rounded once."""
    if scales.group is not None:
        q = unpack_rows(w)  # [K, N]
        z = 8 if zeros is None else zeros.t().to(torch.int32).repeat_interleave(scales.group, 0)[:q.shape[0]]
        s = scale.t().float().repeat_interleave(scales.group, 0)[:q.shape[0]]
        return ((q - z).float() * s).to(dtype).t()
    if scales.block is None:
        return (w.float() * scale[:, None]).to(dtype)
    n, k = w.shape
    elements = scale.repeat_interleave(scales.block[0], 0)[:n].repeat_interleave(scales.block[1], 1)[:, :k]
    return (w.float() * elements).to(dtype)
