"""Fused kernels of the GPU hot path; the torch code in pagedllm.model.layers stays the CPU path
and the reference they are tested against."""
from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from pagedllm import envs

DISABLE_ENV = "PAGEDLLM_DISABLE_TRITON_OPS"  # its name, for messages and tests (defined in envs)

# pagedllm.ops.triton_ops once looked up, False where triton is missing or DISABLE_ENV=1.
# Decided once per process, so the hot path pays no lookup; set back to None to decide again.
_TRITON_OPS: ModuleType | bool | None = None


def triton_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton ops module when ``x`` is on CUDA and they are enabled, else None (use torch)."""
    global _TRITON_OPS
    if not x.is_cuda:
        return None
    if _TRITON_OPS is None:
        enabled = not envs.PAGEDLLM_DISABLE_TRITON_OPS and importlib.util.find_spec("triton") is not None
        if enabled:
            from pagedllm.ops import triton_ops

            _TRITON_OPS = triton_ops
        else:
            _TRITON_OPS = False
    return _TRITON_OPS or None
