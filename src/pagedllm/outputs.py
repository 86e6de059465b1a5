"""RequestOutput and CompletionOutput: what generation returns, with vLLM's fields."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank in the vocabulary (1 = most likely)
    and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob (the sampled token is always present).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (time.time()) of one request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # enable_return_routed_experts: a numpy int16 array [num_tokens, num_moe_layers, top_k] of the experts
    # each MoE layer chose for every token the model computed (the prompt's, then the output's but the
    # last, which no forward has seen); set once the sample finishes.
    routed_experts: Any | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)


def join_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request, in order, as one (``first`` updated and returned): each
    completion's text, token ids and logprobs appended, everything else as ``then`` says."""
    by_index = {o.index: o for o in first.outputs}
    for o in then.outputs:
        mine = by_index.get(o.index)
        if mine is None:
            first.outputs.append(o)
            by_index[o.index] = o
            continue
        mine.text += o.text
        mine.token_ids = list(mine.token_ids) + list(o.token_ids)
        if o.logprobs is not None:
            mine.logprobs = (mine.logprobs or []) + o.logprobs
        mine.cumulative_logprob, mine.finish_reason, mine.stop_reason = (o.cumulative_logprob, o.finish_reason,
                                                                          o.stop_reason)
        if o.routed_experts is not None:
            mine.routed_experts = o.routed_experts
    first.finished, first.metrics, first.num_cached_tokens = then.finished, then.metrics, then.num_cached_tokens
    if then.kv_transfer_params is not None:
        first.kv_transfer_params = then.kv_transfer_params
    return first


# ---- pooling models (vLLM's classes and fields) ---------------------------------------------------
@dataclass
class PoolingOutput:
    """``data``: the pooled result as a float32 torch tensor ([dim], or [tokens, dim] for ALL)."""

    data: Any


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        data = base.outputs.data
        if data.dim() != 1:
            raise ValueError("embed outputs one vector per prompt; this pooler returned one per token")
        return cls(base.request_id, EmbeddingOutput(data.tolist()), base.prompt_token_ids, base.finished,
                   base.prompt, base.num_cached_tokens, base.metrics)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(base.request_id, ClassificationOutput(base.outputs.data.tolist()), base.prompt_token_ids,
                   base.finished, base.prompt, base.num_cached_tokens, base.metrics)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ScoringRequestOutput":
        data = base.outputs.data
        if data.numel() != 1:
            raise ValueError(f"score needs a model with one output label; this one has {data.numel()}")
        return cls(base.request_id, ScoringOutput(float(data.reshape(-1)[0])), base.prompt_token_ids,
                   base.finished, base.prompt, base.num_cached_tokens, base.metrics)
