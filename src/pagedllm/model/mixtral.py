"""Mixtral: the Mistral decoder with a sparse MoE block on every layer (softmax top-k routing,
always renormalised; routing weights kept in float32). Its checkpoints name the block
``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""
from __future__ import annotations

from torch import nn

from pagedllm.model.moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    expert_projections = {"w1": 0, "w3": 1, "w2": None}

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts

    def is_moe_layer(self, config, layer_idx: int) -> bool:
        return True

    def make_moe_block(self, config) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, round_weights=False)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
