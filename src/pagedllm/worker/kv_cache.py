"""The paged KV cache's tensors: their dtype (the model's, or fp8 with per-layer scales) and allocation."""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedllm.attention.kv_quant import is_fp8
from pagedllm.config import CacheConfig
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec, layer_placement

logger = logging.getLogger("pagedllm")


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor: zeros, so padded reads in a batched kernel only ever see finite values."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # calloc hands out fresh zero pages without touching them: a 4 GiB CPU cache costs
    # no start-up time and only the memory actually written.
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def place_layers(attn_layers: list[nn.Module], groups: list[KVCacheGroupSpec], model_name: str) -> list[int]:
    """Each attention layer's cache tensor, as a slot number, setting the layer's KV cache group
    (core/kv_cache_groups.py). One group: a tensor per layer, as listed. Several: slot i of every
    group shares one tensor, so a physical block holds one layer of each slot; a block id belongs
    to one group at a time (one pool), so the groups never write over each other."""
    if len(groups) == 1:
        return list(range(len(attn_layers)))
    placement = layer_placement(groups)
    slots = []
    for layer in attn_layers:
        idx = getattr(layer, "layer_idx", None)
        if idx not in placement:
            raise ValueError(f"attention layer {idx!r} of {model_name} is not among the {len(placement)} layers "
                             "its config's layer types describe")
        layer.kv_cache_group, slot = placement[idx]
        slots.append(slot)
    return slots


def allocate_kv_caches(attn_layers: list[nn.Module], slots: list[int], shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per slot (``place_layers``), set on the layers; returned in slot order."""
    by_slot = {slot: zeroed_cache(shape, dtype, device) for slot in sorted(set(slots))}
    for layer, slot in zip(attn_layers, slots):
        layer.kv_cache = by_slot[slot]
    return list(by_slot.values())


def check_fp8_kv_cache(cc: CacheConfig, kv_dtype: torch.dtype, layers: list[nn.Module], device: torch.device) -> bool:
    """Refuse an fp8 cache the device's kernels cannot write, log where its scales come from;
    returns whether the first step must compute them (calculate_kv_scales)."""
    from_checkpoint = sum(bool(getattr(layer, "kv_scale_from_checkpoint", False)) for layer in layers)
    if not is_fp8(kv_dtype):
        if cc.calculate_kv_scales:
            logger.warning("calculate_kv_scales=True has no effect with kv_cache_dtype='auto'")
        if from_checkpoint:
            logger.info("The checkpoint carries KV cache scales (k_scale / v_scale): kv_cache_dtype='fp8' uses them")
        return False
    if device.type == "cuda" and kv_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability 8.9 or newer (Ada, Hopper) "
                         "for the Triton kernels; use 'fp8_e5m2' or 'auto'")
    if cc.calculate_kv_scales:
        how = "computed from the first step's K/V (amax / 200 for K, amax / 100 for V)"
    elif from_checkpoint:
        how = f"from the checkpoint for {from_checkpoint} of {len(layers)} attention layers, 1.0 elsewhere"
    else:
        how = ("1.0: the checkpoint has no k_scale / v_scale; K/V past the fp8 range saturate "
               "(calculate_kv_scales=True computes them from the first step)")
    logger.info("FP8 KV cache (%s): scales %s", cc.cache_dtype, how)
    return cc.calculate_kv_scales
