"""Decoder bodies as pooling models (vLLM's ``convert``): embeddings from the final-normed
hidden states (Qwen3-Embedding, gte-Qwen2, e5-mistral style), sequence classification with a
``score`` head on the last token (``*ForSequenceClassification``), and Qwen3-Reranker's
conversion of its yes/no logits into one score (``classifier_from_token``)."""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.model.layers import default_weight_loader


@functools.cache
def as_pooling_model(cls: type[nn.Module], kind: str, bare: bool = False) -> type[nn.Module]:
    """``cls`` (a *ForCausalLM) serving ``kind`` ("embed" | "classify" | "reward") instead of
    generating; ``bare``: the checkpoint is the body alone (``Qwen3Model`` as
    sentence-transformers saves it: no ``model.`` prefix, no head)."""

    class PoolingModel(cls):
        pooling_kind = kind

        def __init__(self, config, **kwargs):
            super().__init__(config, **kwargs)
            self.lm_head = None  # no logits: the pooler reads the hidden states
            self.score = None
            self.from_tokens = _classifier_tokens(config) if kind != "embed" else None
            if kind != "embed":
                num_labels = 1 if self.from_tokens else config.num_labels
                self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
                self.score.weight.weight_loader = default_weight_loader

        def compute_logits(self, hidden_states):
            raise ValueError(f"{cls.__name__} was loaded as a pooling model ({kind}): it does not generate")

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            head_rows: dict[str, torch.Tensor] = {}

            def body():
                for name, tensor in weights:
                    if bare and not name.startswith(("model.", "score.", "lm_head.")):
                        name = "model." + name
                    if name in ("lm_head.weight", "model.embed_tokens.weight") and self.from_tokens:
                        head_rows[name] = tensor[self.from_tokens]
                    if name.startswith("lm_head."):
                        continue
                    if name == "score.weight" and self.score is not None:
                        default_weight_loader(self.score.weight, tensor)
                        head_rows["score"] = tensor
                        continue
                    yield name, tensor

            loaded = super().load_weights(body())
            if self.score is not None:
                if self.from_tokens:  # sigmoid(w_yes - w_no) = softmax over (no, yes) at yes
                    rows = head_rows.get("lm_head.weight", head_rows.get("model.embed_tokens.weight"))
                    if rows is None:
                        raise ValueError("classifier_from_token needs the checkpoint's lm_head (or tied embedding)")
                    default_weight_loader(self.score.weight, (rows[1] - rows[0]).unsqueeze(0).float())
                elif "score" not in head_rows:
                    raise ValueError(f"checkpoint lacks the classification head 'score.weight' of {kind} model "
                                     f"{cls.__name__}")
                loaded.add("score.weight")
            return loaded

    PoolingModel.__name__ = PoolingModel.__qualname__ = f"{cls.__name__.removesuffix('ForCausalLM')}For{kind.title()}"
    return PoolingModel


def _classifier_tokens(config) -> list[int] | None:
    """Qwen3-Reranker: ``classifier_from_token`` (["no", "yes"], set through hf_overrides) as token
    ids, read with the model's tokenizer at load; the score is the difference of their logits."""
    tokens = getattr(config, "classifier_from_token", None)
    if not tokens:
        return None
    if len(tokens) != 2:
        raise ValueError(f"classifier_from_token must name two tokens (false, true), got {tokens!r}")
    ids = getattr(config, "_classifier_token_ids", None)
    if ids is None:
        raise ValueError("classifier_from_token needs the tokenizer's ids (set by the engine at load)")
    return list(ids)
