"""GGUF files, read once: config, tokenizer and tensor table cached beside each other.

Parsing a GGUF header with the `gguf` package walks every vocabulary entry in Python
(about 5 s for SmolLM2's 49k tokens), and transformers parses it again for the config.
The first load caches what they produce, keyed by the file's path, size and mtime;
later loads memory-map the tensors straight from the file.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedllm import envs
from pagedllm.utils import write_cache_file

_INDEX = "tensor_index.json"


def gguf_cache_dir(gguf_file: str) -> str:
    st = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.abspath(gguf_file)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(envs.cache_root(), "gguf", key)


def load_gguf_config(gguf_file: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a GGUF model (cached as config.json)."""
    import transformers

    cache = gguf_cache_dir(gguf_file)
    if os.path.isfile(os.path.join(cache, "config.json")):
        return transformers.AutoConfig.from_pretrained(cache, trust_remote_code=trust_remote_code)
    config = transformers.AutoConfig.from_pretrained(
        os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file), trust_remote_code=trust_remote_code)
    try:
        config.save_pretrained(cache)
    except OSError:
        pass
    return config


def _tensor_index(gguf_file: str) -> dict[str, Any]:
    """Architecture and, per tensor, its name, quantization type, dtype, shape and offset."""
    path = os.path.join(gguf_cache_dir(gguf_file), _INDEX)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    index = {
        "architecture": reader.get_field("general.architecture").contents(),
        "tensors": [
            {"name": t.name, "qtype": int(t.tensor_type), "dtype": t.data.dtype.str,
             "shape": list(t.data.shape), "offset": int(t.data_offset)}
            for t in reader.tensors
        ],
    }
    write_cache_file(path, json.dumps(index))  # a read-only home still works, only slower to start
    return index


def gguf_architecture(gguf_file: str) -> str:
    return _tensor_index(gguf_file)["architecture"]


def dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """``gguf.quants.dequantize(raw, qtype)``, bit for bit. Q4_0, Q4_1 and Q8_0, what small GGUF
    checkpoints such as the embedded SmolLM2 ship, go through torch on the whole tensor at once:
    gguf's numpy code runs over groups of 16 rows: 1.6-1.9 s for the embedded model's tensors on
    a 2-core VM, against 0.5 s here. Other types: gguf's own code."""
    import gguf

    kind = gguf.GGMLQuantizationType(qtype)
    if kind.name not in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.dequantize(raw, kind)
    import torch

    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    data = np.ascontiguousarray(raw).view(np.uint8)
    out_shape = data.shape[:-1] + (data.shape[-1] // type_size * block_size,)
    blocks = torch.from_numpy(data.reshape(-1, type_size).copy())  # the file's pages are read-only

    def half(lo: int) -> torch.Tensor:  # a float16 field of every block, as float32 [blocks, 1]
        return blocks[:, lo:lo + 2].contiguous().view(torch.float16).float()

    if kind.name == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * half(0)).reshape(out_shape).numpy()
    nibbles = blocks[:, 2 if kind.name == "Q4_0" else 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)  # elements 0-15 in the low nibbles, 16-31 high
    if kind.name == "Q4_0":
        out = half(0) * (q.to(torch.int8) - 8).float()
    else:  # Q4_1: d * q + m, as two roundings
        out = half(0) * q.float() + half(2)
    return out.reshape(out_shape).numpy()


def iterate_gguf_tensors(gguf_file: str) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF tensor name, float32 array in numpy/HF order) for every tensor, dequantized."""
    for name, array, _ in iterate_gguf_tensors_raw(gguf_file, lambda name, qtype: False):
        yield name, array


def gguf_tensor_types(gguf_file: str) -> dict[str, int]:
    """Each tensor's GGML quantization type (gguf.GGMLQuantizationType's value)."""
    return {t["name"]: t["qtype"] for t in _tensor_index(gguf_file)["tensors"]}


def iterate_gguf_tensors_raw(gguf_file: str, keep_raw) -> Iterator[tuple[str, np.ndarray, int | None]]:
    """As ``iterate_gguf_tensors``, but tensors for which ``keep_raw(name, qtype)`` holds come as
    their raw blocks (uint8 [rows, bytes]) with their type; the others dequantized, type None."""
    for t in _tensor_index(gguf_file)["tensors"]:
        raw = np.memmap(gguf_file, dtype=np.dtype(t["dtype"]), mode="r", offset=t["offset"],
                        shape=tuple(t["shape"]))
        if keep_raw(t["name"], t["qtype"]):
            yield t["name"], raw, t["qtype"]
        else:
            yield t["name"], dequantize(raw, t["qtype"]), None


# GGUF tensor names (llama.cpp) -> HF names.
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_SKIPPED = {"rope_freqs"}  # llama3 rope factors; the config's rope scaling recomputes them


def gguf_to_hf_name(name: str) -> str | None:
    base, suffix = name.rsplit(".", 1)
    if base in _GGUF_SKIPPED:
        return None
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{suffix}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no known HF name")
