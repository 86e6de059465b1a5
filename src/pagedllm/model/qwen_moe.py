"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with sparse MoE blocks (softmax top-k routing,
renormalised when ``norm_topk_prob``) on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
pick, dense MLPs elsewhere (``MoeForCausalLM`` reads those names); Qwen2-MoE adds a shared expert
behind a sigmoid gate."""
from __future__ import annotations

from torch import nn

from pagedllm.model.moe import MoeForCausalLM, SparseMoeBlock


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def make_moe_block(self, config) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              round_weights=True, shared_intermediate_size=config.shared_expert_intermediate_size)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k norms, no shared expert."""

    qk_norm = True
