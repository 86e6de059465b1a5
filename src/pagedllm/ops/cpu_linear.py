"""Linear layers on CPU through oneDNN (the matmul library torch ships), not MKL's sgemm.

Measured on this project's 2-core AMD EPYC (AVX-512) at the shapes of a decode step
(docs/cpu_performance.md): MKL sgemm, which ``F.linear`` uses for float32, runs 2.5-3.5x
slower than oneDNN's kernel on the same plain (unpacked) weight, at 1, 32 and 512 rows;
in bfloat16 oneDNN is ~10-20% faster too. The weight stays the model's own tensor, so a
weight update or sleep mode needs nothing extra. Both compute in the input dtype (oneDNN's
float32 math mode is left strict).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import envs

DISABLE_ENV = "PAGEDLLM_CPU_ONEDNN_LINEAR"  # "0": plain F.linear on CPU

# Decided once per process (the hot path pays no lookup); set back to None to decide again.
_ENABLED: bool | None = None
_DTYPES: tuple[torch.dtype, ...] = ()


def onednn_enabled() -> bool:
    """Whether oneDNN takes the CPU linears; it sets the dtypes it takes: float32, and bfloat16
    only where oneDNN has bf16 kernels for this CPU (AVX512-BF16 / AMX; on others, AVX2 ones,
    it refuses the primitive, and F.linear runs)."""
    global _ENABLED, _DTYPES
    if _ENABLED is None:
        _ENABLED = (envs.PAGEDLLM_CPU_ONEDNN_LINEAR and torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        _DTYPES = (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)
    return _ENABLED


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for CPU tensors, on oneDNN where it applies (float32 or
    bfloat16, nothing needing gradients)."""
    if (onednn_enabled() and x.dtype in _DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and not (x.requires_grad or weight.requires_grad)
            and x.shape[-1] == weight.shape[1] and x.numel()):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)
