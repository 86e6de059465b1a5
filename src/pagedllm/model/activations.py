"""The gated activations over a fused gate_up projection's two halves."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops import triton_ops_for


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` over the two halves of a fused gate_up projection (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` over the two halves of a fused gate_up projection."""

    # Set by the loader where the projection after this is fp8 W8A8 with per-token activations
    # (``RMSNorm.fp8_out``): the Triton kernel also quantizes its output rows for it.
    fp8_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = triton_ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x, self.fp8_out)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
