"""OutputProcessor: EngineCoreOutputs → RequestOutputs (detokenize, stop strings, logprobs, n>1)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, PositionLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedllm.engine.processor import Processor
from pagedllm.inputs import PromptType
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """Front-end state of one engine request (one sample of a parent request)."""

    request_id: str
    parent: "ParentRequest"
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0
    # enable_return_routed_experts: (first position, ids [n, layers, top_k]) as the steps report them
    routed_chunks: list[tuple[int, Any]] = field(default_factory=list)
    pooled: Any = None  # a pooling request's result (numpy)

    def completion(self, delta: bool) -> CompletionOutput:
        finished = self.finish_reason is not None
        text = self.detokenizer.get_next_output_text(finished, delta) if self.detokenizer else ""
        tokens = self.token_ids[self.num_sent_tokens:] if delta else list(self.token_ids)
        logprobs = self.logprobs
        if delta and logprobs is not None:
            logprobs = logprobs[self.num_sent_logprobs:]
        if delta:
            self.num_sent_tokens = len(self.token_ids)
            self.num_sent_logprobs = len(self.logprobs or [])
        return CompletionOutput(self.index, text, tokens, self.cumulative_logprob,
                                list(logprobs) if logprobs is not None else None,
                                self.finish_reason, self.stop_reason,
                                routed_experts=self.routed_experts() if finished else None)

    def routed_experts(self) -> Any | None:
        """The routed expert ids of every computed token [prompt + output - 1, layers, top_k]; a
        position reported twice (recomputed after preemption) keeps its latest rows."""
        if not self.routed_chunks:
            return None
        import numpy as np

        rows = self.routed_chunks[0][1]
        num_tokens = len(self.parent.prompt_token_ids) + len(self.token_ids) - 1
        out = np.zeros((num_tokens, *rows.shape[1:]), dtype=rows.dtype)
        for first, chunk in self.routed_chunks:
            out[first:first + len(chunk)] = chunk[:max(num_tokens - first, 0)]
        return out


@dataclass
class ParentRequest:
    """The user's request: gathers its n samples into one RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    pooling: bool = False  # a pooling request: its one child carries ``pooled``

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def split_samples(request_id: str, params: SamplingParams) -> tuple[list[str], list[SamplingParams]]:
    """The engine requests of one user request: n samples = n requests (which share the
    prompt's cached blocks), seeds offset per sample, prompt logprobs from the first only."""
    if params.n == 1:
        return [request_id], [params]
    child_ids, child_params = [], []
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if p.seed is not None:
            p.seed += i
        if i > 0:
            p.prompt_logprobs = None  # reported once, from the first sample
        child_ids.append(f"{i}_{request_id}")
        child_params.append(p)
    return child_ids, child_params


def register_request(
    processor: Processor, output_processor: "OutputProcessor", request_id: str, prompt: PromptType,
    params: SamplingParams, arrival_time: float | None = None, priority: int = 0, lora_request: Any = None,
) -> tuple[ParentRequest, list[EngineCoreRequest]]:
    """Validate and process one user request, register its samples for output processing,
    and return the engine-core requests (one per sample) the caller must submit."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
    if isinstance(params, PoolingParams):
        if lora_request is not None:
            raise ValueError("lora_request does not apply to pooling requests")
        text, core_req = processor.process_pooling(request_id, prompt, params, arrival_time, priority)
        parent = ParentRequest(request_id, text, core_req.prompt_token_ids, core_req.sampling_params,
                               RequestMetrics(arrival_time=core_req.arrival_time), pooling=True)
        output_processor.add_request(parent, [request_id], [core_req.sampling_params])
        return parent, [core_req]
    text, core_req = processor.process(request_id, prompt, params, arrival_time, priority, lora_request)
    params = core_req.sampling_params
    child_ids, child_params = split_samples(request_id, params)
    parent = ParentRequest(request_id, text, core_req.prompt_token_ids, params,
                           RequestMetrics(arrival_time=core_req.arrival_time))
    output_processor.add_request(parent, child_ids, child_params)
    return parent, [replace(core_req, request_id=i, sampling_params=p) for i, p in zip(child_ids, child_params)]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by engine request id
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def add_request(self, parent: ParentRequest, child_ids: list[str], child_params: list[SamplingParams]) -> None:
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, (req_id, params) in enumerate(zip(child_ids, child_params)):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, parent.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens,
                )
            state = RequestState(req_id, parent, index, params, detok,
                                 logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.children.append(state)
            self.states[req_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.states.pop(req_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out now and the engine requests to abort
        (those a stop string finished)."""
        now = time.time()
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            parent = state.parent
            m = parent.metrics
            if out.first_scheduled_time is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = out.first_scheduled_time
            parent.num_cached_tokens = out.num_cached_tokens
            if out.pooling_output is not None:
                state.pooled = out.pooling_output
                m.first_token_time = m.last_token_time = now
                self.num_prompt_tokens += len(parent.prompt_token_ids)
            if out.new_routed_experts is not None:
                state.routed_chunks.append(out.new_routed_experts)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and state.index == 0:
                parent.prompt_logprobs.extend(self._to_logprob_dicts(out.new_prompt_logprobs))
            if out.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                    self.num_prompt_tokens += len(parent.prompt_token_ids)
                m.last_token_time = now
                m.num_generation_tokens += len(out.new_token_ids)
                self.num_generation_tokens += len(out.new_token_ids)
                self._append_tokens(state, out)
            if out.finish_reason is not None and state.finish_reason is None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                del self.states[state.request_id]
                if out.finish_reason is None:  # finished here (stop string): the core must let go
                    to_abort.append(state.request_id)
            ro = self._make_output(state)
            if ro is not None:
                request_outputs.append(ro)
        return request_outputs, to_abort

    def _append_tokens(self, state: RequestState, out: EngineCoreOutput) -> None:
        new_ids = out.new_token_ids
        if state.logprobs is not None and out.new_logprobs:
            for pos in out.new_logprobs:
                entry = self._to_logprob_dicts([pos])[0]
                state.logprobs.append(entry)
                state.cumulative_logprob += pos[1][0]
        state.token_ids.extend(new_ids)
        if state.detokenizer is not None:
            stop = state.detokenizer.update(new_ids)
            if stop is not None:
                state.finish_reason, state.stop_reason = "stop", stop

    def _to_logprob_dicts(self, positions: list[PositionLogprobs]) -> list[dict[int, Logprob]]:
        result = []
        for ids, lps, ranks in positions:
            d: dict[int, Logprob] = {}
            for tid, lp, rank in zip(ids, lps, ranks):
                if tid not in d:
                    text = decode_token(self.tokenizer, tid) if self.tokenizer is not None else None
                    d[tid] = Logprob(lp, rank, text)
            result.append(d)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        parent = state.parent
        if parent.pooling:
            if not parent.finished:
                return None
            import torch

            parent.metrics.finished_time = time.time()
            data = torch.from_numpy(state.pooled) if state.pooled is not None else None
            return PoolingRequestOutput(parent.request_id, PoolingOutput(data), parent.prompt_token_ids, True,
                                        parent.prompt, parent.num_cached_tokens, parent.metrics)
        kind = parent.params.output_kind
        finished = parent.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if finished:
            parent.metrics.finished_time = time.time()
        delta = kind == RequestOutputKind.DELTA
        if delta:
            outputs = [state.completion(delta=True)]
        else:
            outputs = [c.completion(delta=False) for c in parent.children]
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # Sent once, whole: a chunked prefill reports them over several steps.
            complete = len(prompt_logprobs) >= len(parent.prompt_token_ids) or finished
            if parent.prompt_logprobs_sent or not complete:
                prompt_logprobs = None
            else:
                parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished, metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
        )
