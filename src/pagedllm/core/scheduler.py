"""Scheduler: iteration-level continuous batching under one token budget per step.

Every request has ``num_computed_tokens`` and ``num_tokens``; a step catches requests up
within the budget. One rule covers prefill (chunked or not), prefix-cache hits and
decode. Running requests go first; waiting ones fill what budget is left. When blocks
run out, the lowest-priority running request is preempted and recomputed later.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreOutput, SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger("pagedllm")


class _WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on
    (priority, arrival_time), lower first, as in vLLM."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) + len(self._heap)

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._deque.appendleft if front else self._deque.append)(request)
        else:
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, requests: set[str]) -> None:
        if self.policy == "fcfs":
            self._deque = deque(r for r in self._deque if r.request_id not in requests)
        else:
            self._heap = [e for e in self._heap if e[3].request_id not in requests]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitingQueue(config.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last step: the workers hear of them with the next one.
        self._finished_req_ids: set[str] = set()
        # Preempted by a step that ran nothing (so was not launched): told with the next one.
        self._pending_preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SchedulerStats()  # only its spec_* counters are kept here
        self._step_loras: set[int] = set()  # the adapters of the step being scheduled

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if request.num_prompt_tokens >= self.config.max_model_len + (request.pooling_params is not None):
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; with at least one output token "
                f"this exceeds max_model_len={self.config.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        found = [self.requests[r] for r in request_ids if r in self.requests]
        ids = {r.request_id for r in found}
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting.remove(ids)
        out = []
        for request in found:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            out.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                        num_cached_tokens=max(request.num_cached_tokens, 0)))
        return out

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        if request.structured_output is not None:
            request.structured_output.free()
            request.structured_output = None
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def defer_notices(self, sched: SchedulerOutput) -> None:
        """``sched`` was not launched (it had nothing to run): the finished and preempted request
        ids it carried go to the workers with the next step instead."""
        self._finished_req_ids |= sched.finished_req_ids
        self._pending_preempted_req_ids |= sched.preempted_req_ids

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        num_scheduled: dict[str, int] = {}
        earlier_preempted, self._pending_preempted_req_ids = self._pending_preempted_req_ids, set()
        # Pipeline parallelism: a step takes its share of the requests, so the next steps (the
        # other stages' micro-batches) have work too.
        max_reqs = -(-len(self.requests) // cfg.max_concurrent_batches) if cfg.max_concurrent_batches > 1 \
            else cfg.max_num_seqs
        spec_tokens: dict[str, list[int]] = {}
        self._step_loras: set[int] = set()
        cached_reqs, preempted_ids, budget = self._schedule_running(cfg.max_num_batched_tokens, max_reqs,
                                                                    num_scheduled, spec_tokens)
        # New work only when nothing was preempted this step, so a preempted request is
        # not overtaken by the ones behind it.
        new_reqs = [] if preempted_ids else self._schedule_waiting(budget, max_reqs, num_scheduled)

        # Running requests that got no budget this step are simply left out of the batch.
        scheduled_cached = [c for c in cached_reqs if c.req_id in num_scheduled]
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=scheduled_cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted_ids | earlier_preempted,
            scheduled_spec_decode_tokens={r: t for r, t in spec_tokens.items() if r in num_scheduled},
        )
        self._finished_req_ids = set()
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if cfg.tracks_in_flight and \
                    request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
        return out

    def _schedule_running(self, budget: int, max_reqs: int, num_scheduled: dict[str, int],
                          spec_tokens: dict[str, list[int]]) -> tuple[list[CachedRequestData], set[str], int]:
        """Catch the running requests up, in order, preempting from the back when blocks run out
        (a decode with proposed tokens runs them too, as far as the budget goes: ``spec_tokens``).
        Returns their step data, the ids preempted, and the budget left."""
        cfg = self.config
        cached_reqs: list[CachedRequestData] = []
        preempted_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < max_reqs:
            request = self.running[i]
            ahead = request.num_output_placeholders if cfg.async_scheduling else 0
            num_new = min(request.num_tokens + ahead - request.num_computed_tokens, budget)
            if num_new <= 0 or self._reaches_limit(request):
                i += 1  # its last token is in flight and ends it: nothing to run
                continue
            if not self._lora_fits(request):
                i += 1  # its adapter would exceed max_loras this step: it runs in a later one
                continue
            self.kv.free_outside_window(request)
            drafts, request.spec_token_ids = request.spec_token_ids[:budget - num_new], []
            if drafts and request.num_tokens - request.num_computed_tokens == num_new == 1:
                spec_tokens[request.request_id] = drafts
                num_new += len(drafts)
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while True:
                new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:  # already in this batch: take it back out
                    budget += num_scheduled.pop(victim.request_id)
                    i -= 1
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:  # preempted itself: nothing left to run beyond this point
                break
            cached = CachedRequestData(request.request_id, self.kv.block_ids_of(new_blocks),
                                       request.num_computed_tokens)
            if cfg.max_concurrent_batches > 1:
                lo = max(request.num_computed_tokens, request.num_prompt_tokens)
                cached.new_token_ids = request.all_token_ids[lo:request.num_computed_tokens + num_new]
            cached_reqs.append(cached)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1
        return cached_reqs, preempted_ids, budget

    def _schedule_waiting(self, budget: int, max_reqs: int, num_scheduled: dict[str, int]) -> list[NewRequestData]:
        """Start waiting requests (prefix-cache hits first) while budget, blocks and seats last."""
        cfg = self.config
        new_reqs: list[NewRequestData] = []
        now = time.time()
        compiling: list[Request] = []  # their grammar is not ready: they wait, the others go ahead
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and len(num_scheduled) < max_reqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:  # preempted with a token still in flight
                break
            if request.structured_output is not None and not request.structured_output.is_ready():
                compiling.append(self.waiting.pop())
                continue
            if not self._lora_fits(request):
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            # A preempted request comes back only with a block to spare for each running request's
            # next one: back in the blocks it freed, it would be the latest again when the running
            # ones grow, preempted and recomputed again (a full cache's thrash: workload 1 on
            # qwen3-30b-a3b preempted 135 times, recomputing 60k tokens; 49 and 28k with this).
            reserve = len(self.running) * self.kv.num_groups if request.num_preemptions else 0
            new_blocks = self.kv.allocate_slots(request, num_new, hits, self._lookahead(num_hit_tokens + num_new),
                                                reserve_blocks=reserve)
            if new_blocks is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, self.kv.get_block_ids(request.request_id), num_hit_tokens,
                request.lora_request, request.pooling_params,
            ))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        for request in reversed(compiling):  # back in their places
            self.waiting.add(request, front=True)
        return new_reqs

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """KV slots a draft model writes past the step's tokens (within max_model_len)."""
        cfg = self.config
        return max(0, min(cfg.num_lookahead_tokens, cfg.max_model_len - num_tokens_after_step))

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter can join this step (at most max_loras distinct ones);
        if so it is counted in."""
        lora_id, max_loras = request.lora_int_id, self.config.max_loras
        if not lora_id or max_loras is None or lora_id in self._step_loras:
            return True
        if len(self._step_loras) >= max_loras:
            return False
        self._step_loras.add(lora_id)
        return True

    def _reaches_limit(self, request: Request) -> bool:
        """Async scheduling: the tokens in flight already reach max_tokens / max_model_len."""
        if not request.num_output_placeholders:
            return False
        n = request.num_output_tokens + request.num_output_placeholders
        return (request.max_tokens is not None and n >= request.max_tokens) or \
            request.num_tokens + request.num_output_placeholders >= self.config.max_model_len

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it restarts from the waiting queue and is recomputed
        (mostly from the prefix cache, when enabled)."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)
        logger.warning(
            "Preempted request %s (recompute): KV cache full with %d running; total preemptions: %d. "
            "More KV cache memory (gpu_memory_utilization / kv_cache_memory_bytes) avoids this.",
            request.request_id, len(self.running), self.num_preemptions,
        )

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs = []
        for req_id, token_ids in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            prompt_lps = result.prompt_logprobs.get(req_id)
            routed = result.routed_experts.get(req_id)
            pooled = result.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request's prompt is done: so is the request
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="stop", pooling_output=pooled,
                                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                                first_scheduled_time=request.first_scheduled_time))
                continue
            if not token_ids and prompt_lps is None and routed is None:
                continue
            if self.config.tracks_in_flight:
                request.num_output_placeholders -= len(token_ids)
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            if drafts:  # the rejected drafts' positions are computed again from the emitted token
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                self._count_spec(len(drafts), len(token_ids) - 1)
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if request.structured_output is not None:
                    status = self._advance_grammar(request, token_id, status)
                if status is not None:
                    if request.status == RequestStatus.RUNNING:
                        self.running.remove(request)
                    else:  # preempted while its last token was in flight
                        self.waiting.remove({req_id})
                    self._finish(request, status)
                    break
            lp = result.logprobs.get(req_id)
            outputs.append(EngineCoreOutput(
                req_id, new_token_ids,
                new_logprobs=[lp] if lp is not None and new_token_ids else None,
                new_prompt_logprobs=prompt_lps,
                new_routed_experts=routed,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
            ))
        return outputs

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        st = self.spec_stats
        st.spec_num_drafts += 1
        st.spec_num_draft_tokens += num_drafts
        st.spec_num_accepted_tokens += num_accepted
        if len(st.spec_accepted_per_pos) < num_drafts:
            st.spec_accepted_per_pos.extend([0] * (num_drafts - len(st.spec_accepted_per_pos)))
        for pos in range(num_accepted):
            st.spec_accepted_per_pos[pos] += 1

    @staticmethod
    def _advance_grammar(request: Request, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """The grammar follows the sampled token; it ends the request when it terminates."""
        grammar = request.structured_output
        if not grammar.reasoning_ended:  # the reasoning runs unconstrained; its end tag starts the grammar
            grammar.see_reasoning_token(token_id)
            return status
        if not grammar.accept_tokens([token_id]):
            # The mask allowed nothing this row could use (e.g. allowed_token_ids outside the grammar).
            logger.error("request %s: its grammar refused sampled token %d; finishing it", request.request_id,
                         token_id)
            return status or RequestStatus.FINISHED_ABORTED
        if status is None and grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        return status

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if request.eos_token_id is not None and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.all_stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_stats.spec_num_drafts,
            spec_num_draft_tokens=self.spec_stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.spec_accepted_per_pos),
        )
