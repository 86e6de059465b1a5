"""Shared pieces of the benchmarks: model shapes, result lines."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time

# ../shared/BENCHMARKS.md model shapes, as config.json files written on the fly (dummy weights).
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
    # Small enough for a 2-core CPU smoke run of the same code path.
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, intermediate_size=768, vocab_size=32000,
        tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096,
        hidden_act="silu", dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
}


def write_shape(shape: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"pagedllm-{shape}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f)
    return folder


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
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
