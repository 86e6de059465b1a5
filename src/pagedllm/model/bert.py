"""Encoders: BERT and XLM-RoBERTa (BGE, e5, all-MiniLM, bge-reranker style), for pooling.

Absolute position and token-type embeddings, post-LayerNorm blocks, GELU, and bidirectional
attention through the backends' ``causal=False`` path (every prompt is whole in its step, so
nothing is kept in the paged cache). ``BertModel`` / ``XLMRobertaModel`` embed (the pooling
of sentence-transformers' config, else CLS); the ``*ForSequenceClassification`` heads
classify and score pairs (cross-encoders): BERT's pooler (dense + tanh on [CLS]) then its
classifier, RoBERTa's head (dense + tanh + out_proj on <s>).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.model.layers import MergedLinear, QKVLinear, RowParallelLinear, load_tensor

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


class _SelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv = QKVLinear(config.hidden_size, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.num_kv_heads = self.qkv.num_heads
        self.size = self.num_heads * self.head_dim
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.kv_cache: torch.Tensor | None = None  # set by the model runner (written on the GPU path only)
        self.attn_backend: AttentionBackend | None = None

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.size] * 3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        o = self.attn_backend.forward(q.reshape(shape), k.reshape(shape), v.reshape(shape), self.kv_cache, md,
                                      self.head_dim**-0.5, causal=False)
        return self.norm(self.dense(o.flatten(1, 2)) + x)


class _Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = _SelfAttention(config)
        self.intermediate = MergedLinear(config.hidden_size, [config.intermediate_size], bias=True)
        self.output = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for encoders; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, md)
        return self.norm(self.output(self.act(self.intermediate(x))) + x)


class BertModel(nn.Module):
    """The encoder; ``forward`` returns every token's last hidden state."""

    # checkpoint name part -> (ours, shard id)
    renames = {
        ".attention.self.query.": (".attention.qkv.", "q"), ".attention.self.key.": (".attention.qkv.", "k"),
        ".attention.self.value.": (".attention.qkv.", "v"), ".attention.output.dense.": (".attention.dense.", None),
        ".attention.output.LayerNorm.": (".attention.norm.", None), ".intermediate.dense.": (".intermediate.", 0),
        ".output.dense.": (".output.", None), ".output.LayerNorm.": (".norm.", None),
        "encoder.layer.": ("layers.", None), "embeddings.LayerNorm.": ("embeddings.norm.", None),
    }
    pooling_kind = "embed"
    default_pooling = "CLS"
    prefix = ""  # the checkpoint's prefix of the encoder's tensors in a *For... model

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embeddings.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), config.hidden_size)
        self.embeddings.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.position_offset = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors=None, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        e = self.embeddings
        h = e.word_embeddings(input_ids) + e.position_embeddings(positions + self.position_offset)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        h = e.norm(h + e.token_type_embeddings(types))
        for layer in self.layers:
            h = layer(h, attn_metadata)
        return h

    # ---- loading ------------------------------------------------------------------------------
    def ours(self, name: str) -> tuple[str | None, object]:
        """(our parameter name, shard id) of a checkpoint tensor, or (None, None) to skip it."""
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix):]
        if name.endswith("position_ids") or name.startswith("pooler.") and not hasattr(self, "pooler_dense"):
            return None, None
        shard = None
        for part, (mine, sid) in self.renames.items():
            if part in name:
                name = name.replace(part, mine)
                shard = sid if sid is not None else shard
        if name.startswith("pooler.dense."):
            name = name.replace("pooler.dense.", "pooler_dense.")
        return name, shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        seen: dict[str, set] = {}
        for ckpt_name, tensor in weights:
            name, shard = self.ours(ckpt_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}")
            load_tensor(params[name], tensor, shard, repr(ckpt_name))
            seen.setdefault(name, set()).add(shard)
        return {n for n, s in seen.items() if None in s or ".qkv." not in n or s >= {"q", "k", "v"}}


class XLMRobertaModel(BertModel):
    """RoBERTa's positions start after the padding index (``padding_idx + 1``; a prompt holding
    the pad token itself is the one case counted differently from HF's cumulative count)."""

    default_pooling = "CLS"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.position_offset = (config.pad_token_id if config.pad_token_id is not None else 1) + 1


class BertForSequenceClassification(BertModel):
    pooling_kind = "classify"
    prefix = "bert."

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pooler_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def ours(self, name: str):
        if name.startswith("classifier."):
            return name, None
        return super().ours(name)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    pooling_kind = "classify"
    prefix = "roberta."

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def ours(self, name: str):
        if name.startswith("classifier."):
            return name, None
        return super().ours(name)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled)))
