"""Executors: how the engine core reaches its worker(s). One process for now."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    """The worker lives in the engine core's own process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_cache_bytes_per_block(self) -> int:
        return self.worker.model_runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        """The step's ModelRunnerOutput, or with ``non_block`` a handle whose result() waits."""
        return self.worker.execute_model(sched, non_block)

    def shutdown(self) -> None:
        pass
