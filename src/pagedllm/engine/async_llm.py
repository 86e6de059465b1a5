"""AsyncLLM: the asyncio engine — processing in this process, EngineCore in its own."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Iterable
from typing import Any, AsyncIterator, Callable

from pagedllm.config import EngineConfig
from pagedllm.core.messages import CoreClosed, CoreDead, EngineCoreOutputs, RequestError
from pagedllm.engine.core_client import EngineCoreClient, EngineDeadError
from pagedllm.engine.frontend import EngineFrontend
from pagedllm.engine.output_processor import register_request
from pagedllm.engine.stat_logger import LoggingStatLogger
from pagedllm.inputs import PromptType
from pagedllm.outputs import RequestOutput, join_outputs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.utils import check_profiling_on, freeze_gc_heap

logger = logging.getLogger("pagedllm")


class AsyncLLM(EngineFrontend):
    """`generate()` streams RequestOutputs per request; a background task reads the core's
    outputs, detokenizes them and routes each to its request's asyncio queue."""

    def __init__(self, config: EngineConfig, engine_core: EngineCoreClient | None = None,
                 wait_ready: bool = True) -> None:
        """``engine_core``: a core process started early without a config (``from_engine_args``).
        ``wait_ready`` False: return while the core still builds the model; ``wait_ready()`` then
        waits (the server builds its app meanwhile)."""
        core = engine_core if engine_core is not None else EngineCoreClient(None)
        try:
            core.configure(config)
            super().__init__(config)  # the tokenizer loads here while the core builds the model
            if wait_ready:
                core.wait_ready()
        except BaseException:
            core.shutdown(timeout_s=0.0)  # nothing is served yet: a core mid-build is stopped at once
            raise
        self.engine_core = core
        self._queues: dict[str, asyncio.Queue] = {}
        self._output_task: asyncio.Task | None = None
        # One thread that blocks on the core's output queue, so the event loop never does.
        self._reader_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-async-reader")
        self._closed = False
        # Optional observer with on_step / on_finished / on_aborted (the server's Prometheus metrics).
        self.metrics: Any = None
        # The periodic stats line; the server's timer calls do_log_stats().
        self.stat_logger = LoggingStatLogger(device=config.device) if config.log_stats else None
        freeze_gc_heap()  # the API process's start-up objects: full collections stay short

    @classmethod
    def from_engine_args(cls, engine_args: Any, usage_context: str | None = None, wait_ready: bool = True,
                         engine_core: EngineCoreClient | None = None) -> "AsyncLLM":
        """The core process starts first, so its imports run while this process builds the config
        (``pagedllm serve`` healthy 8.8 -> 7.3 s on the embedded model on a 2-core VM, 20.9 ->
        13-15 s on the llama3-8b shape on an H100 host). ``engine_core``: one the caller started
        earlier still (``EngineCoreClient(None)``, before its own imports); it is shut down if
        this fails."""
        core = engine_core if engine_core is not None else EngineCoreClient(None)
        try:
            config = engine_args.create_engine_config(usage_context)
        except BaseException:
            core.shutdown(timeout_s=0.0)  # a bad argument fails now, not after the core's imports
            raise
        return cls(config, core, wait_ready)

    def wait_ready(self) -> None:
        """Wait until the core has built the model (after ``wait_ready=False``; at once otherwise).
        RuntimeError if it failed to start; the engine is shut down then."""
        try:
            self.engine_core.wait_ready()
        except BaseException:  # a failed start, or Ctrl-C while the core builds: stop it at once
            self.shutdown(timeout_s=0.0)
            raise

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and submit now (ValueError for bad input, before anything streams); the
        returned iterator yields the outputs and aborts the request if closed early."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self.engine_core.dead_reason is not None:
            raise EngineDeadError(self.engine_core.dead_reason)
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._ensure_output_task()
        parent, core_reqs = register_request(self.processor, self.output_processor, request_id, prompt, params,
                                             priority=priority, lora_request=lora_request)
        q: asyncio.Queue = asyncio.Queue()
        self.parents[request_id] = parent
        self._queues[request_id] = q
        try:
            for core_req in core_reqs:
                self.engine_core.add_request(core_req)
        except BaseException:
            self.abort(request_id)
            raise
        # Pooling requests (PoolingParams) have one output and no output_kind.
        return self._stream(request_id, q, getattr(params, "output_kind", None) == RequestOutputKind.DELTA)

    async def _stream(self, request_id: str, q: asyncio.Queue, delta: bool) -> AsyncIterator[RequestOutput]:
        """The request's outputs. A consumer that fell behind (outputs queued since its last read)
        gets them as one: DELTA outputs joined, cumulative ones the newest (as vLLM's collector
        does), so a loaded API process writes one event for several steps instead of one each."""
        finished = False
        error: BaseException | None = None  # met while joining: raised after what came before it
        try:
            while True:
                item, error = (error, None) if error is not None else (await q.get(), None)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not q.empty():
                    later = q.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = join_outputs(item, later) if delta else later
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled or closed early (client disconnect): free its blocks now
                self.abort(request_id)

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, sampling_params, priority, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
            self.abort(request_id)  # no-op once finished; covers a stream that never started

    def abort(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        engine_ids = []
        num_aborted = 0
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            self._queues.pop(rid, None)
            if parent is not None:
                num_aborted += 1
                engine_ids.extend(c.request_id for c in parent.children)
        if engine_ids:
            self.output_processor.abort_requests(engine_ids)
            self.engine_core.abort_requests(engine_ids)
        if num_aborted and self.metrics is not None:
            self.metrics.on_aborted(num_aborted)

    # ---- the output loop -----------------------------------------------------------------------
    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(self._reader_pool, self.engine_core.get_output)
            if isinstance(msg, EngineCoreOutputs):
                self._process_core_outputs(msg)
            elif isinstance(msg, RequestError):
                self._fail_engine_request(msg.request_id, ValueError(msg.message))
            elif isinstance(msg, (CoreDead, CoreClosed)):
                error = EngineDeadError(msg.reason if isinstance(msg, CoreDead) else "the engine was shut down")
                for rid, q in list(self._queues.items()):
                    q.put_nowait(error)
                self.parents.clear()
                self._queues.clear()
                return

    def _process_core_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        for out in core_outputs.outputs:
            if out.error is not None:  # failed in the core (a grammar that did not compile)
                self._fail_engine_request(out.request_id, ValueError(out.error))
        outputs, to_abort = self.output_processor.process_outputs(
            [o for o in core_outputs.outputs if o.error is None])
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for ro in outputs:
            q = self._queues.get(ro.request_id)
            if q is not None:
                q.put_nowait(ro)
            if ro.finished:
                self.parents.pop(ro.request_id, None)
                self._queues.pop(ro.request_id, None)
                if self.metrics is not None:
                    self.metrics.on_finished(ro)
        op = self.output_processor
        if self.metrics is not None:
            self.metrics.on_step(core_outputs.scheduler_stats, op.num_prompt_tokens, op.num_generation_tokens)
        if self.stat_logger is not None:
            self.stat_logger.record(core_outputs.scheduler_stats, op.num_prompt_tokens, op.num_generation_tokens)

    def _fail_engine_request(self, engine_request_id: str, error: Exception) -> None:
        state = self.output_processor.states.get(engine_request_id)
        if state is None:
            return
        parent_id = state.parent.request_id
        q = self._queues.get(parent_id)
        self.abort(parent_id)  # its other samples too
        if q is not None:
            q.put_nowait(error)

    # ---- utilities --------------------------------------------------------------------------------
    @property
    def log_stats(self) -> bool:
        return self.stat_logger is not None

    def do_log_stats(self) -> None:
        """Write the stats line (throughput since the last one, queues, KV cache); quiet when idle."""
        if self.stat_logger is not None:
            self.stat_logger.log()

    async def get_stats(self) -> dict[str, Any]:
        """The core's KV cache and queue sizes: num_free_blocks, num_blocks, kv_cache_usage,
        num_running, num_waiting."""
        return await self._utility("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self._utility("reset_prefix_cache")

    # ---- RL rollout: the same calls as LLM, run in the core process ------------------------
    async def _utility(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.engine_core.call_utility(method, *args))

    async def sleep(self, level: int = 1) -> None:
        await self._utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._utility("is_sleeping")

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every worker (see LLM.collective_rpc). Arguments and results cross a
        process boundary: they must pickle (CPU tensors do)."""
        return await self._utility("collective_rpc", method, tuple(args), kwargs)

    async def start_profile(self) -> None:
        """LLM.start_profile: torch.profiler in every worker (PAGEDLLM_TORCH_PROFILER_DIR)."""
        check_profiling_on()
        await self.collective_rpc("start_profile")

    async def stop_profile(self) -> list[str | None]:
        """LLM.stop_profile: each worker writes its trace and summary; their paths, in rank order."""
        check_profiling_on()
        return await self.collective_rpc("stop_profile")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """LLM.update_weights: collective_rpc("load_weights"), the pairs listed to cross to the core."""
        await self.collective_rpc("load_weights", args=(list(named_tensors),))

    async def check_health(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if not self.engine_core.is_alive():
            raise EngineDeadError(self.engine_core.dead_reason or "the engine core process is not running")

    @property
    def is_running(self) -> bool:
        return not self._closed and self.engine_core.is_alive()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (given ``timeout_s`` to finish, then killed)."""
        if self._closed:
            return
        self._closed = True
        self.engine_core.shutdown(timeout_s)  # also wakes the reader thread with CoreClosed
        self._reader_pool.shutdown(wait=False)
