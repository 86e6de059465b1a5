"""Request: the scheduler's view of one sequence (token counts, blocks, status)."""
from __future__ import annotations

import enum
from typing import Any

from pagedllm.core.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        priority: int = 0,
        lora_request: Any = None,
        pooling_params: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.lora_request = lora_request  # its adapter (pagedllm.lora.LoRARequest) or None
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.pooling_params = pooling_params  # a pooling request: it ends when its prompt is computed
        self.max_tokens = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        # Async scheduling: tokens being sampled by steps still in flight (not yet appended).
        self.num_output_placeholders = 0
        self.first_scheduled_time: float | None = None
        # Content hashes of this request's full blocks, extended as tokens are appended.
        self.block_hashes: list[bytes] = []
        # Structured outputs: the request's grammar (structured_output.manager.GrammarRequest),
        # attached by the engine core. The scheduler reads it through is_ready / accept_tokens /
        # is_terminated / free only, so this room needs no grammar library.
        self.structured_output: Any = None
        # Speculative decoding: tokens proposed for the next step (consumed when it is scheduled).
        self.spec_token_ids: list[int] = []

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest) -> "Request":
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time, r.priority,
                   r.lora_request, r.pooling_params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
