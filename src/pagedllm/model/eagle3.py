"""The EAGLE-3 head (the layout of the published Llama checkpoints, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
and of SpecForge's; vLLM's ``Eagle3LlamaForCausalLM`` reads the same).

Checkpoint tensors: ``fc.weight`` [hidden, 3 * target_hidden] (no bias) fuses three of the target's
residual streams (those entering layers ``eagle_aux_hidden_state_layer_ids``, by default 2, L // 2
and L - 3 of L); one decoder layer, ``midlayer.*`` (or ``layers.0.*``), whose q/k/v projections
take 2 * hidden features and which carries a ``hidden_norm`` beside its ``input_layernorm``; the
final ``norm``; ``lm_head.weight`` [draft_vocab_size, hidden]; ``d2t`` [draft_vocab_size] (draft id d
is target id d + d2t[d]) and ``t2d`` [vocab_size] (bool: which target ids the draft vocabulary
holds; read for its shape only); ``embed_tokens.weight`` where the head keeps its own, else the
target's is shared. A ``model.`` prefix on the names is accepted.

One step at position p, with ``h`` either ``fc(aux[p])`` (the target's fused features, for
positions the target computed) or the head's own previous output (its later guesses):
``x = attn(cat(input_layernorm(embed(token[p + 1])), hidden_norm(h)))`` with ``h`` as the residual
(``norm_before_residual``: the normed ``h``), the MLP, and their sum ``pre`` (before the final norm)
is the next step's ``h``; ``lm_head(norm(pre))`` scores the draft vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.model.eagle import load_head_tensors
from pagedllm.model.layers import LMHead, Linear, QKVLinear, RMSNorm, RotaryEmbedding, VocabEmbedding
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM
from pagedllm.sample.draw import greedy


def aux_layer_ids(head_config, target_num_layers: int) -> list[int]:
    """The target layers whose entering residual streams the head fuses: the head config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else vLLM's default."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        ids = (getattr(head_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [2, target_num_layers // 2, target_num_layers - 3]
    return [int(i) for i in ids]


def draft_vocab_size(head_config) -> int:
    return getattr(head_config, "draft_vocab_size", None) or head_config.vocab_size


def target_hidden_size(head_config) -> int:
    return getattr(head_config, "target_hidden_size", None) or head_config.hidden_size


class Eagle3LlamaHead(nn.Module):
    """Built before its weights load; ``share_target`` then hands it the target's embedding when
    the checkpoint has none."""

    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config, max_model_len: int | None = None):
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
        self.vocab_size, self.draft_vocab_size = config.vocab_size, draft_vocab_size(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.fc = Linear(3 * target_hidden_size(config), hidden, bias=False, quantizable=False)
        self.embed_tokens = VocabEmbedding(config.vocab_size, hidden)
        self.embed_tokens.weight.optional = True  # absent: the target's (share_target)
        # The published heads' max_position_embeddings is their training length (2048 for Llama 3.1's):
        # the table reaches the engine's context, where guesses may be worse, never wrong (verification).
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max(config.max_position_embeddings, max_model_len or 0), config,
                                 max_model_len=max_model_len)
        qkv_bias, o_bias = LlamaForCausalLM.attention_biases(config)
        layer = DecoderLayer(config, 0, rotary, qkv_bias, o_bias, qk_norm=False)
        attn = layer.self_attn  # its q/k/v read the normed embedding and normed hidden state, side by side
        attn.qkv_proj = QKVLinear(2 * hidden, attn.head_dim, attn.qkv_proj.total_num_heads,
                                  attn.qkv_proj.total_num_kv_heads, qkv_bias)
        layer.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = LMHead(self.draft_vocab_size, hidden)
        # Dummy weights keep these: the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.register_buffer("t2d", torch.arange(config.vocab_size) < self.draft_vocab_size, persistent=False)

    def share_target(self, target: nn.Module) -> None:
        if self.embed_tokens is not None:
            return
        shared = target.model.embed_tokens
        if shared.weight.shape[-1] != self.config.hidden_size:
            raise ValueError(f"the EAGLE-3 head's checkpoint has no embed_tokens and its hidden_size "
                             f"({self.config.hidden_size}) is not the target's ({shared.weight.shape[-1]}): it "
                             "cannot share the target's embedding")
        self._shared_embed = (shared,)  # a tuple: kept out of our parameters

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self._shared_embed[0] if self.embed_tokens is None else self.embed_tokens)(input_ids)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target_hidden] residual streams of the target -> [T, hidden] features."""
        return self.fc(aux_hidden_states)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[T] next tokens and [T, hidden] features (fused, or the head's previous output) of their
        positions -> [T, hidden] outputs before the final norm (the next step's features)."""
        layer = self.layers[0]
        embeds = layer.input_layernorm(self._embed(input_ids))
        hidden = hidden.to(embeds.dtype)
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = layer.self_attn(positions, torch.cat([embeds, normed], dim=-1), attn_metadata)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab_size] scores of the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab_size] scores over the TARGET vocabulary (-inf outside the draft vocabulary), so
        the draft's distribution is over the ids the verifier scores: a target id outside the draft
        vocabulary has draft probability 0."""
        draft = self.compute_draft_logits(hidden)
        logits = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.to_target(torch.arange(self.draft_vocab_size, device=draft.device))] = draft
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T] target ids of the draft vocabulary's argmax (the argmax of ``compute_logits``)."""
        return self.to_target(greedy(self.compute_draft_logits(hidden)))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the published layout; returns our parameter names whose every shard was loaded."""
        loaded = load_head_tensors(self, self._layer_tensors(weights), "EAGLE-3 head",
                                   "fc.weight, midlayer.* of one decoder layer, norm.weight, lm_head.weight, d2t, "
                                   "t2d and optionally embed_tokens.weight")
        if "embed_tokens.weight" not in loaded:
            self.embed_tokens = None
        return loaded

    def _layer_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's parameter tensors under our names; ``d2t``/``t2d`` load on the way."""
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name in ("d2t", "t2d"):
                self._load_vocab_map(name, tensor)
                continue
            yield name, tensor

    def _load_vocab_map(self, name: str, tensor: torch.Tensor) -> None:
        want = self.draft_vocab_size if name == "d2t" else self.vocab_size
        if tuple(tensor.shape) != (want,):
            key = "draft_vocab_size" if name == "d2t" else "vocab_size"
            raise ValueError(f"EAGLE-3 head tensor {name!r} has shape {tuple(tensor.shape)}, expected ({want},): "
                             f"the head config's {key} is {want}")
        if name == "t2d":
            self.t2d.copy_(tensor.to(torch.bool))
            return
        targets = torch.arange(want) + tensor.to("cpu", torch.int64)
        if targets.min() < 0 or targets.max() >= self.vocab_size:
            raise ValueError(f"EAGLE-3 head tensor 'd2t' maps draft ids to target ids in [{int(targets.min())}, "
                             f"{int(targets.max())}], outside the target vocabulary of {self.vocab_size}")
        self.d2t.copy_(tensor.to(torch.int64))
