"""LLMEngine: the synchronous engine — processor, engine core and output processor in one loop."""
from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.messages import SchedulerStats
from pagedllm.engine.core import EngineCore
from pagedllm.engine.frontend import EngineFrontend
from pagedllm.engine.output_processor import register_request
from pagedllm.inputs import PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

_STATS_INTERVAL_S = 5.0


class LLMEngine(EngineFrontend):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.engine_core = EngineCore(config)
        self.log_stats = config.log_stats
        self.last_stats: SchedulerStats | None = None
        self._last_log_time = time.monotonic()
        self._logged_tokens = (0, 0)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
        arrival_time: float | None = None, priority: int = 0,
    ) -> None:
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params if params is not None else self.get_default_sampling_params()
        parent, core_reqs = register_request(self.processor, self.output_processor, request_id, prompt, params,
                                             arrival_time, priority)
        added: list[str] = []
        try:
            for core_req in core_reqs:
                self.engine_core.add_request(core_req)
                added.append(core_req.request_id)
        except Exception:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests([r.request_id for r in core_reqs])
            raise
        self.parents[request_id] = parent

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        engine_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                engine_ids.extend(c.request_id for c in parent.children)
        self.output_processor.abort_requests(engine_ids)
        self.engine_core.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput]:
        core_out = self.engine_core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_out.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for ro in outputs:
            if ro.finished:
                self.parents.pop(ro.request_id, None)
        self.last_stats = core_out.scheduler_stats
        if self.log_stats:
            self._maybe_log_stats()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log_time < _STATS_INTERVAL_S or self.last_stats is None:
            return
        op = self.output_processor
        dt = now - self._last_log_time
        prompt_tps = (op.num_prompt_tokens - self._logged_tokens[0]) / dt
        gen_tps = (op.num_generation_tokens - self._logged_tokens[1]) / dt
        s = self.last_stats
        logger.info(
            "Throughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV cache %.1f%% | "
            "prefix cache hit rate %.1f%% | preemptions %d", prompt_tps, gen_tps, s.num_running_reqs,
            s.num_waiting_reqs, 100 * s.kv_cache_usage,
            100 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            s.num_preemptions,
        )
        self._last_log_time = now
        self._logged_tokens = (op.num_prompt_tokens, op.num_generation_tokens)

