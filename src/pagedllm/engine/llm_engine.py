"""LLMEngine: the synchronous engine — processor, engine core and output processor in one loop."""
from __future__ import annotations

from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.core.messages import SchedulerStats
from pagedllm.engine.core import EngineCore
from pagedllm.engine.frontend import EngineFrontend
from pagedllm.engine.output_processor import register_request
from pagedllm.engine.stat_logger import LoggingStatLogger
from pagedllm.inputs import PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import freeze_gc_heap


class LLMEngine(EngineFrontend):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.engine_core = EngineCore(config)
        self.log_stats = config.log_stats
        self.last_stats: SchedulerStats | None = None
        self.stat_logger = LoggingStatLogger(device=config.device) if config.log_stats else None
        self._held_outputs: list[RequestOutput] = []  # a step's outputs held back by a request's error
        freeze_gc_heap()  # the frontend's objects too (tokenizer, processors)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
        arrival_time: float | None = None, priority: int = 0, lora_request: Any = None,
    ) -> None:
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params if params is not None else self.get_default_sampling_params()
        parent, core_reqs = register_request(self.processor, self.output_processor, request_id, prompt, params,
                                             arrival_time, priority, lora_request)
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
        if self._held_outputs:
            self._held_outputs = [ro for ro in self._held_outputs if ro.request_id not in set(request_ids)]
        engine_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                engine_ids.extend(c.request_id for c in parent.children)
        self.output_processor.abort_requests(engine_ids)
        self.engine_core.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs. A request that failed in the core (its grammar did not
        compile) is aborted with its other samples and raises ValueError here; the step's other
        outputs come with the next call."""
        if self._held_outputs:
            held, self._held_outputs = self._held_outputs, []
            return held
        core_out = self.engine_core.step()
        errors = [o for o in core_out.outputs if o.error is not None]
        outputs, to_abort = self.output_processor.process_outputs(
            [o for o in core_out.outputs if o.error is None] if errors else core_out.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for ro in outputs:
            if ro.finished:
                self.parents.pop(ro.request_id, None)
        self.last_stats = core_out.scheduler_stats
        if self.stat_logger is not None:
            op = self.output_processor
            self.stat_logger.record(core_out.scheduler_stats, op.num_prompt_tokens, op.num_generation_tokens)
            self.stat_logger.maybe_log()
        if errors:
            failed = self._fail(errors)
            self._held_outputs = [ro for ro in outputs if ro.request_id not in failed]
            raise ValueError(errors[0].error)
        return outputs

    def _fail(self, errors: list) -> set[str]:
        """Abort the parents of the engine requests that failed in the core; returns their ids."""
        parents = set()
        for out in errors:
            state = self.output_processor.states.get(out.request_id)
            if state is not None:
                parents.add(state.parent.request_id)
        self.abort_request(sorted(parents))
        return parents

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents or self._held_outputs) or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # ---- RL rollout (vLLM's names) ----------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if self.parents:
            raise ValueError(f"cannot sleep with {len(self.parents)} unfinished request(s); finish or abort them first")
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    # ---- LoRA adapters at runtime (vLLM's engine methods) ------------------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Check and load an adapter (from its path, or in memory: ``tensors`` + ``peft_config``);
        an adapter in memory replaces the one of its id (a trainer's fresh weights). Replacing
        resets the prefix cache: KV computed under the old weights is never reused."""
        replaced = self.processor.knows_lora(lora_request.lora_int_id)
        self.processor.check_lora(lora_request, replace=True)
        ok = all(self.collective_rpc("add_lora", args=(lora_request,)))
        if replaced:
            self.engine_core.reset_prefix_cache()
        return ok

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter; its id may then name another one (the prefix cache is reset with it)."""
        self.processor.forget_lora(lora_id)
        ok = all(self.collective_rpc("remove_lora", args=(lora_id,)))
        self.engine_core.reset_prefix_cache()
        return ok

    def pin_lora(self, lora_id: int) -> bool:
        return all(self.collective_rpc("pin_lora", args=(lora_id,)))

    def list_loras(self) -> set[int]:
        return self.collective_rpc("list_loras")[0]

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.engine_core.collective_rpc(method, args, kwargs)
