"""Every PAGEDLLM_* environment variable, defined once and read lazily (``envs.PAGEDLLM_X``).

Each read looks at ``os.environ`` now, so a variable set after import (a test's monkeypatch, a
worker's environment) is seen. ``python -m pagedllm.envs`` prints the README's table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # as the README shows it
    default: Any  # the value when unset (or empty)
    doc: str
    parse: Callable[[str], Any] = str  # the set (non-empty) text -> the value (None: the default)

    def read(self) -> Any:
        text = os.environ.get(self.name, "")
        value = self.parse(text) if text else None
        return self.default if value is None else value


def _is_one(text: str) -> bool:
    return text == "1"


def _not_zero(text: str) -> bool:
    return text != "0"


def _stripped_lower(text: str) -> str | None:
    return text.strip().lower() or None


def _stripped_upper(text: str) -> str | None:
    return text.strip().upper() or None


def _seconds(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    return parse


def _count(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {text!r}")
        return value
    return parse


_VARS = [
    EnvVar("PAGEDLLM_LOGGING_LEVEL", "str", "INFO", "Level of the `pagedllm` logger (DEBUG, INFO, WARNING, ...).",
           str.upper),
    EnvVar("PAGEDLLM_CONFIGURE_LOGGING", "bool (0 = off)", True,
           "0 leaves the `pagedllm` logger to the application's own logging config.", _not_zero),
    EnvVar("PAGEDLLM_LOG_STATS_INTERVAL", "float (s)", 10.0,
           "Seconds between the engine's stats log lines (vLLM's VLLM_LOG_STATS_INTERVAL).",
           _seconds("PAGEDLLM_LOG_STATS_INTERVAL")),
    EnvVar("PAGEDLLM_API_KEY", "str", None, "API key the server requires on `/v1/*` when `--api-key` is not given."),
    EnvVar("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "bool (1 = on)", False,
           "1 serves `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
           _is_one),
    EnvVar("PAGEDLLM_ATTENTION_BACKEND", "`torch` or `triton`", None,
           "Force an attention backend (default: triton on CUDA, torch elsewhere).", _stripped_lower),
    EnvVar("PAGEDLLM_CPU_ONEDNN_LINEAR", "bool (0 = off)", True,
           "0 runs CPU linears through `F.linear` (MKL) instead of oneDNN (docs/cpu_performance.md).", _not_zero),
    EnvVar("PAGEDLLM_CPU_PACKED_WEIGHTS", "bool (0 = off)", True,
           "0: CPU linears read the plain weights instead of copies prepacked in oneDNN's blocked layout "
           "(ops/cpu_linear.py; the packs cost a second copy of the weights, at most 1/8 of RAM).", _not_zero),
    EnvVar("PAGEDLLM_DEFER_GRAMMAR", "bool (0 = off)", True,
           "0: with async scheduling, a step with constrained rows lands before the next is launched, "
           "instead of the next step deferring its sampling until the masks are known (A/B measurements).",
           _not_zero),
    EnvVar("PAGEDLLM_CHAIN_STRINGS", "bool (0 = off)", True,
           "0 keeps xgrammar's own form of length-bounded JSON strings instead of chaining them "
           "(structured_output/xgrammar_strings.py; A/B measurements).", _not_zero),
    EnvVar("PAGEDLLM_LORA_PDL", "bool (0 = off)", True,
           "0: a decode step's LoRA shrink and the projection GEMM after it wait for the kernel before them to "
           "end before they start, instead of launching while it runs (programmatic dependent launch, "
           "ops/triton_lora.py; A/B measurements).",
           _not_zero),
    EnvVar("PAGEDLLM_MOE_PDL", "bool (0 = off)", True,
           "0: each fused-MoE kernel of a step (routing, pair alignment, the two expert GEMMs, the top-k sum) waits "
           "for the one before it to end before it launches, instead of launching while it runs (programmatic "
           "dependent launch, ops/triton_fused_moe.py; A/B measurements).", _not_zero),
    EnvVar("PAGEDLLM_LAMPORT_ALL_REDUCE", "bool (0 = off)", True,
           "0: two-GPU all-reduces of bf16 decode activations up to 1 MiB inside CUDA graphs take the one-shot "
           "kernels with a barrier (torch's, the Triton one) instead of the Lamport one-shot whose data is its own "
           "flag (distributed/triton_all_reduce.py; A/B measurements)."),
    EnvVar("PAGEDLLM_SHARDED_SAMPLING", "bool (0 = off)", True,
           "0: under tensor parallelism every step all-gathers the logits before sampling, instead of sampling "
           "temperature-only batches from each rank's vocabulary slice and exchanging the slices' winners "
           "(sample/sharded.py; A/B measurements)."),
    EnvVar("PAGEDLLM_DECODE_PDL", "bool (0 = off)", True,
           "0: the kernels of a layer's chain (the projections: 16-bit small-row GEMMs, FP8's activation "
           "quantization and GEMM, the W4A16 split-K GEMM; RMSNorm, rotary, the KV write, attention and its split "
           "merge, SiLU-and-mul) wait for the kernel before them to end before they launch, instead of launching "
           "while it runs (programmatic dependent launch, ops/triton_pdl.py; A/B measurements). W4A16 models "
           "launch early only in forwards of at most 8 tokens (model/quantization/int4.py).",
           _not_zero),
    EnvVar("PAGEDLLM_FUSED_ROTARY_KV", "bool (0 = off)", True,
           "0: the Triton attention backend's layers launch rotary (with Qwen3's q/k norm) and the KV write as "
           "two kernels instead of one (A/B measurements; the values are the same bit for bit).",
           _not_zero),
    EnvVar("PAGEDLLM_FP8_KV_F16_DOTS", "bool (0 = off)", True,
           "0: attention of bfloat16 queries over an fp8 KV cache widens K/V to bfloat16 for its dots (as the "
           "model dtype) instead of to float16, which takes one conversion instruction per pair of values "
           "instead of three (A/B measurements).",
           _not_zero),
    EnvVar("PAGEDLLM_FP8_NORM_QUANT", "bool (0 = off)", True,
           "0: an fp8 W8A8 projection with per-token activations quantizes its input with a launch of its own, "
           "instead of taking the rows the RMSNorm or SiLU-and-mul kernel before it quantized (model/loader.py; "
           "A/B measurements).",
           _not_zero),
    EnvVar("PAGEDLLM_PIECEWISE_GRAPH_TOKENS", "int", 2048,
           "Steps of up to this many tokens that carry a prefill chunk replay CUDA graphs captured in pieces "
           "between the attention calls, attention run eagerly between them (worker/piecewise_graphs.py); larger "
           "steps run eagerly. 0: every such step runs eagerly.", _count("PAGEDLLM_PIECEWISE_GRAPH_TOKENS")),
    EnvVar("PAGEDLLM_ATTENTION_SIDE_STREAM", "bool (0 = off)", True,
           "0: in a step that carries prefill chunks, the decodes' attention launch runs before the chunks' on the "
           "same CUDA stream instead of beside it on a second stream (attention/triton_kernels.py; A/B "
           "measurements).", _not_zero),
    EnvVar("PAGEDLLM_GLUON_PREFILL", "bool (0 = off)", True,
           "0: the prefill kernel's runs stay on its Triton kernel on Hopper too, instead of the warp-specialized "
           "Gluon kernel (attention/gluon_prefill.py; A/B measurements).", _not_zero),
    EnvVar("PAGEDLLM_PREFILL_KERNEL", "bool (0 = off)", True,
           "0: causal prefill chunks (query runs longer than a decode tile, no sliding window or soft cap) run in the "
           "unified paged-attention kernel's long tiles instead of the prefill kernel (attention/triton_prefill.py; "
           "A/B measurements).", _not_zero),
    EnvVar("PAGEDLLM_TORCH_PROFILER_DIR", "path", None,
           "Folder where LLM.start_profile() / stop_profile() write each worker's torch.profiler trace "
           "(rankN.trace.json) and a table of where its time went (rankN.txt); unset: profiling is off "
           "(vLLM's VLLM_TORCH_PROFILER_DIR)."),
    EnvVar("PAGEDLLM_SPEC_FORCE_ACCEPT", "bool (1 = on)", False,
           "Benchmarks only: speculative decoding accepts every draft (the machinery's ceiling; outputs are the "
           "draft's).", _is_one),
    EnvVar("PAGEDLLM_DISABLE_TRITON_OPS", "bool (1 = on)", False,
           "1 runs the torch reference of the fused ops (RMSNorm, SiLU-and-mul, rotary, GEMV) on CUDA too.",
           _is_one),
    EnvVar("PAGEDLLM_PARALLEL_COMPILE", "bool (0 = off)", True,
           "0 compiles the Triton kernels one after another in the engine process at start-up.", _not_zero),
    EnvVar("PAGEDLLM_CACHE_DIR", "path", None,
           "Cache folder for GGUF config, tokenizer and tensor tables, and the Triton kernels each start-up "
           "compiles (default: `$XDG_CACHE_HOME/pagedllm`, "
           "else `~/.cache/pagedllm`)."),
    EnvVar("PAGEDLLM_PP_LAYER_PARTITION", "str", None,
           "Layers per pipeline stage, comma-separated (e.g. `10,14`); default: as even as possible."),
    EnvVar("PAGEDLLM_WORKER_START_TIMEOUT_S", "float (s)", 600.0,
           "How long worker start-up (model load, KV sizing, Ray placement) may take (mp and ray executors).",
           _seconds("PAGEDLLM_WORKER_START_TIMEOUT_S")),
    EnvVar("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "`PACK`, `SPREAD`, `STRICT_PACK` or `STRICT_SPREAD`", "PACK",
           "Placement-group strategy of the ray executor's bundles (one per rank).", _stripped_upper),
    EnvVar("PAGEDLLM_COMMIT", "str", None,
           "Commit recorded in benchmark results when the tree has no git history."),
]
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def cache_root() -> str:
    """pagedllm's cache folder (PAGEDLLM_CACHE_DIR, else ``$XDG_CACHE_HOME/pagedllm`` or ``~/.cache/pagedllm``)."""
    return __getattr__("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module 'pagedllm.envs' has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *ENV_VARS])


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return f"`{default}`"


def markdown_table() -> str:
    """The README's table of environment variables."""
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for v in _VARS:
        rows.append(f"| `{v.name}` | {v.type} | {_shown(v.default)} | {v.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
