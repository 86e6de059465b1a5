"""Picks the attention backend for a device (the factory, apart from the interface it returns)."""
from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend

_SUPPORTED = ("torch", "triton")


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Pick the backend for ``device``: Triton on CUDA when triton is installed, else the torch
    reference; ``PAGEDLLM_ATTENTION_BACKEND`` forces one."""
    name = envs.PAGEDLLM_ATTENTION_BACKEND
    if name is not None and name not in _SUPPORTED:
        raise ValueError(f"PAGEDLLM_ATTENTION_BACKEND={name!r} is not one of {list(_SUPPORTED)}")
    if name is None:
        name = "torch"
        if device.type == "cuda":
            try:
                import pagedllm.attention.triton_backend  # noqa: F401

                name = "triton"
            except ImportError:  # no triton installed
                name = "torch"
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from pagedllm.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
