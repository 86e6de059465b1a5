"""Resolved engine configuration: what EngineArgs turn into once the model is known."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any


# KV cache of a CPU engine when kv_cache_memory_bytes is not given (a GPU one sizes it by profiling).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30

# generation_config.json keys that become default SamplingParams (vLLM's list).
_GENERATION_CONFIG_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass
class ModelConfig:
    model: str  # as given by the user
    path: str  # local folder holding config / weights / tokenizer
    gguf_file: str | None
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "float16" | "bfloat16", resolved from "auto" for the device
    max_model_len: int
    load_format: str
    seed: int
    tokenizer: str | None
    tokenizer_mode: str
    trust_remote_code: bool
    revision: str | None
    skip_tokenizer_init: bool
    max_logprobs: int
    generation_config: str
    override_generation_config: dict = field(default_factory=dict)
    enforce_eager: bool = False
    enable_sleep_mode: bool = False  # LLM.sleep / wake_up may free and restore weights and KV cache
    enable_return_routed_experts: bool = False  # CompletionOutput.routed_experts (MoE models)
    # "generate" or "pooling" (vLLM's runner); a pooling model's pooler settings, and how a
    # generative checkpoint was converted ("embed" | "classify" | "reward"; "none": it is one).
    runner_type: str = "generate"
    convert: str = "none"
    pooler_config: "PoolerConfig | None" = None
    pooling_kind: str | None = None  # a pooling model's head: "embed" | "classify" | "reward"
    is_encoder: bool = False  # bidirectional attention (BERT, XLM-R): whole prompts, no KV kept
    # The linear layers' weight quantization (pagedllm.model.quantization), resolved from the
    # engine arg and the checkpoint's quantization_config; None: dense weights.
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Each decoder layer's sliding window (None: full attention), by the rule of
        ``model.llama._sliding_window``: ``layer_types`` where the config lists them (Gemma 2/3,
        Qwen2, transformers 5), else ``use_sliding_window``."""
        c = self.hf_config
        num_layers = getattr(c, "num_hidden_layers", None) or 0
        window = getattr(c, "sliding_window", None) or None
        layer_types = getattr(c, "layer_types", None)
        if window is None:
            return [None] * num_layers
        if layer_types is not None:
            return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]
        return [window if getattr(c, "use_sliding_window", True) else None] * num_layers

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window every attention layer has, or None when some layer attends to the whole
        context (or the layers' windows differ)."""
        windows = set(self.layer_sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    @functools.cached_property
    def generation_config_dict(self) -> dict[str, Any]:
        """The raw generation_config.json as vLLM reads it ('auto': the model's; a folder: that
        one's; 'vllm': none), with override_generation_config applied on top."""
        raw: dict[str, Any] = {}
        folder = {"auto": self.path, "vllm": None}.get(self.generation_config, self.generation_config)
        if folder is not None:
            path = os.path.join(folder, "generation_config.json")
            if os.path.isfile(path):
                with open(path) as f:
                    raw = json.load(f)
            elif self.generation_config not in ("auto", "vllm"):
                raise ValueError(f"generation_config={self.generation_config!r} has no generation_config.json")
        raw.update(self.override_generation_config)
        return raw

    def default_sampling_overrides(self) -> dict[str, Any]:
        raw = self.generation_config_dict
        # A null in the file means "not set" (vLLM skips None values too).
        return {ours: raw[theirs] for theirs, ours in _GENERATION_CONFIG_KEYS.items() if raw.get(theirs) is not None}

    def generation_eos_token_ids(self) -> set[int]:
        eos = self.generation_config_dict.get("eos_token_id")
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)


POOLING_TYPES = ("LAST", "CLS", "MEAN", "ALL", "STEP")


@dataclass
class PoolerConfig:
    """How a pooling model turns hidden states into its output (vLLM's ``pooler_config``):
    ``pooling_type`` picks the tokens (LAST, CLS: the first, MEAN, ALL, STEP: those equal to
    ``step_tag_id``); ``use_activation`` normalises embeddings, softmaxes (or, one label,
    sigmoids) class logits; ``dimensions``: the output size a Matryoshka model allows
    truncating to (None: only its full size)."""

    pooling_type: str | None = None  # None: the task's default for the model
    use_activation: bool | None = None
    dimensions: int | None = None
    matryoshka_dimensions: list[int] | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    enable_chunked_processing: bool | None = None  # accepted for vLLM's configs

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "PoolerConfig":
        values = dict(values or {})
        for old in ("normalize", "softmax", "activation"):  # vLLM's older names of use_activation
            if old in values:
                v = values.pop(old)
                if values.get("use_activation") is None:
                    values["use_activation"] = v
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown pooler_config key(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**values)
        if cfg.pooling_type is not None:
            cfg.pooling_type = str(cfg.pooling_type).upper()
            if cfg.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type must be one of {list(POOLING_TYPES)}, "
                                 f"got {values['pooling_type']!r}")
        return cfg


# EngineArgs.kv_cache_dtype -> CacheConfig.cache_dtype ("fp8" is e4m3, as in vLLM).
_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def resolve_kv_cache_dtype(kv_cache_dtype: str, calculate_kv_scales: bool) -> str:
    """The cache dtype of the ``kv_cache_dtype`` engine arg ("fp8_e4m3" for "fp8"), checking both args."""
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(_KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if not isinstance(calculate_kv_scales, bool):
        raise ValueError(f"calculate_kv_scales must be True or False, got {calculate_kv_scales!r}")
    return _KV_CACHE_DTYPES[kv_cache_dtype]


@dataclass
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    # "auto": the model dtype; "fp8_e4m3" / "fp8_e5m2": one byte per element, dequantized by a
    # per-layer K and V scale (attention/kv_quant.py). EngineArgs resolves "fp8" to "fp8_e4m3".
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # the scales from the first step's K/V instead of 1.0 / the checkpoint's

    @property
    def fp8_kv_cache(self) -> bool:
        return self.cache_dtype != "auto"


@dataclass
class SchedulerConfig:
    """How the scheduler fills each step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    # Schedule step N+1 while step N runs: a decode's next input is its in-flight token
    # (a placeholder here, taken from the device by the worker).
    async_scheduling: bool = False
    # Pipeline parallelism: up to this many steps in flight at once (one per stage). A request
    # whose token is in flight sits out until it lands; the others fill the next step.
    max_concurrent_batches: int = 1
    # LoRA: the distinct adapters one step may run (the runner's device slots); None: no LoRA.
    max_loras: int | None = None
    # A draft model writes this many guesses past a step's tokens: their KV slots are allocated too.
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_concurrent_batches > 1 and self.async_scheduling:
            raise ValueError("async_scheduling cannot be combined with pipeline parallelism "
                             "(max_concurrent_batches > 1): the stages before the last never see the device tokens")

    @property
    def tracks_in_flight(self) -> bool:
        """Tokens of steps not yet read are counted as placeholders on their requests."""
        return self.async_scheduling or self.max_concurrent_batches > 1


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni": in the engine core's process; "mp": one process per rank on this host; "ray": Ray actors
    distributed_executor_backend: str = "uni"
    device_ids: tuple[int, ...] | None = None  # each rank's GPU among the visible ones (None: rank r on GPU r)
    # MoE layers: each tensor rank holds num_experts / tp whole experts instead of every expert's slice.
    enable_expert_parallel: bool = False
    # Tensor-parallel all-reduces on GPUs: small ones through peer memory (custom_all_reduce), unless
    # this is set (vLLM's flag); NCCL for the rest.
    disable_custom_all_reduce: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose ModelRunnerOutput the engine reads: tensor rank 0 of the last
        pipeline stage (ranks are numbered pipeline-stage-major: rank = pp_rank * tp + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


_SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
_SPEC_METHODS_PLANNED = ("medusa", "mtp")
SPEC_METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3")  # the workers hold a second network that proposes


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config``: a proposer guesses the next k tokens, one target step
    verifies them (exact greedy; rejection sampling keeps the target distribution)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # n-gram: the shortest suffix looked up in the request's tokens
    prompt_lookup_max: int = 3  # n-gram: the longest (tried first)
    disable_by_batch_size: int | None = None  # steps with more running requests do not speculate
    model: str | None = None  # draft_model: a smaller model with the target's vocabulary; eagle, eagle3: the head
    # draft_model: None or the target's (the draft shards alike), or 1 (every rank runs the whole draft)
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None  # accepted for vLLM's configs; the target's applies

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        values = dict(values)
        if values.get("model") in ("[ngram]", "ngram"):  # vLLM's older spelling of the method
            values.pop("model")
            values.setdefault("method", "ngram")
        method = values.get("method", "ngram" if "model" not in values else _model_method(str(values["model"])))
        values.setdefault("method", method)
        if method in _SPEC_METHODS_PLANNED:
            raise ValueError(f"speculative_config method {method!r} is not supported yet; supported: "
                             f"{list(_SPEC_METHODS)}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(_SPEC_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.method in SPEC_METHODS_WITH_MODEL and not self.model:
            what = "the draft's" if self.method == "draft_model" else "the EAGLE-3 head's" if self.method == "eagle3" \
                else "the EAGLE head's"
            raise ValueError(f"speculative_config method {self.method!r} needs model ({what} path or id)")
        if self.method == "ngram" and self.model:
            raise ValueError(f"speculative_config method 'ngram' takes no model, got {self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} is more than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        v = self.disable_by_batch_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer or None, got {v!r}")


def _model_method(model: str) -> str:
    """vLLM's guess when speculative_config names a model but no method: EAGLE heads by name (the
    last path part only: a folder called eagle above a draft model does not make it a head)."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    return "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"


@dataclass
class LoRAConfig:
    """``enable_lora`` engines: device slots, the largest rank, the host cache (vLLM's names)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # "auto": the model's dtype

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras!r}")
        if self.lora_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"lora_dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.lora_dtype!r}")


_STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    """How constrained requests compile (vLLM's ``structured_outputs_config``, plus the safety
    limits vLLM lacks: a hostile schema must fail its request, never stall the engine)."""

    backend: str = "auto"  # "auto": xgrammar, or llguidance where xgrammar refuses the constraint
    compile_timeout_s: float = 5.0  # a compile that takes longer fails its request
    max_spec_bytes: int = 64 << 10  # a schema / regex / grammar larger than this is refused
    max_nesting_depth: int = 32  # a JSON schema nested deeper than this is refused
    max_compile_threads: int = 2  # the compile pool's threads
    max_fill_threads: int = 8  # threads filling one step's masks (xgrammar's batch fill, llguidance's executor), at most the CPUs
    disable_fallback: bool = False  # "auto" never falls back to llguidance
    # With a reasoning parser (vLLM's field; ``serve --reasoning-parser`` sets it) a constraint
    # applies to the answer: from the token that ends the reasoning on, unless enable_in_reasoning.
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _STRUCTURED_BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {list(_STRUCTURED_BACKENDS)}, "
                             f"got {self.backend!r}")
        if isinstance(self.compile_timeout_s, bool) or not isinstance(self.compile_timeout_s, (int, float)) \
                or not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config compile_timeout_s must be a number > 0, got "
                             f"{self.compile_timeout_s!r}")
        for name in ("max_spec_bytes", "max_nesting_depth", "max_compile_threads", "max_fill_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"structured_outputs_config {name} must be a positive integer, got {v!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "StructuredOutputsConfig":
        values = dict(values or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str  # "cpu" | "cuda" | "cuda:N"
    log_stats: bool = False
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
    draft_model_config: ModelConfig | None = None  # speculative_config method draft_model: the draft
