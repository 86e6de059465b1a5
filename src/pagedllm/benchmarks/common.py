"""Shared pieces of the benchmarks: model shapes, engine-arg parsing, result lines and tables."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence

from pagedllm import envs

# docs/benchmarks.md model shapes, as config.json files written on the fly (dummy weights).
SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
        hidden_act="silu", dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
    ),
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072,
        hidden_act="silu", dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # A draft for llama3-8b (speculative decoding): the same vocabulary.
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072,
        hidden_act="silu", dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # Issue 16's MoE shape: 128 experts top-8 (3B of 30B parameters active per token).
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu", dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Small enough for a 2-core CPU smoke run of the same code path.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=768, vocab_size=32000,
        tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096,
        hidden_act="silu", dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
    "tiny-qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768, moe_intermediate_size=128,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=32000, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=4096, hidden_act="silu", dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
}


def story_chat(i: int) -> list[dict]:
    """Workload 5's (and workload 6's) chat number ``i`` (docs/benchmarks.md)."""
    return [{"role": "user", "content": f"Write a short story about item {i}"}]


def write_shape(shape: str, tokenizer_dir: str | None = None, **overrides) -> str:
    """A temporary model folder: the shape's config.json (with ``overrides``), plus the
    tokenizer files of ``tokenizer_dir`` when given (the server needs a tokenizer)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    folder = tempfile.mkdtemp(prefix=f"pagedllm-{shape}-")
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            if name != "config.json" and not name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
                src = os.path.join(tokenizer_dir, name)
                if os.path.isfile(src):
                    shutil.copy(src, folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**SHAPES[shape], **overrides}, f)
    return folder


# --quantization of the benchmarks: the config.json quantization_config a dummy shape carries
# (dummy packed weights, as such a checkpoint holds them), or None where the engine quantizes
# the shape's 16-bit weights at load ("fp8": per-channel weights, dynamic per-token activations).
QUANTIZATIONS = {
    "fp8": None,
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 128}}}},
}


def quantization_setup(quantization: str | None) -> tuple[dict, str | None]:
    """(config.json overrides for the dummy shape, the engine's ``quantization`` argument)."""
    if quantization is None:
        return {}, None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r} is not one of {sorted(QUANTIZATIONS)}")
    qc = QUANTIZATIONS[quantization]
    return ({}, quantization) if qc is None else ({"quantization_config": qc}, None)


def _linear_bytes(n: int, k: int, itemsize: int, quant: dict | None) -> int:
    """Bytes of an [n, k] projection's parameters as the engine holds them after loading."""
    if quant is None:
        return n * k * itemsize
    method = quant["quant_method"]
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block:
            return n * k + -(-n // block[0]) * -(-k // block[1]) * 4  # fp8 weight, float32 block scales
        return n * k + n * 4 + (4 if quant.get("activation_scheme") == "static" else 0)  # per-channel scales
    group, symmetric, scale_size = _int4_params(quant, itemsize)
    zeros = 0 if symmetric else (k // group) * n // 2
    return n * k // 2 + (k // group) * n * scale_size + zeros  # packed int4, scales, packed zero points


def _int4_params(quant: dict, itemsize: int) -> tuple[int, bool, int]:
    """(group size, symmetric, scale bytes) of an int4 format's config."""
    if quant["quant_method"] == "compressed-tensors":
        weights = next(iter(quant["config_groups"].values()))["weights"]
        return weights["group_size"], weights.get("symmetric", True), itemsize
    # AWQ / GPTQ keep their float16 scales
    return quant["group_size"], quant["quant_method"] == "gptq" and quant.get("sym", True), 2


def _expert_bytes(n: int, k: int, itemsize: int, quant: dict) -> int:
    """One expert projection as ``FusedMoE`` holds it: as a linear, except that int4 zero points
    are kept unpacked (one byte per row and group) for the fused-MoE kernels."""
    total = _linear_bytes(n, k, itemsize, quant)
    if quant["quant_method"] == "fp8":
        return total
    group, symmetric, _ = _int4_params(quant, itemsize)
    return total if symmetric else total + (k // group) * n - (k // group) * n // 2


def _rank_heads(config: dict, tp: int) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim) one of ``tp`` tensor-parallel ranks holds: K/V heads
    split while there are at least ``tp`` of them, else one replicated per rank."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads // tp, max(1, kv_heads // tp), head_dim


def weight_bytes(config: dict, itemsize: int = 2, active_only: bool = False, quantization: str | None = None,
                 tokens: int = 1, tp: int = 1) -> int:
    """Parameter bytes of a Llama-family or Qwen3-MoE shape: embeddings, layers, final norm, lm_head
    if untied. ``active_only``: what ``tokens`` tokens read (of each MoE layer only the experts
    they pick: ``expected_experts``).
    Quantized projections (``config["quantization_config"]``, or ``quantization="fp8"`` online)
    count their packed weights, scales and zero points; embeddings, norms and the LM head stay
    in the model dtype. ``tp`` > 1: what one tensor-parallel rank holds (projections, experts,
    vocabulary split ``tp`` ways; norms and the MoE router whole; ``_rank_heads``)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = _rank_heads(config, tp)
    quant = config.get("quantization_config") or (
        {"quant_method": "fp8", "activation_scheme": "dynamic"} if quantization == "fp8" else None)
    attn = (_linear_bytes((heads + 2 * kv_heads) * head_dim, hidden, itemsize, quant)
            + _linear_bytes(hidden, heads * head_dim, itemsize, quant))
    norms = 2 * hidden + (2 * head_dim if config["model_type"] in ("qwen3", "qwen3_moe") else 0)
    params = -(-vocab // tp) * hidden * (1 if config.get("tie_word_embeddings") else 2) + hidden
    total = 0  # bytes of the projections
    for layer in range(config["num_hidden_layers"]):
        params += norms
        total += attn
        if quant is not None and _moe_layer(config, layer):  # quantized experts, the router dense
            moe_inter = config["moe_intermediate_size"] // tp
            expert = _expert_bytes(2 * moe_inter, hidden, itemsize, quant) + _expert_bytes(hidden, moe_inter, itemsize, quant)
            total += round(_used_experts(config, active_only, tokens) * expert)
            params += config["num_experts"] * hidden
        elif quant is not None:
            total += (_linear_bytes(2 * inter // tp, hidden, itemsize, quant)
                      + _linear_bytes(hidden, inter // tp, itemsize, quant))
        else:
            params += _mlp_params(config, layer, active_only, tokens, tp)
    return params * itemsize + total


def step_read_bytes(config: dict, itemsize: int, batch: int, context_len: float, kv_itemsize: int | None = None,
                    quantization: str | None = None, tp: int = 1) -> int:
    """Every byte one decode step of ``batch`` requests reads: the weights (quantized ones packed,
    with their scales and zero points; of each MoE layer the experts ``batch`` tokens are expected
    to pick, ``expected_experts``), of the embedding table only the ``batch`` rows looked up, and each
    request's K/V over ``context_len`` tokens (``kv_itemsize``: the cache's bytes per value, the
    model's by default). ``tp`` > 1: what one of the tensor-parallel ranks reads (they read at once)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    _, kv_heads, head_dim = _rank_heads(config, tp)
    table = -(-vocab // tp) * hidden * itemsize  # the embedding (tied: also the LM head, read whole)
    weights = weight_bytes(config, itemsize, active_only=True, quantization=quantization, tokens=batch, tp=tp)
    if not config.get("tie_word_embeddings"):
        weights -= table
    kv = config["num_hidden_layers"] * 2 * kv_heads * head_dim * (kv_itemsize or itemsize) * context_len
    return int(weights + batch * hidden * itemsize + batch * kv)


def kv_bytes_per_token(config: dict, kv_itemsize: int, tp: int = 1) -> int:
    """K and V bytes one token of context holds over all layers (what each decode step re-reads);
    ``tp`` > 1: on one tensor-parallel rank."""
    _, kv_heads, head_dim = _rank_heads(config, tp)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * kv_itemsize


def kv_itemsize(kv_cache_dtype: str, model_itemsize: int) -> int:
    """Bytes per cached K/V element: 1 for the fp8 caches, else the model dtype's."""
    return 1 if kv_cache_dtype.startswith("fp8") else model_itemsize


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """How many distinct experts ``tokens`` tokens pick on average, each its ``top_k`` of
    ``num_experts`` uniformly (as random router weights route): E * (1 - (1 - k/E) ** T). One
    token: k; qwen3-30b-a3b's 128 experts top-8 at 32 tokens: 111.8, each read once a step."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def _moe_layer(config: dict, layer: int) -> bool:
    return bool(config.get("num_experts")) and layer not in config.get("mlp_only_layers", []) \
        and not (layer + 1) % config["decoder_sparse_step"]


def _used_experts(config: dict, active_only: bool, tokens: int) -> float:
    experts = config["num_experts"]
    return expected_experts(experts, config["num_experts_per_tok"], tokens) if active_only else experts


def _mlp_params(config: dict, layer: int, active_only: bool, tokens: int = 1, tp: int = 1) -> int:
    hidden, experts = config["hidden_size"], config.get("num_experts", 0)
    if not _moe_layer(config, layer):
        return 3 * hidden * (config["intermediate_size"] // tp)
    used = _used_experts(config, active_only, tokens)
    # Each rank holds 1/tp of every expert (or, with expert parallelism, 1/tp of the experts whole:
    # the same bytes in expectation), and the router whole.
    return round(used * 3 * hidden * config["moe_intermediate_size"] / tp) + experts * hidden


def release_engines() -> None:
    """After ``del llm``: collect what still refers to it in cycles and hand its device memory
    back, so that the next engine in this process sizes its KV cache from a free device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_engine_args(text: str) -> dict:
    """``k=v,k=v`` → EngineArgs keyword arguments (integers, floats and true/false parsed)."""
    extra: dict = {}
    for kv in filter(None, text.split(",")):
        if "=" not in kv:
            raise ValueError(f"--engine-args takes k=v pairs separated by commas, got {kv!r}")
        k, v = kv.split("=", 1)
        for convert in (int, float):
            try:
                extra[k] = convert(v)
                break
            except ValueError:
                pass
        else:
            extra[k] = {"true": True, "false": False}.get(v.lower(), v)
    return extra


def add_long_prompt_args(p, num_prompts_help: str | None = None) -> None:
    """The options the long-prompt workloads (``long_prompt``, ``shared_prefix``) share: the model, the
    request count and output lengths, dtype, context length and extra engine args."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model", help="a real model instead of a dummy shape")
    p.add_argument("--num-prompts", type=int, default=64, help=num_prompts_help)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt plus output")
    p.add_argument("--engine-args", default="", help="extra EngineArgs as k=v,k=v (ints parsed)")


def warm_llm(args, max_model_len: int, warmup_ids: list[int], **engine_args):
    """An ``LLM`` over ``args.model`` (or ``args.shape``'s dummy weights, no tokenizer), warmed by one
    two-token request of ``warmup_ids`` (compiles and captures before the timed run)."""
    from pagedllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(args.model or write_shape(args.shape), load_format="auto" if args.model else "dummy", dtype=args.dtype,
              skip_tokenizer_init=not args.model, max_model_len=args.max_model_len or max_model_len, **engine_args)
    llm.generate([TokensPrompt(prompt_token_ids=warmup_ids)], SamplingParams(max_tokens=2, detokenize=False),
                 use_tqdm=False)
    return llm


def int_list(text: str) -> list[int]:
    """``1,32`` → [1, 32]."""
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear interpolation between closest ranks (numpy's default)."""
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def ttft_figures(outputs: Sequence) -> dict:
    """TTFT p50 / p90 / p99 in ms of an LLM.generate's RequestOutputs (first token − arrival)."""
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {f"ttft_ms_p{q}": round(percentile(ttfts, q) * 1e3, 2) for q in (50, 90, 99)}


def engine_figures(llm) -> dict:
    """The engine sizes a result depends on: KV blocks, block size, the step's token budget."""
    config = llm.llm_engine.config
    return {"num_kv_blocks": llm.llm_engine.engine_core.kv_cache_manager.num_blocks,
            "block_size": config.cache_config.block_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}


def git_commit() -> str:
    """PAGEDLLM_COMMIT when set (a copied tree without its history), else git's HEAD."""
    if envs.PAGEDLLM_COMMIT:
        return envs.PAGEDLLM_COMMIT
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)),
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def emit(result: dict) -> None:
    """One JSON line per result."""
    result = {"commit": git_commit(), "device": device_name(), "time": time.strftime("%Y-%m-%d %H:%M"), **result}
    print(json.dumps(result), flush=True)


def print_table(rows: Sequence[dict], columns: Sequence[str]) -> None:
    """A plain-text table of ``columns`` from result dicts (missing values print as '-')."""
    cells = [[str(c) for c in columns]] + [["-" if r.get(c) is None else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
