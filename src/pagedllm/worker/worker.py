"""Worker: one device — loads the model, sizes and owns the KV cache, runs steps."""
from __future__ import annotations

import gc
import logging
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from pagedllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.ops.precompile import hash_triton_in_background, precompile, precompile_available
from pagedllm.model.eagle import EagleLlamaHead
from pagedllm.model.eagle3 import Eagle3LlamaHead
from pagedllm.model.loader import TORCH_DTYPES, ResolvedModel, load_model
from pagedllm.model.quantization.int4 import chain_pdl_max_rows
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.profiler import WorkerProfiler
from pagedllm.worker.spec_draft import draft_scope

logger = logging.getLogger("pagedllm")


class Worker:
    """One rank of ``world_size = pipeline_parallel_size x tensor_parallel_size``: ``rank`` picks
    its pipeline stage and tensor slice of the model (rank = pp_rank * tp + tp_rank), and it
    joins the groups at ``distributed_init_method``. ``local_rank`` picks its GPU among those
    visible to this process (``cuda:local_rank``; default: ``rank``, one host)."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None,
                 local_rank: int | None = None) -> None:
        from pagedllm.distributed import init_distributed

        self.config = config
        self.rank = rank
        pc = config.parallel_config
        self.device = torch.device(config.device)
        triton_hash = None
        if self.device.type == "cuda":
            triton_hash = hash_triton_in_background()  # overlaps CUDA init and the model's loading
            if pc.device_ids is not None:
                self.device = torch.device("cuda", pc.device_ids[rank])
            elif pc.world_size > 1:
                self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            elif self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if pc.world_size > 1:
            if distributed_init_method is None:
                raise ValueError("a world size > 1 needs a distributed_init_method for the process groups")
            init_distributed(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, distributed_init_method,
                             backend="nccl" if self.device.type == "cuda" else "gloo",
                             enable_expert_parallel=pc.enable_expert_parallel,
                             custom_all_reduce_device=None if pc.disable_custom_all_reduce else self.device)
        mc = config.model_config
        torch.manual_seed(mc.seed)
        resolved = ResolvedModel(path=mc.path, gguf_file=mc.gguf_file, hf_config=mc.hf_config)
        model = load_model(resolved, mc.load_format, TORCH_DTYPES[mc.dtype],
                           self.device, seed=mc.seed, max_model_len=mc.max_model_len, convert=mc.convert,
                           quantization=mc.quantization)
        draft = None
        if config.draft_model_config is not None:  # speculative decoding's draft, sharded as the target or whole
            dmc = config.draft_model_config
            head_cls = {"eagle": EagleLlamaHead, "eagle3": Eagle3LlamaHead}.get(config.speculative_config.method)
            with draft_scope(config):
                draft = load_model(ResolvedModel(path=dmc.path, gguf_file=dmc.gguf_file, hf_config=dmc.hf_config),
                                   dmc.load_format, TORCH_DTYPES[dmc.dtype], self.device, seed=mc.seed,
                                   max_model_len=mc.max_model_len, quantization=dmc.quantization, model_cls=head_cls)
            if head_cls is not None:  # the head reads the target's embedding (EAGLE-1: and LM head)
                draft.share_target(model)
        self.model_runner = ModelRunner(config, model, self.device, draft)
        if self.device.type == "cuda":  # which forwards launch their kernels early (PDL), by the quantization
            from pagedllm.ops.triton_pdl import set_chain_max_rows

            set_chain_max_rows(chain_pdl_max_rows(model))
        if triton_hash is not None:
            triton_hash.join()  # one hash: a kernel lookup before it ends would start its own
        if self.device.type == "cuda" and precompile_available():
            precompile(self.model_runner.compile_dry_run, self.device, pc.world_size, self._start_up_key())
        self.num_kv_blocks = 0
        self._weights_asleep: _SleepingWeights | None = None
        self._kv_cache_asleep = False
        self._profiler: WorkerProfiler | None = None

    def _start_up_key(self) -> str:
        """What decides the Triton kernels this rank's start-up compiles besides the code
        (``precompile.jobs_file``): the config, the GPU and the rank."""
        name, capability = torch.cuda.get_device_name(self.device), torch.cuda.get_device_capability(self.device)
        return f"{name}|{capability}|rank {self.rank}|{config_text(self.config)}"

    def kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit: CPU from kv_cache_memory_bytes, GPU from gpu_memory_utilization
        after a profiling forward; num_gpu_blocks_override wins. An encoder keeps nothing
        between steps: one step's prompts are all its blocks ever hold."""
        blocks = self._blocks_that_fit()
        mc, sc = self.config.model_config, self.config.scheduler_config
        if mc.is_encoder and self.config.cache_config.num_gpu_blocks_override is None:
            bs = self.config.cache_config.block_size
            blocks = min(blocks, -(-sc.max_num_batched_tokens // bs) + sc.max_num_seqs)
        return blocks

    def _profiles_memory(self) -> bool:
        """Whether the KV cache is sized by a profiling forward (on GPU, no size given)."""
        cc = self.config.cache_config
        return self.device.type == "cuda" and cc.num_gpu_blocks_override is None and cc.kv_cache_memory_bytes is None

    def _blocks_that_fit(self) -> int:
        cc = self.config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if not self._profiles_memory():
            return max((cc.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block, 1)
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
        self.num_kv_blocks = num_blocks  # sleep mode rebuilds the same cache on wake_up
        self.model_runner.initialize_kv_cache(num_blocks)
        if self._profiles_memory():
            # The largest step once more, the cache now allocated: sizing it released profiling's
            # activation memory, and the first long prefills of a run then waited on cudaMalloc
            # (GPU idle ~0.3 s of an H100 throughput run); the caching allocator keeps these blocks.
            # Only where profiling sized the cache: then its budget left this forward room.
            self.model_runner.profile_run(self.config.scheduler_config.max_num_batched_tokens)
        if self.device.type == "cuda":
            self.model_runner.warm_up_kernels()
            if not self.config.model_config.enforce_eager:
                self.model_runner.capture_cuda_graphs()

    def execute_model(self, sched: SchedulerOutput, non_block: bool = False):
        return self.model_runner.execute_model(sched, non_block)

    def sample_tokens(self, grammar, non_block: bool = False):
        """Sample the step launched with ``defer_grammar``, under ``grammar``'s masks."""
        return self.model_runner.sample_tokens(grammar, non_block)

    # ---- LoRA adapters (LLM.add_lora / remove_lora / pin_lora / list_loras) -----------------
    def _lora(self):
        if self.model_runner.lora is None:
            raise ValueError("LoRA is not enabled: create the engine with enable_lora=True")
        return self.model_runner.lora

    def add_lora(self, lora_request) -> bool:
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().list()

    # ---- RL rollout: weight updates and sleep mode -----------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the live parameters (fused q/k/v and gate/up included);
        returns the parameter names fully loaded. Copies in place: CUDA graphs stay valid."""
        if self._weights_asleep is not None:
            raise ValueError("the weights are asleep; call wake_up(tags=['weights']) before loading weights")
        quantization = self.config.model_config.quantization
        if quantization is not None:
            raise ValueError(f"loading weights into a running model is not supported with quantization={quantization!r} "
                             "(its layers hold the processed quantized layout)")
        with torch.no_grad():
            loaded = self.model_runner.model.load_weights(weights)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loaded

    def start_profile(self) -> None:
        """Start a torch.profiler session in this worker (PAGEDLLM_TORCH_PROFILER_DIR must be set)."""
        if self._profiler is None:
            self._profiler = WorkerProfiler(self.rank, self.device)
        self._profiler.start()

    @property
    def profiling(self) -> bool:
        """A start_profile() session is running (the serving loop then marks its phases)."""
        return self._profiler is not None and self._profiler.active

    def stop_profile(self) -> str | None:
        """End it; writes this rank's trace and summary, returns the summary's path (None: none ran)."""
        return self._profiler.stop() if self._profiler is not None else None

    def sleep(self, level: int) -> None:
        """Level 1: weights to (pinned) host memory, KV cache freed. Level 2: both freed."""
        runner = self.model_runner
        runner.free_kv_cache()
        self._kv_cache_asleep = True
        self._weights_asleep = _SleepingWeights.offload(runner.model, self.device, keep_contents=level == 1)
        self._release_device_memory()

    def wake_up(self, tags: list[str]) -> None:
        """Restore ``tags`` ("weights", "kv_cache"); CUDA graphs are re-captured once both are back."""
        if "weights" in tags and self._weights_asleep is not None:
            self._weights_asleep.restore(self.device)
            self._weights_asleep = None
        if "kv_cache" in tags and self._kv_cache_asleep:
            self.model_runner.initialize_kv_cache(self.num_kv_blocks)
            self._kv_cache_asleep = False
        if self._weights_asleep is None and not self._kv_cache_asleep and self.device.type == "cuda" \
                and not self.config.model_config.enforce_eager and not self.model_runner.cuda_graphs:
            self.model_runner.capture_cuda_graphs()

    def _release_device_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


class _SleepingWeights:
    """The model's parameters while asleep: each parameter's ``.data`` swapped for an empty
    tensor (the nn.Parameter objects, and their weight_loader attributes, stay), with the
    contents in one flat host buffer (level 1) or dropped (level 2). Parameters that share
    storage (tied embeddings) are saved once and come back sharing one tensor."""

    _ALIGN = 256

    def __init__(self, params: list[tuple[nn.Parameter, int]], layout: dict[int, tuple], host: torch.Tensor | None):
        self.params = params  # (parameter, key of its storage)
        self.layout = layout  # key -> (shape, stride-free dtype, byte offset in host)
        self.host = host

    @classmethod
    def offload(cls, model: nn.Module, device: torch.device, keep_contents: bool) -> "_SleepingWeights":
        params: list[tuple[nn.Parameter, int]] = []
        layout: dict[int, tuple] = {}
        originals: dict[int, torch.Tensor] = {}
        offset = 0
        seen: set[int] = set()
        for _, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            key = param.data.data_ptr()
            params.append((param, key))
            if key not in layout:
                data = param.data
                layout[key] = (tuple(data.shape), data.dtype, offset)
                originals[key] = data
                offset += -(-data.numel() * data.element_size() // cls._ALIGN) * cls._ALIGN
        host = None
        if keep_contents:
            host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
            for key, (shape, dtype, start) in layout.items():
                cls._view(host, shape, dtype, start).copy_(originals[key], non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        for param, _ in params:
            param.data = torch.empty(0, dtype=param.dtype, device=device)
        return cls(params, layout, host)

    @staticmethod
    def _view(host: torch.Tensor, shape: tuple, dtype: torch.dtype, start: int) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return host[start:start + nbytes].view(dtype).view(shape)

    def restore(self, device: torch.device) -> None:
        """Fresh device storage for every parameter: the saved contents (level 1) or, after
        level 2, undefined values that a weight update must overwrite."""
        restored: dict[int, torch.Tensor] = {}
        for key, (shape, dtype, start) in self.layout.items():
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if self.host is not None:
                tensor.copy_(self._view(self.host, shape, dtype, start), non_blocking=True)
            restored[key] = tensor
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for param, key in self.params:
            param.data = restored[key]
        self.host = None


def config_text(config: EngineConfig) -> str:
    """The config as text without the model's paths: a temporary or moved model folder compiles
    the same kernels (the longest path first, so a folder inside a file's path is not left half)."""
    text = repr(config)
    models = [config.model_config, config.draft_model_config]
    paths = {v for mc in models if mc is not None for v in (mc.model, mc.path, mc.gguf_file, mc.tokenizer)
             if isinstance(v, str) and len(v) > 1}
    for path in sorted(paths, key=len, reverse=True):
        text = text.replace(path, "<model>")
    return text
