"""Executors: how the engine core reaches its worker(s). One process for now."""
from __future__ import annotations

from typing import Any, Callable

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

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker (a Worker method's name, or a function taking the
        worker first); one result per worker, in rank order."""
        if isinstance(method, str):
            func = getattr(self.worker, method, None)
            if func is None or method.startswith("_") or not callable(func):
                raise ValueError(f"collective_rpc method {method!r} is not a public Worker method")
            return [func(*args, **(kwargs or {}))]
        if not callable(method):
            raise ValueError(f"collective_rpc method must be a str or a callable, got {type(method).__name__}")
        return [method(self.worker, *args, **(kwargs or {}))]

    def sleep(self, level: int) -> None:
        self.collective_rpc("sleep", (level,))

    def wake_up(self, tags: list[str]) -> None:
        self.collective_rpc("wake_up", (tags,))

    def shutdown(self) -> None:
        pass
