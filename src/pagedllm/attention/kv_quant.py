"""FP8 KV cache: the cache dtypes, and the per-layer K/V scales that quantize on write and
dequantize on read (``cache = saturate(x / scale)``, ``x ~ cache * scale``).

A layer's scales are one float32 tensor ``kv_scale = [k_scale, v_scale]`` on the device
(the attention module's buffer): kernels read them through a pointer, so CUDA graphs captured
before ``calculate_kv_scales`` fills them see the new values.
"""
from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import tensor_model_parallel_max

# CacheConfig.cache_dtype -> the cache's torch dtype ("auto": the model dtype, not listed).
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Largest finite value of each: writes saturate there (a plain cast would give NaN for e4m3fn
# and inf for e5m2).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# calculate_kv_scales: scale = amax / constant, vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT. The first
# batch's amax then sits at 200 (K) / 100 (V) of e4m3's 448: later tokens up to 2.2x (K) / 4.5x (V)
# larger still fit before they saturate.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv cache dtype must be 'auto' or one of {list(FP8_KV_DTYPES)}, got {cache_dtype!r}")
    return FP8_KV_DTYPES[cache_dtype]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, saturated to ``dtype``'s finite range, rounded to nearest even."""
    limit = FP8_MAX[dtype]
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, then ``dtype`` (fp8 values are exact in any wider float)."""
    return (x.float() * scale).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What reading ``x`` back from an fp8 cache gives, in ``x``'s dtype."""
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (same memory): torch's CPU copy/gather kernels lack fp8."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


@torch.no_grad()
def calculate_kv_scales_(kv_scale: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``kv_scale`` in place from this batch's K/V (vLLM's ``calc_kv_scales``): amax over
    the constants above; a tensor of zeros keeps scale 1.0. Device ops only: no host sync. Every
    tensor-parallel rank calls this in the same step (its all-reduce pairs with theirs)."""
    if key.numel() == 0:  # no tokens: amax 0 (scale 1.0 below), still joining the other ranks' all-reduce
        amax = torch.zeros(2, device=kv_scale.device)
    else:
        amax = torch.stack([key.detach().abs().amax().float(), value.detach().abs().amax().float()])
    # Tensor parallel: every rank holds some KV heads; the max over all of them gives each rank
    # the scales one rank would compute (so TP=2 reads the cache as TP=1 does).
    amax = tensor_model_parallel_max(amax)
    scales = amax / torch.tensor([K_SCALE_CONSTANT, V_SCALE_CONSTANT], device=amax.device)
    kv_scale.copy_(torch.where(scales > 0, scales, torch.ones_like(scales)))
