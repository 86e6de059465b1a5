"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with sparse MoE blocks (softmax top-k routing,
renormalised when ``norm_topk_prob``) on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
pick, dense MLPs elsewhere; Qwen2-MoE adds a shared expert behind a sigmoid gate."""
from __future__ import annotations

from torch import nn

from pagedllm.model.moe import MoeForCausalLM, SparseMoeBlock


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def is_moe_layer(self, config, layer_idx: int) -> bool:
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)

    def make_moe_block(self, config) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              round_weights=True, shared_intermediate_size=self.shared_intermediate_size(config))

    @staticmethod
    def shared_intermediate_size(config) -> int | None:
        return getattr(config, "shared_expert_intermediate_size", None)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k norms, no shared expert."""

    qk_norm = True

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def shared_intermediate_size(config) -> int | None:
        return None
