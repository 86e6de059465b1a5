"""EngineCore: the one loop — schedule, execute, update — over plain messages."""
from __future__ import annotations

import logging
from collections import deque
from typing import Any

from pagedllm import envs
from pagedllm.config import SPEC_METHODS_WITH_MODEL, EngineConfig
from pagedllm.core.kv_cache_groups import blocks_per_request, layers_per_group, make_kv_cache_groups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.core.request import Request
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.spec_decode.ngram import NgramProposer, can_speculate
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer
from pagedllm.utils import freeze_gc_heap
from pagedllm.worker.executor import create_executor
from pagedllm.worker.executor_base import WorkerMethod

logger = logging.getLogger("pagedllm")

_WEIGHT_UPDATE_METHODS = ("load_weights",)
_GRAMMAR_WAIT_S = 0.05  # an idle engine waiting for a grammar compile checks back this often


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _kv_dtype_note(cache_dtype: str, model_dtype: str) -> str:
    """The cache dtype, and for fp8 how many times the tokens of a model-dtype cache it holds."""
    if cache_dtype == "auto":
        return f", {model_dtype}"
    return f", {cache_dtype}: {_DTYPE_BYTES.get(model_dtype, 2)}x the tokens of a {model_dtype} cache"


class EngineCore:
    """Consumes EngineCoreRequests and aborts, produces EngineCoreOutputs. Everything that
    crosses is a small picklable dataclass, so this can run in its own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = create_executor(config)
        num_blocks = self.executor.determine_num_blocks()
        cc, sc = config.cache_config, config.scheduler_config
        groups = make_kv_cache_groups(config.model_config.layer_sliding_windows or [None])
        # One request alone must always fit, or it could never finish.
        needed = blocks_per_request(groups, cc.block_size, sc.max_model_len, sc.max_num_batched_tokens)
        if num_blocks < needed:
            what = f"max_model_len={sc.max_model_len}" if len(groups) == 1 else (
                f"the {needed} blocks one request of max_model_len={sc.max_model_len} holds over its "
                f"{len(groups)} KV cache groups")
            raise ValueError(
                f"the KV cache holds {num_blocks * cc.block_size} tokens ({num_blocks} blocks), fewer than {what}; "
                "lower max_model_len or give the cache more memory "
                "(gpu_memory_utilization / kv_cache_memory_bytes / num_gpu_blocks_override)"
            )
        self.executor.initialize_kv_cache(num_blocks)
        per_block = self.executor.kv_cache_bytes_per_block()
        tokens = num_blocks * cc.block_size
        hybrid = "" if len(groups) == 1 else (
            f", shared by {len(groups)} layer groups of {layers_per_group(groups)} layers "
            f"({sum(g.sliding_window is None for g in groups)} full attention, the others sliding window)")
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB%s%s); maximum concurrency for %d tokens "
            "per request: %.2fx", num_blocks, cc.block_size, tokens, num_blocks * per_block / 2**30,
            _kv_dtype_note(cc.cache_dtype, config.model_config.dtype), hybrid, sc.max_model_len,
            tokens / sc.max_model_len if len(groups) == 1 else num_blocks / needed,
        )
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                               group_windows=[g.sliding_window for g in groups])
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        # Steps in flight, oldest first: one per pipeline stage, or with async scheduling the one
        # the device runs while the next is scheduled and launched.
        self._batch_queue: deque = deque()
        self._max_in_flight = sc.max_concurrent_batches if sc.max_concurrent_batches > 1 \
            else 2 if sc.async_scheduling else 1
        self._deferred_rows: list[str] = []  # a defer_grammar step's candidate constrained rows
        self.sleeping_tags: set[str] = set()  # sleep mode: what is freed now ("weights", "kv_cache")
        mc = config.model_config
        self.structured_output = StructuredOutputManager(
            config.structured_outputs_config, mc.vocab_size, lambda: get_tokenizer(mc), mc.generation_eos_token_ids())
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        # The workers' second network (a draft model, an EAGLE head) proposes.
        self.takes_drafts = spec is not None and spec.method in SPEC_METHODS_WITH_MODEL
        # Async scheduling (two steps in flight; never with pipeline stages or speculation): a step
        # may be launched while one with constrained rows is in flight; its masks follow (sample_tokens).
        self._defers_grammar = sc.async_scheduling and spec is None and envs.PAGEDLLM_DEFER_GRAMMAR
        freeze_gc_heap()

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.sleeping_tags:
            raise ValueError(
                f"the engine is sleeping ({', '.join(sorted(self.sleeping_tags))} freed); call wake_up() before "
                f"submitting request {request.request_id!r}")
        req = Request.from_engine_core_request(request)
        params = request.sampling_params.structured_outputs
        self.scheduler.add_request(req)
        if params is not None:
            req.structured_output = self.structured_output.add_request(request.request_id, params,
                                                                       request.prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        outputs = self.scheduler.abort_requests(request_ids)
        # Steps still in flight (async scheduling, pipeline stages) with nothing left to run: land
        # them now, so an engine whose requests were all aborted holds nothing (an interrupted
        # LLM.generate leaves it as it found it); their outputs belong to aborted requests.
        while self._batch_queue and not self.scheduler.has_unfinished_requests():
            self.step()
        return EngineCoreOutputs(outputs)

    def step(self) -> EngineCoreOutputs:
        if self._max_in_flight > 1:
            try:
                return self._step_with_batch_queue()
            except BaseException:
                self._batch_queue.clear()  # a failed step (a worker died): none in flight will land
                raise
        failed = self._fail_grammars()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(failed, scheduler_stats=self.scheduler.make_stats())
        sched = self._schedule()
        result = self.executor.execute_model(sched)
        outputs = self.scheduler.update_from_output(sched, result)
        if self.proposer is not None or self.takes_drafts:
            self._propose_drafts(result.spec_token_ids)
        self._wait_for_grammars(sched)
        return EngineCoreOutputs(failed + outputs, self.scheduler.make_stats())

    # ---- structured outputs ---------------------------------------------------------------------
    def _fail_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar failed to compile (or timed out) end now, with the error."""
        outputs = []
        for grammar in self.structured_output.poll():
            for out in self.scheduler.abort_requests([grammar.request_id]):
                out.error = grammar.error
                outputs.append(out)
        return outputs

    def _schedule(self, defer: bool = False) -> SchedulerOutput:
        """The scheduler's step, with the masks of the constrained requests that sample in it.
        With ``defer`` (a step with constrained rows is in flight) the masks wait for that step's
        tokens: the step is marked ``defer_grammar`` and ``_deferred_rows`` keeps its candidates."""
        sched = self.scheduler.schedule()
        if self.structured_output.live:  # else: no constrained request, no extra work
            rows = [req_id for req_id in sched.num_scheduled_tokens if self._samples_constrained(req_id, defer)]
            if defer and rows:
                sched.defer_grammar, self._deferred_rows = True, rows
            elif not defer:
                sched.grammar = self._grammar_of(rows)
        return sched

    def _samples_constrained(self, req_id: str, any_phase: bool) -> bool:
        """The request samples this step under a grammar (``any_phase``: or may, once the step in
        flight lands: its reasoning may end there)."""
        request = self.scheduler.requests[req_id]
        grammar = request.structured_output
        return grammar is not None and (any_phase or grammar.reasoning_ended) \
            and request.num_computed_tokens >= request.num_tokens

    def _grammar_of(self, req_ids: list[str]):
        """The step's GrammarBitmask (None: no row is masked) for those of ``req_ids`` still
        running under a grammar (after reasoning)."""
        handles = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            grammar = None if request is None or request.status.is_finished else request.structured_output
            if grammar is not None and grammar.matcher is not None and grammar.reasoning_ended:
                handles.append(grammar)
        return self.structured_output.bitmask(handles)

    # ---- speculative decoding -------------------------------------------------------------------
    def _propose_drafts(self, from_workers: dict[str, list[int]]) -> None:
        """Each decoding request that may speculate gets the proposer's guess of its next tokens
        (n-gram here, or the draft model's / EAGLE head's from the workers), as many as can still be emitted
        (max_tokens) and fit (max_model_len)."""
        spec, running = self.config.speculative_config, self.scheduler.running
        if spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size:
            return
        max_len = self.config.scheduler_config.max_model_len
        for r in running:
            if r.structured_output is not None or r.num_computed_tokens != r.num_tokens - 1 \
                    or not can_speculate(r.sampling_params):
                continue
            room = max_len - r.num_tokens
            if r.max_tokens is not None:
                room = min(room, r.max_tokens - r.num_output_tokens - 1)
            if self.proposer is not None:
                r.spec_token_ids = self.proposer.propose(r.all_token_ids, room)
            else:
                r.spec_token_ids = from_workers.get(r.request_id, [])[:max(room, 0)]

    def _holds_grammar(self, sched: SchedulerOutput) -> bool:
        """The step runs a constrained request (masked now, or reasoning: its end tag may land)."""
        live = self.structured_output.live
        return bool(live) and any(req_id in live for req_id in sched.num_scheduled_tokens)

    def _wait_for_grammars(self, sched: SchedulerOutput) -> None:
        """Nothing ran and only compiles are left: sleep until one finishes, do not spin."""
        if not sched.total_num_scheduled_tokens and not self._batch_queue and self.structured_output.pending:
            self.structured_output.wait(_GRAMMAR_WAIT_S)

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Keep up to ``_max_in_flight`` steps in flight: launch a new step while one fits and
        has work (under pipeline parallelism, requests whose token is in flight sit out),
        otherwise read the oldest step's tokens. With async scheduling (two in flight) the host
        work of one step (scheduling, inputs, outputs) overlaps the device work of the other;
        with pipeline stages every stage has a micro-batch."""
        launched = deferred = False
        failed = self._fail_grammars()
        # A constrained request's next mask needs its token in flight. With async scheduling the
        # next step is launched anyway, its sampling deferred: its forward runs on the device
        # while the step in flight lands here and the masks are filled, then sample_tokens sends
        # them (vLLM's way). Otherwise (pipeline stages, speculation) that step lands first.
        masked_in_flight = bool(self._batch_queue) and self._holds_grammar(self._batch_queue[-1][0])
        if len(self._batch_queue) < self._max_in_flight and self.scheduler.has_unfinished_requests() \
                and (not masked_in_flight or self._defers_grammar):
            sched = self._schedule(defer=masked_in_flight)
            if sched.total_num_scheduled_tokens:
                self._batch_queue.append((sched, self.executor.execute_model(sched, non_block=True)))
                launched, deferred = True, sched.defer_grammar
            else:  # nothing runnable now: the workers hear of finished/preempted requests next time
                self.scheduler.defer_notices(sched)
                self._wait_for_grammars(sched)
        outputs = []
        if self._batch_queue and (not launched or len(self._batch_queue) == self._max_in_flight):
            sched, pending = self._batch_queue.popleft()
            outputs = self.scheduler.update_from_output(sched, pending.result())
        if deferred:  # the tokens the masks follow have landed (max_in_flight is 2: popped above)
            rows, self._deferred_rows = self._deferred_rows, []
            self.executor.sample_tokens(self._grammar_of(rows))
        return EngineCoreOutputs(failed + outputs, self.scheduler.make_stats())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- RL rollout: sleep mode and weight updates (vLLM's contract) ------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and move the weights to host memory (level 1) or drop them (level 2).
        Like vLLM, the caller must have no request in flight."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; create the engine with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights offloaded to host) or 2 (weights discarded), got {level!r}")
        if self.has_unfinished_requests():
            raise ValueError(
                f"cannot sleep with {self.scheduler.get_num_unfinished_requests()} unfinished "
                "request(s); finish or abort them first")
        if self.sleeping_tags:
            logger.warning("sleep(level=%d) ignored: the engine is already sleeping (%s)", level,
                           ", ".join(sorted(self.sleeping_tags)))
            return
        self.kv_cache_manager.reset_prefix_cache()  # the cached contents are about to vanish
        self.executor.collective_rpc("sleep", (level,))
        self.sleeping_tags = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: ``tags`` None means all; ["weights"] first lets a weight update
        run before the KV cache takes its memory back."""
        known = ("weights", "kv_cache")
        if tags is None:
            tags = list(known)
        if isinstance(tags, str) or not all(t in known for t in tags):
            raise ValueError(f"wake_up tags must be None or a list drawn from {list(known)}, got {tags!r}")
        todo = [t for t in known if t in tags and t in self.sleeping_tags]
        if not todo:
            logger.warning("wake_up(tags=%s) ignored: nothing of that is asleep", tags)
            return
        self.executor.collective_rpc("wake_up", (todo,))
        self.sleeping_tags -= set(todo)
        if "kv_cache" in todo:
            self.kv_cache_manager.reset_prefix_cache()  # the new cache holds nothing

    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call a Worker method by name (or a function of the worker) on every worker: the one path
        every such call from LLM / LLMEngine / AsyncLLM takes. After "load_weights" the prefix cache
        is reset: KV computed by the old weights is never reused."""
        results = self.executor.collective_rpc(method, tuple(args), kwargs)
        if method in _WEIGHT_UPDATE_METHODS:
            self.kv_cache_manager.reset_prefix_cache()
        return results

    def get_stats(self) -> dict[str, Any]:
        """KV cache and queue sizes (the server's /metrics and health reads)."""
        kv, stats = self.kv_cache_manager, self.scheduler.make_stats()
        return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
                "kv_cache_usage": stats.kv_cache_usage, "num_running": stats.num_running_reqs,
                "num_waiting": stats.num_waiting_reqs}

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
