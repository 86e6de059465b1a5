"""Building blocks of decoder models: norms, rotary embedding, activations, linears.

Every parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` so that
loading a checkpoint is a loop over its tensors. There is one device (``tp_size == 1``)
for now; the linears are named for how they will shard under tensor parallelism
(fused q/k/v and gate/up split their output rows, ``o_proj``/``down_proj`` their input
columns), so adding it means slicing inside the weight loaders and one all-reduce.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops import triton_ops_for


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded_weight)  # copy_ also casts to the model's dtype and device


def _parameter(*shape: int, weight_loader=default_weight_loader) -> nn.Parameter:
    # Allocated in the default dtype/device, which the loader sets, so nothing is built twice.
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    return param


class RMSNorm(nn.Module):
    """RMSNorm as HF Llama computes it; with ``residual`` it first adds it (fused pre-norm).
    On CUDA one Triton kernel does either (pagedllm.ops); the torch code is the reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _parameter(hidden_size)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = triton_ops_for(x)
        if ops is not None and (residual is None or residual.dtype == x.dtype):
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the model dtype, like HF's `residual + hidden_states`
        return self._norm(x), x


def _rope_params(config) -> tuple[str, float, dict]:
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
    """Neox-style (rotate_half) rotary embedding from a cos/sin table indexed by position."""

    SUPPORTED_TYPES = ("default", "linear", "llama3", "dynamic")

    def __init__(self, head_dim: int, max_position: int, config):
        super().__init__()
        rope_type, theta, params = _rope_params(config)
        if rope_type not in self.SUPPORTED_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(self.SUPPORTED_TYPES)}")
        factor = float(params.get("factor", 1.0))
        if rope_type == "dynamic":
            # Dynamic NTK fixed at the longest context (max_position * factor, as vLLM does):
            # the paged cache keeps K already rotated, so the base cannot follow the length.
            theta *= (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
        if rope_type in ("linear", "dynamic"):
            max_position = int(max_position * factor)
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / factor
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, factor, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Kept in float32 whatever the model dtype; cast per use, like HF does.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    @staticmethod
    def fused_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
        """The Triton kernels take q and k as [T, H, D] views of one dtype."""
        return q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops = triton_ops_for(q)
        if ops is not None and self.fused_ok(q, k):  # [T, H, D], one kernel for q and k
            return ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


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


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` over the two halves of a fused gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = triton_ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class Linear(nn.Module):
    """``y = x W^T + b`` with loaders; replicated now (``o_proj``/``down_proj`` go row-parallel)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = _parameter(output_size, input_size, weight_loader=self.weight_loader)
        self.bias = _parameter(output_size, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked on the output dim (gate/up: shard ids 0, 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def _shard_range(self, shard_id) -> tuple[int, int]:
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            return default_weight_loader(param, loaded_weight)
        offset, size = self._shard_range(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection (shard ids "q", "k", "v"); column-parallel by heads later."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads

    def _shard_range(self, shard_id) -> tuple[int, int]:
        return super()._shard_range({"q": 0, "k": 1, "v": 2}[shard_id])


class VocabEmbedding(nn.Module):
    """Token embedding table; vocab-parallel (rows split by rank) later."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = _parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocab logits; ``tie_to`` shares an embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None):
        nn.Module.__init__(self)  # a tied head must not allocate a second table
        self.weight = tie_to.weight if tie_to is not None else _parameter(vocab_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)
