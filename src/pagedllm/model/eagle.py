"""The EAGLE-1 head (the layout of the published Llama checkpoints, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B).

Checkpoint tensors: ``fc.weight`` [hidden, 2 * hidden] (and ``fc.bias`` in some), one Llama decoder
layer ``layers.0.*`` whose ``input_layernorm`` the published heads leave out (EAGLE's first layer
has none: its input is the fc of two already-normed vectors) and some carry, and copies of the
target's ``embed_tokens`` / ``lm_head`` that are skipped: the head reads the target's own (shared,
never copied). A ``model.`` prefix on the names (vLLM-converted heads) is accepted.

One step at position p: ``x = fc(cat(embed(token[p + 1]), feature[p]))``, the decoder layer, and
the sum of its output and residual (no final norm) is both the next feature and, through the
target's LM head, the guess of token[p + 2]. ``feature`` is the target's hidden state after its
final norm, as EAGLE trains it (its ``base_model.model(...)[0]``) and as vLLM feeds EAGLE-1 heads.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.model.layers import Linear, load_tensor
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM

_SKIPPED = ("embed_tokens.weight", "lm_head.weight")


def load_head_tensors(head: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str,
                      expected: str) -> set[str]:
    """Load (name, tensor) pairs already named as ``head``'s parameters, through the Llama
    loader's stacked names (q/k/v, gate/up); returns the names whose every shard was loaded.
    An EAGLE head's one decoder layer is a Llama layer, whatever the checkpoint around it."""
    params = dict(head.named_parameters())
    shards_seen: dict[str, set] = {}
    for name, tensor in weights:
        name, shard_id = LlamaForCausalLM.stacked_name(head, name)
        if name not in params:
            raise ValueError(f"{what} tensor {name!r} has no matching parameter (expected {expected})")
        load_tensor(params[name], tensor, shard_id, f"{what} tensor {name!r}")
        shards_seen.setdefault(name, set()).add(shard_id)
    return {name for name, seen in shards_seen.items()
            if None in seen or LlamaForCausalLM.shards_needed(head, name) <= seen}


class EagleLlamaHead(nn.Module):
    """Built before its weights load; ``share_target`` then hands it the target's embedding and
    LM head (kept out of its parameters, so loading, dummy init and sizes see the head alone)."""

    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config, max_model_len: int | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=True, quantizable=False)
        self.fc.bias.optional = True  # dropped after loading when the checkpoint has none
        rotary = LlamaForCausalLM.make_rotary(config, max_model_len)
        self.layers = nn.ModuleList([DecoderLayer(config, 0, rotary, *LlamaForCausalLM.attention_biases(config),
                                                  qk_norm=False)])
        self.layers[0].input_layernorm.weight.optional = True  # absent: an identity (see the module docstring)
        self._shared: tuple[nn.Module, nn.Module] | None = None  # the target's (embed_tokens, lm_head)

    def share_target(self, target: nn.Module) -> None:
        self._shared = (target.model.embed_tokens, target.lm_head)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[T] next tokens and [T, hidden] features of their positions -> [T, hidden] next features."""
        embed = self._shared[0](input_ids)
        x = self.fc(torch.cat([embed, features.to(embed.dtype)], dim=-1))
        out, residual = self.layers[0](positions, x, None, attn_metadata)
        return out + residual

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self._shared[1](features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the published layout; returns our parameter names whose every shard was loaded."""
        renamed = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        loaded = load_head_tensors(
            self, ((name, tensor) for name, tensor in renamed if name not in _SKIPPED
                   and "rotary_emb.inv_freq" not in name),
            "EAGLE head", "fc.* and layers.0.* of one Llama decoder layer")
        if "fc.bias" not in loaded:
            self.fc.bias = None
        if "layers.0.input_layernorm.weight" not in loaded:
            self.layers[0].input_layernorm = nn.Identity()
        return loaded
