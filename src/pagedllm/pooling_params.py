"""PoolingParams: what a pooling request asks for (vLLM's names), beside SamplingParams."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# What a pooling request computes, and the LLM method / endpoint that asks for it.
POOLING_TASKS = ("embed", "classify", "score", "reward", "encode")


@dataclass
class PoolingParams:
    """``task``: "embed" (a normalised vector, ``dimensions`` keeps its first entries for
    Matryoshka models), "classify" (class probabilities), "score" (a cross-encoder's relevance),
    "reward" (per-token scores), "encode" (the pooled hidden states as they are).
    ``use_activation`` (None: the model's default) switches the normalisation / softmax /
    sigmoid off or on; ``normalize`` and ``softmax`` are vLLM's older names for it."""

    task: str | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Filled by the engine, not the user: BERT-style token types of the prompt (pairs for cross-encoders).
    extra_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams task must be one of {list(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or positive, got {self.truncate_prompt_tokens}")
        legacy = {v for v in (self.normalize, self.softmax) if v is not None}
        if self.use_activation is None and legacy:
            if len(legacy) > 1:
                raise ValueError("normalize and softmax disagree; use use_activation")
            self.use_activation = legacy.pop()

    def clone(self) -> "PoolingParams":
        return copy.deepcopy(self)

    @property
    def activation(self) -> bool:
        return True if self.use_activation is None else self.use_activation

    # Read by the engine paths that only know SamplingParams (a pooling request emits no token).
    n = 1
    max_tokens = 0
    structured_outputs = None
