"""OLMo and OLMo 2: the Llama-family decoder with OLMo's weightless LayerNorm and q/k/v clipping
(OLMo), or with norms after attention and MLP instead of before and q/k norms over the whole
projection (OLMo 2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers import Fp32RMSNorm, ShardedRMSNorm
from pagedllm.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM


class OlmoLayerNorm(nn.Module):
    """LayerNorm without weight or bias (eps 1e-5, in float32), with the fused residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.shape = (hidden_size,)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.shape, None, None, eps=1e-5).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class OlmoAttention(Attention):
    """``clip_qkv``: q, k and v clamped to [-c, c] right after the projection."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, positions, x, attn_metadata):
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attend(positions, q, k, v, attn_metadata)


class OlmoForCausalLM(LlamaForCausalLM):
    norm_cls = OlmoLayerNorm

    def make_layer(self, config, layer_idx: int, rotary: nn.Module) -> nn.Module:
        return DecoderLayer(config, layer_idx, rotary, *self.attention_biases(config), qk_norm=False,
                            norm_cls=OlmoLayerNorm, attn_cls=OlmoAttention)


class Olmo2Attention(Attention):
    """q and k RMS-normed over the whole projection (all heads), before rotary."""

    def __init__(self, config, layer_idx, rotary_emb, qkv_bias, o_bias, qk_norm):
        super().__init__(config, layer_idx, rotary_emb, qkv_bias, o_bias, qk_norm=False)
        qkv, eps = self.qkv_proj, config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(self.q_size, qkv.output_sizes[0], eps, qkv._shard_start(0))
        self.k_norm = ShardedRMSNorm(self.kv_size, qkv.output_sizes[1], eps, qkv._shard_start(1))

    def forward(self, positions, x, attn_metadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.attend(positions, self.q_norm(q), self.k_norm(k), v, attn_metadata)


class Olmo2DecoderLayer(nn.Module):
    """``x + norm(attn(x))``, then ``x + norm(mlp(x))``: no norm before either. The residual
    stream is carried apart as in the Llama layer (the sum is the layer's input)."""

    def __init__(self, config, layer_idx: int, rotary_emb: nn.Module, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx, rotary_emb, qkv_bias, o_bias, qk_norm=True)
        self.mlp = MLP(config, bias=False)
        self.post_attention_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, attn_metadata):
        x = hidden_states if residual is None else hidden_states + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, attn_metadata))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    norm_cls = Fp32RMSNorm

    def make_layer(self, config, layer_idx: int, rotary: nn.Module) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_idx, rotary, *self.attention_biases(config))
