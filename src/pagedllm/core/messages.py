"""Plain, serializable messages that cross the engine-core boundary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from pagedllm.sampling_params import SamplingParams

# Logprobs of one position, as plain lists: candidate token ids (the sampled/actual token
# first), their log-probabilities and their ranks in the vocabulary.
PositionLogprobs = tuple[list[int], list[float], list[int]]


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    lora_request: Any = None  # pagedllm.lora.LoRARequest, checked by the processor
    # A pooling request (pagedllm.PoolingParams): prefill only, its output is pooling_output.
    pooling_params: Any = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs] | None = None
    # enable_return_routed_experts: (first position, expert ids [n, moe_layers, top_k]) computed this step
    new_routed_experts: tuple[int, Any] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # The request failed in the core (e.g. its grammar did not compile): finish_reason "abort" and
    # the message of the ValueError its caller gets.
    error: str | None = None
    # A pooling request's result (a float32 numpy array), with finish_reason "stop".
    pooling_output: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    # Speculative decoding, totals since start: steps that verified drafts, drafts proposed,
    # drafts accepted, and accepted per draft position (1st, 2nd, ...).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


# ---- the engine-core process boundary (EngineCoreClient <-> run_engine_core) -----------------
# Into the core process:


@dataclass
class AddRequest:
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class UtilityCall:
    """Call an EngineCore utility method by name; answered by a UtilityResult with this call_id."""

    call_id: int
    method: str
    args: tuple = ()


@dataclass
class Shutdown:
    pass


@dataclass
class StartCore:
    """The first message to a core process started before its config existed (an EngineConfig)."""
    config: Any


CoreInput = Union[AddRequest, AbortRequests, UtilityCall, Shutdown, StartCore]

# Out of it (EngineCoreOutputs travels as itself):


@dataclass
class CoreReady:
    num_blocks: int


@dataclass
class CoreStartupError:
    message: str
    traceback: str


@dataclass
class RequestError:
    """One request was refused (bad input); the core goes on serving the others."""

    request_id: str
    message: str


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None  # "ExceptionType: text" when the call raised


@dataclass
class CoreFailed:
    """The core loop raised: the core process is going down."""

    message: str


# What the client hands its reader (AsyncLLM) besides EngineCoreOutputs and RequestError:


@dataclass
class CoreDead:
    """The core process died or failed; nothing more will come."""

    reason: str


@dataclass
class CoreClosed:
    """The client was shut down."""


CoreOutput = Union[EngineCoreOutputs, RequestError, CoreDead, CoreClosed]
