"""The step contracts between the scheduler and the workers: what to run, what came back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.messages import PositionLogprobs
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the worker needs to start (or restart after preemption) a request."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # the request's LoRA adapter (pagedllm.lora.LoRARequest), if any
    pooling_params: Any = None  # a pooling request's PoolingParams


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallelism: the output tokens among this step's inputs (positions
    # max(num_computed_tokens, num_prompt_tokens) onward). Only the last stage samples, so the
    # other stages learn the tokens here; empty when one worker samples and keeps its own.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """Exactly what the worker must run this step; order = order in the flat batch."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker should forget (finished or aborted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted this step: the worker drops their state (they come back as new requests).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the masks of the constrained requests that sample this step, a
    # structured_output.manager.GrammarBitmask (``req_ids`` and an int32 ``bitmask`` with one
    # row each); None when no sampling request is constrained.
    grammar: Any = None
    # Async scheduling: a constrained request's token of the step in flight is not known yet, so
    # this step's masks come later (``Executor.sample_tokens``): the worker launches the forward
    # and stops before sampling; the engine lands the step in flight, then sends the masks.
    defer_grammar: bool = False
    # Speculative decoding: the proposed tokens each request's step verifies (it runs its last
    # known token and these, 1 + k positions, and samples at every one of them).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """What came back from one step, per request in the batch order."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a request still in the middle of its prefill
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Speculative decoding with a draft model: the draft's guess of each request's next tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # enable_return_routed_experts: per request, (first position, expert ids [n, moe_layers, top_k])
    # of the positions this step computed (from 0 when the request (re)started: prefix hits too).
    routed_experts: dict[str, tuple[int, Any]] = field(default_factory=dict)
    # Pooling models: the requests whose prompt ended this step, and their results (float32 numpy).
    pooler_output: dict[str, Any] = field(default_factory=dict)
