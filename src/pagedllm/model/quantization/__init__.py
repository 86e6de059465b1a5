"""Quantized weights: which method a model runs (``quantization=`` or its config.json's
``quantization_config``), and the method's config that hands every linear layer its weights
and matmul (one file per method: fp8, awq, gptq, compressed_tensors; W4A16 shared in int4).

Which name resolves to what is decided here without torch (the engine args call it); the
configs themselves load lazily."""
from __future__ import annotations

from typing import Any

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")
# vLLM's other names for the same checkpoints (its kernel choices): they run here as the plain method.
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}
# Methods that need no quantization_config: fp8 quantizes a 16/32-bit checkpoint at load; gguf
# runs a GGUF file's 4-bit blocks as they are.
_ONLINE = ("fp8", "gguf")


def checkpoint_quantization_config(hf_config: Any) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def _normalize(name: str) -> str:
    name = str(name).lower()
    return _ALIASES.get(name, name)


def resolve_quantization(hf_config: Any, requested: str | None) -> str | None:
    """The method the model runs: the checkpoint's ``quant_method``, or ``requested``; they must
    agree where both are given. Unknown or unsupported names are a ValueError listing ours."""
    qc = checkpoint_quantization_config(hf_config)
    checkpoint = None
    if qc is not None:
        if "quant_method" not in qc:
            raise ValueError("config.json's quantization_config has no quant_method")
        checkpoint = _normalize(qc["quant_method"])
        if checkpoint not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization_config.quant_method {qc['quant_method']!r} is not supported; supported: "
                             f"{list(QUANTIZATION_METHODS)}")
    if requested is None:
        return checkpoint
    method = _normalize(requested)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {list(QUANTIZATION_METHODS)}")
    if checkpoint is None and method not in _ONLINE:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it (config.json's "
                         f"quantization_config); only {list(_ONLINE)} quantize an unquantized checkpoint at load")
    if checkpoint is not None and method != checkpoint:
        raise ValueError(f"quantization={requested!r} disagrees with the checkpoint's quantization_config.quant_method "
                         f"{qc['quant_method']!r}; leave quantization unset to use the checkpoint's")
    return method


def get_quantization_config(method: str | None, hf_config: Any, gguf_file: str | None = None):
    """The QuantizationConfig of ``method`` (resolved by ``resolve_quantization``) for this model
    (``gguf_file``: its GGUF weights, which ``gguf`` reads the tensor types of)."""
    if method is None:
        return None
    if method == "gguf":
        from pagedllm.model.quantization.gguf import GGUFConfig

        return GGUFConfig.from_gguf(gguf_file)
    qc = checkpoint_quantization_config(hf_config)
    if method == "fp8":
        from pagedllm.model.quantization.fp8 import Fp8Config

        return Fp8Config.from_config(qc)
    if method == "awq":
        from pagedllm.model.quantization.awq import AWQConfig

        return AWQConfig.from_config(qc)
    if method == "gptq":
        from pagedllm.model.quantization.gptq import GPTQConfig

        return GPTQConfig.from_config(qc)
    if method == "compressed-tensors":
        from pagedllm.model.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig.from_config(qc)
    raise ValueError(f"quantization {method!r} is not supported; supported: {list(QUANTIZATION_METHODS)}")
