"""FP8 KV cache scales in checkpoints: the names quantization tools give them, loaded into each
attention layer's ``kv_scale`` buffer ([k_scale, v_scale], float32; 1.0 where absent)."""
from __future__ import annotations

import re

import torch
from torch import nn

# (pattern, which) -> the attention module (group 1) and the scale (group 2: "k", "v", "kv"; "q"
# and "prob" are the query / softmax scales of fp8 attention, which the cache does not use).
_PATTERNS = (
    # llm-compressor / compressed-tensors (vLLM's own names), and vLLM-saved ``attn.k_scale``
    re.compile(r"^(.*\.self_attn)\.(?:attn\.)?(k|v|kv|q|prob)_scale$"),
    # NVIDIA ModelOpt: the scale on the projection that makes it
    re.compile(r"^(.*\.self_attn)\.(?:[kvq]_proj|qkv_proj)\.(k|v|q)_scale$"),
    # AutoFP8: the output scale of k_proj / v_proj
    re.compile(r"^(.*\.self_attn)\.([kvq])_proj\.output_scale$"),
)
_INDEX = {"k": (0,), "v": (1,), "kv": (0, 1)}  # kv_scale: the older single scale of both (vLLM copies it)


def kv_scale_target(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(attention module name, indices into its kv_scale) of a checkpoint KV-scale tensor; an empty
    index tuple for the scales the cache ignores; None for any other tensor."""
    for pattern in _PATTERNS:
        m = pattern.match(name)
        if m:
            return m.group(1), _INDEX.get(m.group(2), ())
    return None


@torch.no_grad()
def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Load a checkpoint KV-scale tensor into its attention layer; False when ``name`` is none."""
    target = kv_scale_target(name)
    if target is None:
        return False
    module_name, indices = target
    if not indices:
        return True
    try:
        attn = model.get_submodule(module_name)
    except AttributeError:
        attn = None
    if attn is None or not hasattr(attn, "kv_scale"):
        raise ValueError(f"checkpoint tensor {name!r}: {module_name!r} is not an attention layer with KV scales")
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}: only per-tensor KV cache "
                         "scales (one value per layer) are supported")
    value = float(tensor.float().reshape(()))
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"checkpoint tensor {name!r} = {value}: a KV cache scale must be finite and > 0")
    for i in indices:
        attn.kv_scale[i] = value
    attn.kv_scale_from_checkpoint = True
    return True
