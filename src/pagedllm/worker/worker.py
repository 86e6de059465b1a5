"""Worker: one device — loads the model, sizes and owns the KV cache, runs steps."""
from __future__ import annotations

import gc
import logging

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.arg_utils import DEFAULT_CPU_KV_CACHE_BYTES
from pagedllm.worker.model_runner import _TORCH_DTYPES, ModelRunner

logger = logging.getLogger("pagedllm")


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model.loader import ResolvedModel, load_model

        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        mc = config.model_config
        torch.manual_seed(mc.seed)
        resolved = ResolvedModel(path=mc.path, gguf_file=mc.gguf_file, hf_config=mc.hf_config)
        model = load_model(resolved, mc.load_format, _TORCH_DTYPES[mc.dtype],
                           self.device, seed=mc.seed)
        self.model_runner = ModelRunner(config, model, self.device)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit: CPU from kv_cache_memory_bytes, GPU from gpu_memory_utilization
        after a profiling forward; num_gpu_blocks_override wins."""
        cc = self.config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device.type != "cuda":
            return max((cc.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block, 1)
        if cc.kv_cache_memory_bytes is not None:
            return max(cc.kv_cache_memory_bytes // per_block, 1)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        used_before = torch.cuda.memory_allocated(self.device)
        self.model_runner.profile_run(self.config.scheduler_config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak_activation = torch.cuda.max_memory_allocated(self.device) - used_before
        torch.cuda.empty_cache()
        # Memory other processes or non-torch allocations hold counts against the budget too.
        non_torch = (total - free_before) - torch.cuda.memory_reserved(self.device)
        budget = total * cc.gpu_memory_utilization - used_before - peak_activation - max(non_torch, 0)
        if budget < per_block:
            raise ValueError(
                f"no memory left for the KV cache: gpu_memory_utilization={cc.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB minus weights ({used_before / 2**30:.1f} GiB) and activations "
                f"({peak_activation / 2**30:.1f} GiB); raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return int(budget // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cuda" and not self.config.model_config.enforce_eager:
            self.model_runner.capture_cuda_graphs()

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        return self.model_runner.execute_model(sched, non_block)
