"""Rotary position embeddings: the cos/sin table of each rope type (default, linear, llama3,
dynamic, longrope), partial rotary, and its application to q and k."""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.ops import triton_ops_for


def rope_params(config) -> tuple[str, float, dict]:
    """(rope_type, rope_theta, scaling dict) from a transformers 5.x or 4.x config."""
    params = getattr(config, "rope_parameters", None)
    if params:  # transformers 5.x: theta lives inside
        params = dict(params)
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    else:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return rope_type, float(theta), params


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) rotary embedding from a cos/sin table indexed by position.

    ``rope`` gives (rope_type, theta, params) explicitly (Gemma 3's local and global layers
    each have their own); by default they are read from ``config``. ``max_model_len`` is the
    engine's context limit: LongRoPE picks its long factors when it exceeds the pretraining
    length, its short ones otherwise (as vLLM does: one table for every position, so cached
    keys stay valid as a sequence grows)."""

    SUPPORTED_TYPES = ("default", "linear", "llama3", "dynamic", "longrope")

    def __init__(self, head_dim: int, max_position: int, config, rope: tuple[str, float, dict] | None = None,
                 max_model_len: int | None = None):
        super().__init__()
        rope_type, theta, params = rope or rope_params(config)
        if rope_type not in self.SUPPORTED_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(self.SUPPORTED_TYPES)}")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        self.rotary_dim = dim = int(head_dim * float(partial))
        self.head_dim = head_dim
        factor = float(params.get("factor", 1.0) or 1.0)
        if rope_type == "dynamic":
            # Dynamic NTK fixed at the longest context (max_position * factor, as vLLM does):
            # the paged cache keeps K already rotated, so the base cannot follow the length.
            theta *= (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        if rope_type in ("linear", "dynamic"):
            max_position = int(max_position * factor)
        attention_scaling = 1.0
        if rope_type == "longrope":
            inv_freq, attention_scaling = _longrope_inv_freq(theta, dim, params, config, max_model_len)
        else:
            inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        if rope_type == "linear":
            inv_freq = inv_freq / factor
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, factor, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Kept in float32 whatever the model dtype; cast per use, like HF does.
        table = torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def fused_ok(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """The Triton kernels take q and k as [T, H, D] views of one dtype, rotated over all of D."""
        return q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype and self.rotary_dim == self.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = triton_ops_for(q)
        if ops is not None and self.fused_ok(q, k):  # [T, H, D], one kernel for q and k
            return ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        if self.rotary_dim != self.head_dim:  # partial rotary: the tail of each head passes through
            rd = self.rotary_dim
            return (torch.cat([_rotate(q[..., :rd], cos, sin), q[..., rd:]], dim=-1),
                    torch.cat([_rotate(k[..., :rd], cos, sin), k[..., rd:]], dim=-1))
        qk = _adjacent_heads(q, k)
        if qk is not None:  # k's heads follow q's in each row (one qkv projection): one pass for both
            return _rotate(qk, cos, sin).split([q.shape[1], k.shape[1]], dim=1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, KVH, D] as one [T, H + KVH, D] view where k's heads follow q's in
    each row with the same row stride (both slices of one projection's output), else None."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    d = q.shape[2]
    if q.stride()[1:] != (d, 1) or k.stride() != (q.stride(0), d, 1) or q.shape[0] == 0 \
            or k.data_ptr() != q.data_ptr() + q.shape[1] * d * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short kept, a smooth ramp between."""
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(theta: float, dim: int, params: dict, config,
                       max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: per-frequency divisors (short or long set) and the attention factor that
    scales cos and sin, ``sqrt(1 + ln(factor) / ln(original length))``, as transformers computes it."""
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings in the config")
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    use_long = (max_model_len or config.max_position_embeddings) > original
    which = "long_factor" if use_long else "short_factor"
    ext = torch.tensor(params[which], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope {which} has {ext.numel()} entries, expected rotary_dim / 2 = {dim // 2}")
    inv_freq = 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)
