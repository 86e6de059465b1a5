"""EngineCore: the one loop — schedule, execute, update — over plain messages."""
from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.executor import UniProcExecutor

logger = logging.getLogger("pagedllm")


class EngineCore:
    """Consumes EngineCoreRequests and aborts, produces EngineCoreOutputs. Everything that
    crosses is a small picklable dataclass, so this can run in its own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        num_blocks = self.executor.determine_num_blocks()
        cc, sc = config.cache_config, config.scheduler_config
        if num_blocks * cc.block_size < sc.max_model_len:
            # One request alone must always fit, or it could never finish.
            raise ValueError(
                f"the KV cache holds {num_blocks * cc.block_size} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len={sc.max_model_len}; lower max_model_len or give the cache more memory "
                "(gpu_memory_utilization / kv_cache_memory_bytes / num_gpu_blocks_override)"
            )
        self.executor.initialize_kv_cache(num_blocks)
        per_block = self.executor.kv_cache_bytes_per_block()
        tokens = num_blocks * cc.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); maximum concurrency for %d tokens "
            "per request: %.2fx", num_blocks, cc.block_size, tokens, num_blocks * per_block / 2**30,
            sc.max_model_len, tokens / sc.max_model_len,
        )
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        self._in_flight = None  # async scheduling: (SchedulerOutput, pending result) of the last step

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.scheduler.abort_requests(request_ids))

    def step(self) -> EngineCoreOutputs:
        if self.config.scheduler_config.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        sched = self.scheduler.schedule()
        result = self.executor.execute_model(sched)
        outputs = self.scheduler.update_from_output(sched, result)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def _step_async(self) -> EngineCoreOutputs:
        """Launch step N+1, then read step N's tokens: the host work of one step (scheduling,
        inputs, outputs) overlaps the device work of the other."""
        launched = None
        if self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            launched = (sched, self.executor.execute_model(sched, non_block=True))
        outputs = []
        if self._in_flight is not None:
            prev_sched, pending = self._in_flight
            outputs = self.scheduler.update_from_output(prev_sched, pending.result())
        self._in_flight = launched
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
