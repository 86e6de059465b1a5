"""Gemma 2 and Gemma 3 (text): the Llama-family decoder with four norms per layer, Gemma's
``(1 + w)`` RMSNorm, scaled embeddings, GELU-tanh MLP, soft-capped logits, and alternating
sliding-window (local) / global layers, each layer type with its own rotary base in Gemma 3."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers import GemmaRMSNorm, RotaryEmbedding, rope_params
from pagedllm.model.llama import MLP, Attention, LlamaForCausalLM
from pagedllm.sample.sharded import VocabShard


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norm around both attention and MLP; the residual stream is carried apart
    (as in the Llama layer) so each pre-norm adds it in."""

    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, qk_norm: bool,
                 attn_soft_cap: float | None):
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(config, layer_idx, rotary_emb, bias, bias, qk_norm,
                                   scale=config.query_pre_attn_scalar ** -0.5, logits_soft_cap=attn_soft_cap,
                                   norm_cls=GemmaRMSNorm)
        self.mlp = MLP(config, bias=False, hidden_act=getattr(config, "hidden_activation", None)
                       or getattr(config, "hidden_act", None))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, positions, hidden_states, residual, attn_metadata):
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, attn_metadata))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
    norm_cls = GemmaRMSNorm

    def __init__(self, config, max_model_len: int | None = None):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (Gemma as an encoder) is not supported")
        super().__init__(config, max_model_len)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def attn_soft_cap(self, config) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)

    def make_layer(self, config, layer_idx: int, rotary: nn.Module) -> nn.Module:
        if isinstance(rotary, nn.ModuleDict):  # one table per layer type
            rotary = rotary[config.layer_types[layer_idx]]
        return GemmaDecoderLayer(config, layer_idx, rotary, self.qk_norm, self.attn_soft_cap(config))

    @staticmethod
    def embed_scale(config) -> float | None:
        # sqrt(hidden_size) rounded to the model dtype, as transformers multiplies it
        # (in bfloat16 sqrt(3072) = 55.43 becomes 55.5); the loader sets the default dtype.
        return torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype()).item()

    def compute_logits(self, hidden_states: torch.Tensor, shard: bool = False):
        logits = super().compute_logits(hidden_states, shard)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        soft_cap = lambda x: torch.tanh(x / cap) * cap  # noqa: E731 - elementwise: a vocabulary slice takes it too
        return logits.map(soft_cap) if isinstance(logits, VocabShard) else soft_cap(logits)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """q/k norms; no attention soft cap (transformers' Gemma 3 ignores ``attn_logit_softcapping``);
    local layers rotate with their own base (``rope_local_base_freq``), global ones with the
    main rope parameters and their scaling."""

    qk_norm = True

    def attn_soft_cap(self, config) -> float | None:
        return None

    @staticmethod
    def make_rotary(config, max_model_len: int | None) -> nn.Module:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = getattr(config, "rope_parameters", None) or {}
        if "full_attention" in params:  # transformers 5.x: rope parameters per layer type
            ropes = {kind: rope_params(_RopeView(params[kind])) for kind in ("full_attention", "sliding_attention")}
        else:  # transformers 4.x: the main parameters are the global layers'; local layers default rope
            ropes = {"full_attention": rope_params(config),
                     "sliding_attention": ("default", float(getattr(config, "rope_local_base_freq", 10000.0)), {})}
        return nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, config.max_position_embeddings, config, rope=rope,
                                  max_model_len=max_model_len) for kind, rope in ropes.items()})


class _RopeView:
    """One layer type's rope parameters seen as a config of their own."""

    def __init__(self, params: dict):
        self.rope_parameters = params


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma 3 vision-language checkpoint served as its text model (the loader hands us its
    ``text_config``); the vision tower and projector weights are skipped."""

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        for prefix in ("model.language_model.", "language_model.model."):  # transformers 5.x, 4.x
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return "lm_head.weight"
        return None  # vision_tower.*, multi_modal_projector.*
