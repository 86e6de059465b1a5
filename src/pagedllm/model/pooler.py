"""Pooling: a request's hidden states (over one or more prefill chunks) → its output vector.

A pooling model (``model.pooler``) owns one ``Pooler``: it picks the tokens (``pooling_type``),
then a task's head turns them into what the request asked for:

- ``embed``: the pooled state, truncated to ``dimensions`` (Matryoshka), L2-normalised;
- ``classify`` / ``score``: the model's classifier (``model.classify``), softmax over the labels
  (sigmoid for one label);
- ``reward``: the classifier at every token (ALL / STEP pooling), no activation by default;
- ``encode``: the pooled hidden states as they are.

Prompts longer than one chunk are pooled as they arrive: MEAN keeps a float32 running sum,
ALL / STEP the chunks' rows, CLS the first row, LAST needs only the final chunk. The running
state of a request is dropped when it finishes, is aborted or preempted (``forget``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import PoolerConfig

# What each kind of pooling model serves, and its defaults.
TASKS = {"embed": ("embed", "encode"), "classify": ("classify", "score", "reward", "encode"),
         "reward": ("reward", "encode")}
DEFAULT_POOLING = {"embed": "LAST", "classify": "LAST", "reward": "ALL"}


@dataclass
class _Partial:
    """A request's pooling state between chunks."""

    total: torch.Tensor | None = None  # MEAN: float32 sum of the rows so far
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL / STEP: the rows so far
    first: torch.Tensor | None = None  # CLS: the first position's row


class Pooler(nn.Module):
    """``kind``: "embed", "classify" or "reward" (the model's head); ``config``: the resolved
    pooler config (its pooling_type set)."""

    def __init__(self, kind: str, config: PoolerConfig) -> None:
        super().__init__()
        self.kind = kind
        self.config = config
        self.pooling_type = config.pooling_type or DEFAULT_POOLING[kind]
        self.tasks = TASKS[kind]
        self._partial: dict[str, _Partial] = {}

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt token's state counts (so a prefix-cache hit would skip some)."""
        return self.pooling_type != "LAST"

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self._partial.pop(r, None)

    def num_partial(self) -> int:
        return len(self._partial)

    def add_chunk(self, req_id: str, hidden: torch.Tensor, token_ids: list[int], start: int, last: bool
                  ) -> torch.Tensor | None:
        """Take one chunk's rows (positions ``start``.., their ``token_ids``); on the prompt's
        ``last`` chunk return the pooled rows ([H], or [T, H] for ALL / STEP)."""
        kind = self.pooling_type
        # Rows kept past this step are copied: they must not alias the step's output, which a step
        # that replays CUDA graphs returns in a buffer the next replay overwrites.
        if start == 0:  # (re)started: a preempted request is recomputed from its first token
            self._partial.pop(req_id, None)
        if kind == "LAST":
            return hidden[-1] if last else None
        part = self._partial.setdefault(req_id, _Partial())
        if kind == "CLS":
            if start == 0:
                part.first = hidden[0] if last else hidden[0].clone()
        elif kind == "MEAN":
            chunk_sum = hidden.float().sum(0)
            part.total = chunk_sum if part.total is None else part.total + chunk_sum
            part.count += hidden.shape[0]
        else:  # ALL, STEP
            if kind == "STEP" and self.config.step_tag_id is not None:
                keep = torch.tensor([t == self.config.step_tag_id for t in token_ids], device=hidden.device)
                hidden = hidden[keep]  # a copy already
            elif not last:
                hidden = hidden.clone()
            part.rows.append(hidden)
        if not last:
            return None
        del self._partial[req_id]
        if kind == "CLS":
            return part.first
        if kind == "MEAN":
            return (part.total / part.count).to(hidden.dtype)
        return torch.cat(part.rows) if part.rows else hidden[:0]

    def head(self, model: nn.Module, pooled: torch.Tensor, task: str, use_activation: bool | None,
             dimensions: int | None) -> torch.Tensor:
        """The task's output (float32) from a request's pooled rows."""
        if task == "encode":
            return pooled.float()
        if task == "embed":
            out = pooled.float()
            if dimensions is not None:
                out = out[..., :dimensions]
            if self._activation(use_activation, default=True):
                out = F.normalize(out, p=2, dim=-1)
            return out
        logits = model.classify(pooled).float()
        if not self._activation(use_activation, default=task != "reward"):
            return logits
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

    def _activation(self, requested: bool | None, default: bool) -> bool:
        if requested is not None:
            return requested
        if self.config.use_activation is not None:
            return self.config.use_activation
        return default
